"""The trainer's settings: iterations, batches and compute (`trainer.*`), the
optimizer (`optimizer.*`), the device mesh (`mesh.*`), checkpoints
(`checkpoint.*`) and the tiny policy's supervised warm-up (`warmstart.*`)."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import need, one_of, positive
from streamrl.models.lora import MAX_LORA_RANK, LoraSpec, parse_targets
from streamrl.models.config import (
    ATTENTION_IMPLS,
    COMPUTE_DTYPES,
    DEFAULT_LOGPROB_CHUNK,
    REMAT_POLICIES,
    ComputeConfig,
)


@dataclasses.dataclass(frozen=True)
class Trainer:
  """Iterations and batch sizes (in samples), and how the trainer computes.

  Weights and optimizer state are always fp32. compute_dtype: the dtype of
  activations and matmuls ("auto": bfloat16 when the generators run bf16,
  i.e. model.dtype, else float32). fp32_lm_head: the last norm, LM head and
  log-softmax in fp32 even under bf16 compute (closer to the generators'
  logprobs). remat: what each decoder block keeps for the backward pass
  ("none": everything; "minimal": q/k/v, the attention output and the MLP
  product; "dots": the weight matmuls' outputs; "full": only its input;
  "auto": the first of those whose memory plan fits the trainer's devices,
  chosen at start by streamrl/trainer/memory_plan.py).
  logprob_chunk: score this many positions at a time, so no fp32 [batch,
  time, vocab] logits exist for a whole sequence (0: all at once).
  attention: "fused" (jax.nn.dot_product_attention) or "reference" (the
  scores spelled out), equal up to rounding.

  precompile: compile every program the trainer can meet (each padded
  length up to the longest prompt plus `sampling.max_tokens`) at start, in
  the background while the generators begin (`RLTrainer.start_warm_up`), so
  no iteration stops to compile a new length. Off by default: the first
  update waits for all of them, and where they take longer to compile than
  the start-up lasts (a cold XLA cache, a larger model on CPU) that wait
  costs more than the few lengths a run meets late (experiments/RESULTS.md,
  bench_peers.py).

  LoRA (`lora_rank` > 0): the actor trains adapters of rank `lora_rank` on
  the `lora_targets` projections ("all", or a comma list of q, k, v, o,
  gate, up, down), scaled by `lora_alpha / lora_rank`, with its own weights
  frozen; the reference policy is the base without the adapter; the critic
  trains in full. The generators receive only the adapter (a vLLM LoRA) for
  each new version (streamrl/models/lora.py).
  """

  num_iterations: int = 250
  prompts_per_iteration: int = 64
  mini_batch_size: int = 32
  micro_batch_size: int = 32
  ppo_epochs: int = 2
  compute_dtype: str = "auto"
  fp32_lm_head: bool = True
  remat: str = "auto"
  logprob_chunk: int = DEFAULT_LOGPROB_CHUNK
  attention: str = "fused"
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: str = "all"
  precompile: bool = False

  def lora_spec(self) -> LoraSpec | None:
    """The actor's adapters (None: full fine-tuning)."""
    if not self.lora_rank:
      return None
    return LoraSpec(self.lora_rank, float(self.lora_alpha), parse_targets(self.lora_targets))

  def compute(self, model_dtype: str) -> ComputeConfig:
    """How the forward passes run; compute_dtype="auto" follows the generators
    (`model.dtype`): bfloat16 when they run bf16, else float32 (a float16
    generator gets an fp32 trainer: fp16 training would need loss scaling)."""
    dtype = self.compute_dtype
    if dtype == "auto":
      dtype = "bfloat16" if model_dtype == "bfloat16" else "float32"
    return ComputeConfig(
        dtype=dtype,
        fp32_lm_head=self.fp32_lm_head,
        remat="none" if self.remat == "auto" else self.remat,
        logprob_chunk=self.logprob_chunk,
        attention=self.attention,
    )

  def check(self) -> None:
    for key in (
        "num_iterations",
        "prompts_per_iteration",
        "mini_batch_size",
        "micro_batch_size",
        "ppo_epochs",
    ):
      positive(f"trainer.{key}", getattr(self, key))
    need(
        self.mini_batch_size % self.micro_batch_size == 0,
        f"trainer.mini_batch_size={self.mini_batch_size} is not a multiple of "
        f"trainer.micro_batch_size={self.micro_batch_size}; change one of them.",
    )
    need(
        self.compute_dtype in ("auto",) + COMPUTE_DTYPES,
        f"trainer.compute_dtype={self.compute_dtype!r} is not supported; use one of "
        f"{('auto',) + COMPUTE_DTYPES} (float16 training would need loss scaling).",
    )
    one_of("trainer.remat", self.remat, ("auto",) + REMAT_POLICIES)
    one_of("trainer.attention", self.attention, ATTENTION_IMPLS)
    positive("trainer.lora_rank", self.lora_rank, zero_ok=True)
    need(
        self.lora_rank <= MAX_LORA_RANK,
        f"trainer.lora_rank={self.lora_rank} is above {MAX_LORA_RANK}, the largest rank the "
        "generators' LoRA kernels take; pick a smaller rank.",
    )
    if self.lora_rank:
      positive("trainer.lora_alpha", self.lora_alpha)
      try:
        parse_targets(self.lora_targets)
      except ValueError as e:
        need(False, str(e))
    need(
        self.logprob_chunk >= 0,
        f"trainer.logprob_chunk={self.logprob_chunk} must be >= 0 (positions scored at a "
        "time; 0 scores all at once).",
    )


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """AdamW, warm-up then cosine decay, global-norm clipping (`optimizer.*`).

  `critic_lr` is the critic's learning rate (its schedule is the actor's;
  checked only when there is a critic).
  """

  lr: float = 3e-4
  critic_lr: float = 1e-3
  warmup_steps: int = 5
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  # The cosine decay ends at lr * min_lr_ratio after the run's optimizer steps.
  min_lr_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  # AdamW's first moment in this dtype ("bfloat16" halves its memory; the second
  # moment and the weights stay fp32).
  mu_dtype: str = "float32"

  def check(self) -> None:
    positive("optimizer.lr", self.lr)
    one_of("optimizer.mu_dtype", self.mu_dtype, ("float32", "bfloat16"))
    need(
        0 <= self.min_lr_ratio <= 1,
        f"optimizer.min_lr_ratio={self.min_lr_ratio} must be in [0, 1].",
    )
    need(
        0 <= self.b1 < 1 and 0 <= self.b2 < 1,
        f"optimizer.b1={self.b1} and optimizer.b2={self.b2} must be in [0, 1).",
    )
    positive("optimizer.warmup_steps", self.warmup_steps, zero_ok=True)
    positive("optimizer.weight_decay", self.weight_decay, zero_ok=True)
    positive("optimizer.grad_clip", self.grad_clip)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """The trainer's device mesh (-1: all remaining devices)."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def axes(self) -> dict:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

  def check(self) -> None:
    for axis, size in self.axes().items():
      need(size >= 1 or size == -1, f"mesh.{axis}={size} must be >= 1, or -1 for the rest.")
    need(sum(v == -1 for v in self.axes().values()) <= 1, "at most one mesh axis may be -1.")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """Orbax checkpoints in <workdir>/checkpoints: every `every` iterations, the
  newest `keep` kept; at the end the trained policy as a Hugging Face
  directory, <workdir>/hf (`export_hf`; `launch/export.py` writes one of any
  saved step)."""

  every: int = 25
  keep: int = 2
  export_hf: bool = True

  def check(self) -> None:
    positive("checkpoint.every", self.every)
    positive("checkpoint.keep", self.keep)


@dataclasses.dataclass(frozen=True)
class Warmstart:
  """Supervised warm-up of the tiny policy (`warmstart.*`; cached in the workdir)."""

  steps: int = 150
  batch_size: int = 64
  lr: float = 3e-3
  num_examples: int = 20000

  def check(self) -> None:
    positive("warmstart.steps", self.steps, zero_ok=True)
    if self.steps:
      positive("warmstart.batch_size", self.batch_size)
      positive("warmstart.lr", self.lr)
      positive("warmstart.num_examples", self.num_examples)
