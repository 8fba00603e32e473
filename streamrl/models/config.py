"""Shape and numerics of the Qwen2 / Llama decoder family."""

from __future__ import annotations

import dataclasses

from streamrl.config_checks import one_of

# vLLM's CPU attention kernels exist for these head sizes only.
CPU_SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Activation / matmul dtypes a forward pass can run in (master weights stay fp32).
COMPUTE_DTYPES = ("float32", "bfloat16")
# What a rematerialised decoder block keeps for the backward pass:
#   none  no remat: every intermediate is kept (fastest, most memory);
#   full  only the block's input: everything is recomputed;
#   dots  the weight projections' outputs (q/k/v/o, MLP): the attention
#         scores, softmax and elementwise ops are recomputed.
REMAT_POLICIES = ("none", "full", "dots")
# Positions scored at a time by default (trainer.logprob_chunk): [b, 512, vocab]
# fp32 logits at most, whatever the sequence length.
DEFAULT_LOGPROB_CHUNK = 512


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


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
  """How a forward pass runs, as opposed to what the model is (`ModelConfig`).

  Static under jit (frozen, hashable); the same parameters give the same
  log-probabilities under every setting, up to the rounding of `dtype`.

  Attributes:
    dtype: activations and matmul inputs ("float32" | "bfloat16"). Weights are
      stored in fp32 and cast to it where they are used, inside the jitted
      forward; RMSNorm, RoPE and the attention softmax always run in fp32.
    fp32_lm_head: the last norm's output, the LM head (or the critic's value
      head) and the log-softmax in fp32 whatever `dtype` is. Logits are fp32
      in either case; without it the head's matmul reads bf16 inputs.
    remat: rematerialisation of each decoder block (`REMAT_POLICIES`), with
      jax.checkpoint, whose recomputation is kept apart from the forward pass
      by optimization barriers. XLA's GPU compiler keeps them until after
      scheduling; its CPU compiler drops them before CSE, which merges the
      recomputation back into the forward pass: on CPU remat costs time and
      saves no memory (measured), so use it on accelerators.
    logprob_chunk: score tokens this many positions at a time, so no fp32
      [b, t, vocab] logits tensor exists for the whole sequence (0: all at
      once). The results equal the unchunked ones.
  """

  dtype: str = "float32"
  fp32_lm_head: bool = True
  remat: str = "none"
  logprob_chunk: int = DEFAULT_LOGPROB_CHUNK

  @property
  def head_dtype(self) -> str:
    """The dtype of the last norm's output and of the head's matmul inputs."""
    return "float32" if self.fp32_lm_head else self.dtype

  def __post_init__(self):
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"compute dtype {self.dtype!r} is unknown; use one of {COMPUTE_DTYPES}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat policy {self.remat!r} is unknown; use one of {REMAT_POLICIES}.")
    if self.logprob_chunk < 0:
      raise ValueError(f"logprob_chunk={self.logprob_chunk} must be >= 0 (0: unchunked).")


# ------------------------------------------------------------ run settings
TINY_MODELS = ("qwen2", "llama")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Model:
  """The policy (`model.*`): a local HF directory, or (empty path) the tiny default."""

  path: str = ""
  tiny: str = "qwen2"
  # The generators' weights and activations (the trainer keeps fp32 weights).
  dtype: str = "float32"

  def check(self) -> None:
    one_of("model.dtype", self.dtype, DTYPES)
    if not self.path:
      one_of("model.tiny", self.tiny, TINY_MODELS)
