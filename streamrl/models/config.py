"""Shape and numerics of the Qwen2 / Qwen3 / Llama / Mistral decoder family."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import need, one_of

# vLLM's CPU attention kernels exist for these head sizes only.
CPU_SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Activation / matmul dtypes a forward pass can run in (master weights stay fp32).
COMPUTE_DTYPES = ("float32", "bfloat16")
# What a rematerialised decoder block keeps for the backward pass:
#   none  no remat: every intermediate is kept (fastest, most memory);
#   full  only the block's input: everything is recomputed;
#   dots  the weight projections' outputs (q/k/v/o, MLP): the attention
#         scores, softmax and elementwise ops are recomputed.
#   minimal  the q/k/v projections, the attention output and the MLP's hidden
#         activations (named with `checkpoint_name`): only norms, RoPE,
#         elementwise ops and the attention core are recomputed.
REMAT_POLICIES = ("none", "full", "dots", "minimal")
# How attention runs (`ComputeConfig.attention`):
#   fused      jax.nn.dot_product_attention with causal masking and grouped kv
#              heads (cuDNN's fused kernel on GPUs where it applies, XLA's
#              otherwise);
#   reference  the scores spelled out as einsums, masked by positions (also what
#              runs whenever explicit positions are passed).
ATTENTION_IMPLS = ("fused", "reference")
# Positions scored at a time by default (trainer.logprob_chunk): [b, 512, vocab]
# fp32 logits at most, whatever the sequence length.
DEFAULT_LOGPROB_CHUNK = 512


FAMILIES = ("qwen2", "qwen3", "llama", "mistral")
# RoPE variants the model implements (`RopeScaling.rope_type`); "default" is
# unscaled RoPE, written as `rope_scaling=None`.
ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A scaled RoPE's parameters, as HF's `rope_scaling` / `rope_parameters`.

  Attributes:
    rope_type: "linear" (every inverse frequency divided by `factor`) or
      "llama3" (Llama 3.1: wavelengths longer than
      original_max_position_embeddings / low_freq_factor divided by `factor`,
      shorter than original_max_position_embeddings / high_freq_factor kept,
      and the ones in between interpolated).
    factor: the context-extension factor.
    low_freq_factor, high_freq_factor, original_max_position_embeddings:
      llama3 only (ignored by "linear").
  """

  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ROPE_SCALING_TYPES:
      raise ValueError(
          f"RoPE scaling {self.rope_type!r} is not implemented; use one of {ROPE_SCALING_TYPES}."
      )
    if self.factor <= 0:
      raise ValueError(f"RoPE scaling factor={self.factor} must be > 0.")
    if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(
          f"llama3 RoPE needs high_freq_factor ({self.high_freq_factor}) > low_freq_factor "
          f"({self.low_freq_factor})."
      )

  def hf_dict(self) -> dict:
    """The `rope_scaling` entry of an HF config.json."""
    out = {"rope_type": self.rope_type, "factor": self.factor}
    if self.rope_type == "llama3":
      out["low_freq_factor"] = self.low_freq_factor
      out["high_freq_factor"] = self.high_freq_factor
      out["original_max_position_embeddings"] = self.original_max_position_embeddings
    return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer (Qwen2/3, Llama, Mistral).

  `family` decides the HF architecture name written on export; the math is
  shared, the differences are the flags: `qkv_bias` (Qwen2), `qk_norm` (Qwen3:
  a per-head RMSNorm on queries and keys before RoPE), `tie_embeddings`,
  `rope_theta` and `rope_scaling` (Llama 3.1+). Mistral is Llama-shaped.
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
  family: str = "qwen2"  # one of FAMILIES
  qk_norm: bool = False
  rope_scaling: RopeScaling | None = None  # None: default (unscaled) RoPE

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"Unsupported model family {self.family!r}; use one of {FAMILIES}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} for grouped-query attention."
      )
    # The HF architecture written on export fixes these two flags.
    if self.qk_norm != (self.family == "qwen3"):
      raise ValueError(
          f"qk_norm={self.qk_norm} does not fit family {self.family!r}: Qwen3 always has "
          "q/k norms and the other families never do."
      )
    if self.qkv_bias and self.family in ("qwen3", "mistral"):
      raise ValueError(f"family {self.family!r} has no q/k/v bias; set qkv_bias=False.")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(
          f"rope_scaling must be a RopeScaling or None, not {type(self.rope_scaling).__name__}."
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
    if self.qk_norm:
      attn += 2 * hd
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


def mid_qwen2(vocab_size: int = 32000) -> ModelConfig:
  """The benchmark model: a Qwen2 shape (tied embeddings, q/k/v bias, grouped
  kv heads of head_dim 64) big enough that generation and training cost like a
  real model's per token (~41M params with the 32,000-piece vocabulary), small
  enough to warm-start on a CPU."""
  return ModelConfig(
      vocab_size=vocab_size,
      hidden_size=512,
      intermediate_size=1536,
      num_layers=8,
      num_heads=8,
      num_kv_heads=2,
      head_dim=64,
      rope_theta=1000000.0,
      rms_norm_eps=1e-6,
      tie_embeddings=True,
      qkv_bias=True,
      max_position_embeddings=2048,
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


def tiny_qwen3(vocab_size: int = 64) -> ModelConfig:
  """Qwen3-style test config: q/k norms, no bias, tied, head_dim 32 wider than
  hidden_size / num_heads (16), as Qwen3's explicit head_dim allows."""
  return ModelConfig(
      vocab_size=vocab_size,
      hidden_size=64,
      intermediate_size=192,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=32,
      rope_theta=1000000.0,
      rms_norm_eps=1e-6,
      tie_embeddings=True,
      qkv_bias=False,
      max_position_embeddings=512,
      family="qwen3",
      qk_norm=True,
  )


def tiny_llama3(vocab_size: int = 64) -> ModelConfig:
  """`tiny_llama` with Llama 3.1's RoPE scaling. The pre-training context (64)
  is set so low that the 16 frequencies of head_dim 32 fall in all three
  regimes (2 kept, 1 interpolated, 13 divided by the factor) and the scaling
  shows within a few dozen positions."""
  return dataclasses.replace(
      tiny_llama(vocab_size),
      rope_scaling=RopeScaling(
          "llama3",
          factor=8.0,
          low_freq_factor=1.0,
          high_freq_factor=4.0,
          original_max_position_embeddings=64,
      ),
  )


def tiny_mistral(vocab_size: int = 64) -> ModelConfig:
  """Mistral-style test config (no sliding window): Llama-shaped, untied, and a
  head_dim (64) that is not hidden_size / num_heads (32)."""
  return ModelConfig(
      vocab_size=vocab_size,
      hidden_size=128,
      intermediate_size=256,
      num_layers=2,
      num_heads=4,
      num_kv_heads=1,
      head_dim=64,
      rope_theta=1000000.0,
      rms_norm_eps=1e-5,
      tie_embeddings=False,
      qkv_bias=False,
      max_position_embeddings=512,
      family="mistral",
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
    attention: `ATTENTION_IMPLS`; both give the same results up to rounding.
  """

  dtype: str = "float32"
  fp32_lm_head: bool = True
  remat: str = "none"
  logprob_chunk: int = DEFAULT_LOGPROB_CHUNK
  attention: str = "fused"

  @property
  def head_dtype(self) -> str:
    """The dtype of the last norm's output and of the head's matmul inputs."""
    return "float32" if self.fp32_lm_head else self.dtype

  def __post_init__(self):
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"compute dtype {self.dtype!r} is unknown; use one of {COMPUTE_DTYPES}.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat policy {self.remat!r} is unknown; use one of {REMAT_POLICIES}.")
    if self.attention not in ATTENTION_IMPLS:
      raise ValueError(f"attention {self.attention!r} is unknown; use one of {ATTENTION_IMPLS}.")
    if self.logprob_chunk < 0:
      raise ValueError(f"logprob_chunk={self.logprob_chunk} must be >= 0 (0: unchunked).")


# ------------------------------------------------------------ run settings
# The built-in policies (`model.tiny`): the tiny test shapes, and "qwen2_mid"
# (`mid_qwen2`), the benchmark model, which needs model.tokenizer=sentencepiece.
TINY_MODELS = ("qwen2", "llama", "qwen3", "qwen2_mid")
TINY_TOKENIZERS = ("chars", "sentencepiece")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Model:
  """The policy (`model.*`): a local HF directory, or (empty path) a built-in one."""

  path: str = ""
  # The built-in policy's shape (`TINY_MODELS`): "qwen2" the tiny default,
  # "qwen2_mid" the benchmark model (Qwen2 shape, ~41M params, ChatML chat
  # template; with model.tokenizer=sentencepiece and model.dtype=bfloat16 it is
  # experiments/harness.py's `--model=mid`).
  tiny: str = "qwen2"
  # The tiny model's tokenizer: "chars" (the synthetic tasks' character
  # tokenizer) or "sentencepiece" (mistral-common's real 32,000-piece one,
  # with a chat template; the model's vocabulary follows it).
  tokenizer: str = "chars"
  # The generators' weights and activations (the trainer keeps fp32 weights).
  dtype: str = "float32"

  def check(self) -> None:
    one_of("model.dtype", self.dtype, DTYPES)
    if not self.path:
      one_of("model.tiny", self.tiny, TINY_MODELS)
      one_of("model.tokenizer", self.tokenizer, TINY_TOKENIZERS)
      need(
          self.tiny != "qwen2_mid" or self.tokenizer == "sentencepiece",
          "model.tiny=qwen2_mid is built with the 32,000-piece tokenizer; set "
          "--config.model.tokenizer=sentencepiece.",
      )
