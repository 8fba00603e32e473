"""Shape and numerics of the Qwen2 / Llama decoder family."""

from __future__ import annotations

import dataclasses

# vLLM's CPU attention kernels exist for these head sizes only.
CPU_SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer (Qwen2 or Llama style).

  `family` decides the HF architecture name written on export; the math is the
  same for both, the differences are the flags (`qkv_bias`, `tie_embeddings`,
  `rope_theta`).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  max_position_embeddings: int = 4096
  family: str = "qwen2"  # "qwen2" | "llama"

  def __post_init__(self):
    if self.family not in ("qwen2", "llama"):
      raise ValueError(f"Unsupported model family {self.family!r}; use 'qwen2' or 'llama'.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} for grouped-query attention."
      )

  @property
  def num_params(self) -> int:
    d, i, h, k, hd = (
        self.hidden_size,
        self.intermediate_size,
        self.num_heads,
        self.num_kv_heads,
        self.head_dim,
    )
    attn = d * h * hd + 2 * d * k * hd + h * hd * d
    if self.qkv_bias:
      attn += h * hd + 2 * k * hd
    layer = attn + 3 * d * i + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + emb + d


def tiny_qwen2(vocab_size: int = 64) -> ModelConfig:
  """The laptop default: Qwen2-style (tied embeddings, q/k/v bias), ~0.8M params."""
  return ModelConfig(
      vocab_size=vocab_size,
      hidden_size=128,
      intermediate_size=384,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=32,
      rope_theta=10000.0,
      rms_norm_eps=1e-6,
      tie_embeddings=True,
      qkv_bias=True,
      max_position_embeddings=512,
      family="qwen2",
  )


def tiny_llama(vocab_size: int = 64) -> ModelConfig:
  """Llama-style test config: untied, no bias, other head counts and theta."""
  return ModelConfig(
      vocab_size=vocab_size,
      hidden_size=192,
      intermediate_size=320,
      num_layers=2,
      num_heads=6,
      num_kv_heads=3,
      head_dim=32,
      rope_theta=500000.0,
      rms_norm_eps=1e-5,
      tie_embeddings=False,
      qkv_bias=False,
      max_position_embeddings=512,
      family="llama",
  )
