"""Typed run settings: the one place that reads and checks the config.

A run config is a plain `ml_collections.ConfigDict` (configs/*.py), so every
field can be overridden on the command line. `from_config` maps it, key by
key, onto the frozen dataclasses below (one per part of the system) and
checks every value before anything heavy starts. Lower modules receive only
their own part (the engine gets `Engine`, the trainer `Optimizer`, `Loss`,
...), never the ConfigDict.

Every field names the config key it is read from (`_key`), and its default
lives here and nowhere else: `default_config()` builds the complete config
from these defaults, and the files in configs/ start from it.

  config = settings.default_config()        # every key, with its default
  s = settings.from_config(config)          # typed, validated; UserError if not
  s.sampling.temperature, s.loss.clip_low, s.pipeline.mode
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ml_collections

from streamrl.errors import UserError
from streamrl.models.config import COMPUTE_DTYPES, DEFAULT_LOGPROB_CHUNK, REMAT_POLICIES
from streamrl.scheduling.policy import SCHEDULERS

PIPELINE_MODES = ("colocated", "sync", "stream", "async")
ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp")
LOSS_AGGS = ("token_mean", "token_sum_norm", "seq_mean_token_mean", "seq_mean_token_sum")
KL_ESTIMATORS = ("k1", "k2", "k3")
ROLLOUT_CORRECTIONS = ("auto", "none", "tis", "mis")
DISPATCH_OBJECTIVES = ("makespan", "mean")
LATENCY_MODELS = ("paper", "simulate")
DTYPES = ("float32", "bfloat16", "float16")
TASK_KINDS = ("trace", "synthetic", "jsonl")
TINY_MODELS = ("qwen2", "llama")


def _key(key: str, default: Any):
  """A settings field read from config key `key` (dotted), with its default."""
  return dataclasses.field(default=default, metadata={"key": key})


# ------------------------------------------------------------------- parts
@dataclasses.dataclass(frozen=True)
class Model:
  """The policy: a local HF directory, or (empty path) the tiny default."""

  path: str = _key("model.path", "")
  tiny: str = _key("model.tiny", "qwen2")
  dtype: str = _key("model.dtype", "float32")


@dataclasses.dataclass(frozen=True)
class Warmstart:
  """Supervised warm-up of the tiny policy (cached in the workdir)."""

  steps: int = _key("warmstart.steps", 150)
  batch_size: int = _key("warmstart.batch_size", 64)
  lr: float = _key("warmstart.lr", 3e-3)
  num_examples: int = _key("warmstart.num_examples", 20000)


@dataclasses.dataclass(frozen=True)
class Task:
  """Prompts and their verifier: synthetic string tasks or a JSONL file."""

  kind: str = _key("task.kind", "synthetic")
  ops: tuple = _key("task.ops", ("cpy", "rev", "dbl"))
  max_answer_len: int = _key("task.max_answer_len", 48)
  # kind="trace": passes over the input before the answer, geometric with mean
  # trace_base_passes + trace_passes_per_char * len(input) (streamrl/data/tasks.py).
  trace_base_passes: float = _key("task.trace_base_passes", 0.5)
  trace_passes_per_char: float = _key("task.trace_passes_per_char", 0.125)
  # The warm-up's traces fit this fraction of generation.max_tokens. Below 1,
  # a sampled trace that overshoots still finishes instead of being cut
  # (reward 0), so RL is not pushed to drop the long traces.
  trace_token_fraction: float = _key("task.trace_token_fraction", 1.0)
  reward: str = _key("task.reward", "partial_match")
  jsonl_path: str = _key("task.jsonl_path", "")
  num_eval: int = _key("task.num_eval", 256)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the generators sample (the trainer scores at the same temperature)."""

  temperature: float = _key("generation.temperature", 1.0)
  top_p: float = _key("generation.top_p", 1.0)
  max_tokens: int = _key("generation.max_tokens", 56)


@dataclasses.dataclass(frozen=True)
class Engine:
  """One vLLM engine (generator instance) and how many of them run."""

  max_num_seqs: int = _key("generation.max_num_seqs", 128)
  max_model_len: int = _key("generation.max_model_len", 128)
  kv_cache_gib: float = _key("generation.kv_cache_gib", 1.0)
  num_instances: int = _key("generation.num_instances", 1)
  # Ray generators: samples finishing within this many seconds travel to the
  # trainer as one object (0: one object per sample).
  coalesce_s: float = _key("generation.coalesce_s", 0.02)
  # CPU engines: run vLLM's engine core inside the actor's process (fast
  # start, every thread pinned) rather than as a child process. GPU engines
  # always keep vLLM's engine-core process.
  in_process: bool = _key("cluster.engine_in_process", True)
  # GPUs each Ray generator instance asks Ray for (0: a CPU engine, pinned
  # to its own cores); the engine shards over them with tensor parallelism.
  gpus_per_instance: int = _key("generation.gpus_per_instance", 0)
  tensor_parallel_size: int = _key("generation.tensor_parallel_size", 1)
  # GPU engines: the fraction of GPU memory vLLM takes for weights + KV cache
  # (CPU engines size their KV cache by kv_cache_gib instead).
  gpu_memory_utilization: float = _key("generation.gpu_memory_utilization", 0.85)
  # GPU engines capture CUDA graphs unless True; CPU engines always run eager.
  enforce_eager: bool = _key("generation.enforce_eager", False)


@dataclasses.dataclass(frozen=True)
class Scheduler:
  """Which instance generates which prompt, in which order.

  kind: fifo | skew (ranker + Algorithm 2 dispatch + LPT) | oracle (true
  lengths, synthetic tasks). latency_model: "paper" (PTL(BS) * L_avg *
  ceil(M/BS)) or "simulate" (replays continuous batching through the profile).
  """

  kind: str = _key("generation.scheduler", "fifo")
  long_tail_alpha: float = _key("generation.long_tail_alpha", 0.2)
  objective: str = _key("generation.dispatch_objective", "makespan")
  latency_model: str = _key("generation.dispatch_latency_model", "paper")
  latency_profile: str = _key("generation.latency_profile", "")
  ranker_config: str = _key("generation.ranker_config", "configs/ranker.py:tiny")
  ranker_checkpoint: str = _key("generation.ranker_checkpoint", "")
  length_history: int = _key("generation.length_history", 1024)
  # Where the skew scheduler's ranker predicts and refreshes when the
  # generators are Ray actors: "generators" (its own process beside them, so
  # the trainer's cores only train) or "trainer" (in the trainer's process).
  ranker_side: str = _key("generation.ranker_side", "generators")
  # Group-aware length prediction (streamrl/scheduling/siblings.py): "on"
  # keeps each prompt's samples on one instance, which admits one per prompt
  # first and orders the rest by what their finished siblings say.
  sibling_lengths: str = _key("generation.sibling_lengths", "off")


@dataclasses.dataclass(frozen=True)
class Advantage:
  """Advantage estimator; `group_size` samples per prompt."""

  estimator: str = _key("algo.advantage", "gae")
  gamma: float = _key("algo.gamma", 1.0)
  lam: float = _key("algo.lam", 0.95)
  group_size: int = _key("algo.group_size", 1)
  whiten: bool = _key("algo.whiten_advantages", True)
  use_critic: bool = _key("algo.use_critic", True)


@dataclasses.dataclass(frozen=True)
class Kl:
  """KL to a frozen reference: a reward penalty (PPO) or a loss term (GRPO)."""

  coef: float = _key("algo.kl_coef", 0.01)
  estimator: str = _key("algo.kl_estimator", "k1")
  in_reward: bool = _key("algo.kl_in_reward", True)
  use_reference: bool = _key("algo.use_reference", True)


@dataclasses.dataclass(frozen=True)
class Loss:
  """The clipped policy loss, value loss and rollout correction.

  rollout_correction: none | tis (token-level truncated importance weights
  trainer/generator, capped at is_cap) | mis (drop samples whose per-token
  geometric-mean ratio leaves [1/mis_threshold, mis_threshold]) | auto (tis
  in async mode, where samples come from older weights; none otherwise).
  """

  clip_low: float = _key("algo.clip_low", 0.2)
  clip_high: float = _key("algo.clip_high", 0.2)
  dual_clip: float = _key("algo.dual_clip", 0.0)
  agg: str = _key("algo.loss_agg", "token_mean")
  entropy_coef: float = _key("algo.entropy_coef", 0.0)
  vf_clip: float = _key("algo.vf_clip", 0.2)
  rollout_correction: str = _key("algo.rollout_correction", "auto")
  is_cap: float = _key("algo.is_cap", 2.0)
  mis_threshold: float = _key("algo.mis_threshold", 2.0)


@dataclasses.dataclass(frozen=True)
class Trainer:
  """Iterations and batch sizes (in samples), and how the trainer computes.

  Weights and optimizer state are always fp32. compute_dtype: the dtype of
  activations and matmuls ("auto": bfloat16 when the generators run bf16,
  i.e. model.dtype, else float32). fp32_lm_head: the last norm, LM head and
  log-softmax in fp32 even under bf16 compute (closer to the generators'
  logprobs). remat: what each decoder block keeps for the backward pass
  ("none", "full": only its input, "dots": the weight matmuls' outputs).
  logprob_chunk: score this many positions at a time, so no fp32 [batch,
  time, vocab] logits exist for a whole sequence (0: all at once).
  """

  num_iterations: int = _key("trainer.num_iterations", 250)
  prompts_per_iteration: int = _key("trainer.prompts_per_iteration", 64)
  mini_batch_size: int = _key("trainer.mini_batch_size", 32)
  micro_batch_size: int = _key("trainer.micro_batch_size", 32)
  ppo_epochs: int = _key("trainer.ppo_epochs", 2)
  compute_dtype: str = _key("trainer.compute_dtype", "auto")
  fp32_lm_head: bool = _key("trainer.fp32_lm_head", True)
  remat: str = _key("trainer.remat", "none")
  logprob_chunk: int = _key("trainer.logprob_chunk", DEFAULT_LOGPROB_CHUNK)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """AdamW, warm-up then cosine decay, global-norm clipping."""

  lr: float = _key("trainer.lr", 3e-4)
  critic_lr: float = _key("trainer.critic_lr", 1e-3)
  warmup_steps: int = _key("trainer.warmup_steps", 5)
  weight_decay: float = _key("trainer.weight_decay", 0.0)
  grad_clip: float = _key("trainer.grad_clip", 1.0)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """The trainer's device mesh (-1: all remaining devices)."""

  data: int = _key("mesh.data", 1)
  fsdp: int = _key("mesh.fsdp", -1)
  tensor: int = _key("mesh.tensor", 1)

  def axes(self) -> dict:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """How generation and training overlap (streamrl/pipeline)."""

  mode: str = _key("pipeline.mode", "colocated")
  max_staleness: int = _key("pipeline.max_staleness", 1)
  stall_timeout_s: float = _key("pipeline.stall_timeout_s", 600.0)
  # Partial rollouts (async only; streamrl/pipeline/partial.py): "on" asks
  # each round for `partial_oversample` more prompt groups than it trains,
  # stops the round once enough groups finished and resumes the unfinished
  # responses next round under the new weights. A token more than
  # `max_token_version_gap` versions older than the weights it is trained
  # with is never trained on: its response starts again. "auto": on in
  # async mode, off in the others (the run configs' choice, so that
  # `--config.pipeline.mode=sync` needs nothing else).
  partial: str = _key("generation.partial", "off")
  partial_oversample: float = _key("generation.partial_oversample", 0.25)
  max_token_version_gap: int = _key("generation.max_token_version_gap", 2)


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Ray: an empty address starts a local Ray where each side gets its own
  cores; the trainer runs as a Ray actor on the `training_pool` unless
  trainer_actor is False (handy under a debugger)."""

  address: str = _key("cluster.address", "")
  generator_cpus: int = _key("cluster.generator_cpus", 1)
  trainer_cpus: int = _key("cluster.trainer_cpus", 1)
  trainer_gpus: int = _key("cluster.trainer_gpus", 0)
  # Trainer processes (Ray actors, one JAX runtime; streamrl/trainer/multihost.py).
  trainer_processes: int = _key("cluster.trainer_processes", 1)
  connect_timeout_s: float = _key("cluster.connect_timeout_s", 30.0)
  trainer_actor: bool = _key("cluster.trainer_actor", True)
  # Placement on a multi-node cluster (launch/cluster.py starts one on a
  # single machine). Each generator instance takes one unit of the Ray
  # resource `generation_pool`, each trainer process one of `training_pool`;
  # the *_labels (comma-separated key=value, e.g. "datacenter=dc1,
  # accelerator=H20") further restrict them to Ray nodes carrying those
  # labels (`ray start --labels=...`). A process's datacenter is its node's
  # `datacenter` label ("dc0" when it has none).
  generation_pool: str = _key("cluster.generation_pool", "generation_pool")
  training_pool: str = _key("cluster.training_pool", "training_pool")
  generation_labels: str = _key("cluster.generation_labels", "")
  training_labels: str = _key("cluster.training_labels", "")


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Weights to Ray generators through the checkpoint-transfer service
  (streamrl/transfer) instead of Ray's object store."""

  enabled: bool = _key("transfer.enabled", False)
  chunk_bytes: int = _key("transfer.chunk_bytes", 4 << 20)
  topology: str = _key("transfer.topology", "tree")
  fanout: int = _key("transfer.fanout", 2)
  use_shm: bool = _key("transfer.use_shm", True)
  delta_cross_dc: bool = _key("transfer.delta_cross_dc", False)
  # The address the publisher and receivers listen on. Beyond loopback every
  # receiver checks a per-run shared secret before it loads anything.
  bind: str = _key("transfer.bind", "127.0.0.1")
  # Emulated link rates in bytes/s (0: unlimited), for tests and demos of a
  # cross-datacenter edge on one machine.
  cross_dc_bytes_per_s: float = _key("transfer.cross_dc_bytes_per_s", 0.0)
  uplink_bytes_per_s: float = _key("transfer.uplink_bytes_per_s", 0.0)

  def service_options(self) -> dict:
    """The streamrl.transfer.TransferConfig fields."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("enabled", "bind")}


@dataclasses.dataclass(frozen=True)
class Elastic:
  """Generator instances added and removed during a run
  (streamrl/planner/elastic.py has the rule).

  After each iteration the policy compares the measured generation and
  training times: it adds an instance when generation is the slower stage by
  more than one more instance is expected to save and the generation pool
  has a free slot; it releases an added instance whose measured saving
  (median over `observe_iterations` iterations) falls below `min_gain` of the
  expected one, and one instance when training stays the slower stage even
  without it. After an addition that did not pay it waits
  `cooldown_iterations` (doubled for every such addition) before adding
  again. A dead instance is replaced when `replace_dead`. `schedule` forces
  changes instead of the policy, e.g. "2:+1,4:-1" (after iteration 2 add
  one, after 4 remove one): for tests and demos.
  """

  enabled: bool = _key("elastic.enabled", False)
  min_instances: int = _key("elastic.min_instances", 1)
  max_instances: int = _key("elastic.max_instances", 4)
  observe_iterations: int = _key("elastic.observe_iterations", 2)
  min_gain: float = _key("elastic.min_gain", 0.5)
  cooldown_iterations: int = _key("elastic.cooldown_iterations", 4)
  replace_dead: bool = _key("elastic.replace_dead", True)
  # Iterations the policy never looks at (the trainer compiles its steps there).
  warmup_iterations: int = _key("elastic.warmup_iterations", 1)
  schedule: str = _key("elastic.schedule", "")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  every: int = _key("checkpoint.every", 25)
  keep: int = _key("checkpoint.keep", 2)


@dataclasses.dataclass(frozen=True)
class Log:
  eval_every: int = _key("log.eval_every", 25)
  progress: bool = _key("log.progress", True)


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything a run reads, by part."""

  seed: int = _key("seed", 0)
  model: Model = Model()
  warmstart: Warmstart = Warmstart()
  task: Task = Task()
  sampling: Sampling = Sampling()
  engine: Engine = Engine()
  scheduler: Scheduler = Scheduler()
  advantage: Advantage = Advantage()
  kl: Kl = Kl()
  loss: Loss = Loss()
  trainer: Trainer = Trainer()
  optimizer: Optimizer = Optimizer()
  mesh: Mesh = Mesh()
  pipeline: Pipeline = Pipeline()
  cluster: Cluster = Cluster()
  transfer: Transfer = Transfer()
  elastic: Elastic = Elastic()
  checkpoint: Checkpoint = Checkpoint()
  log: Log = Log()

  @property
  def samples_per_iteration(self) -> int:
    return self.trainer.prompts_per_iteration * self.advantage.group_size

  @property
  def rollout_correction(self) -> str:
    """The effective correction (`auto` resolved by mode)."""
    if self.loss.rollout_correction != "auto":
      return self.loss.rollout_correction
    return "tis" if self.pipeline.mode == "async" else "none"

  @property
  def partial_rollouts(self) -> bool:
    """Whether rounds resume unfinished responses (`auto` resolved by mode)."""
    partial = self.pipeline.partial
    return partial == "on" or (partial == "auto" and self.pipeline.mode == "async")

  @property
  def gpus_needed(self) -> int:
    """GPUs the run asks Ray for: the trainer's plus, when the generators are
    Ray actors (not colocated), each instance's."""
    gen = 0
    if self.pipeline.mode != "colocated":
      gen = self.engine.num_instances * self.engine.gpus_per_instance
    return self.cluster.trainer_gpus + gen

  @property
  def trainer_cpu_devices_per_process(self) -> int | None:
    """On CPU with several trainer processes and a fully fixed mesh: the
    devices each process offers (mesh size / processes); None otherwise
    (each process keeps what its XLA_FLAGS say)."""
    axes = self.mesh.axes().values()
    if self.cluster.trainer_gpus or self.cluster.trainer_processes == 1 or -1 in axes:
      return None
    return math.prod(axes) // self.cluster.trainer_processes

  def replace(self, **parts) -> "Settings":
    return dataclasses.replace(self, **parts)


_PARTS = [f for f in dataclasses.fields(Settings) if f.name != "seed"]


def _leaves() -> list[tuple[str | None, str, dataclasses.Field]]:
  """(part name or None for top level, field name, field) for every setting."""
  out = [(None, "seed", next(f for f in dataclasses.fields(Settings) if f.name == "seed"))]
  for part in _PARTS:
    out.extend((part.name, f.name, f) for f in dataclasses.fields(_PART_CLS[part.name]))
  return out


_PART_CLS = {p.name: type(p.default) for p in _PARTS}  # annotations are strings


def config_keys() -> list[str]:
  """Every config key the settings read, dotted."""
  return [f.metadata["key"] for _, _, f in _leaves()]


def default_config() -> ml_collections.ConfigDict:
  """The complete run config with every default; configs/*.py start here."""
  return to_config(Settings())


def _config_leaves(node, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k in node.keys():
    v = node[k]
    path = f"{prefix}{k}"
    if isinstance(v, (ml_collections.ConfigDict, dict)):
      out.update(_config_leaves(v, path + "."))
    else:
      out[path] = v
  return out


def _coerce(key: str, value: Any, want: Any) -> Any:
  want = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple}.get(want, want)
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if want is tuple and isinstance(value, list):
    return tuple(value)
  if (want is int and isinstance(value, bool)) or not isinstance(value, want):
    raise UserError(
        f"{key}={value!r} must be {want.__name__}; fix it in the config or "
        f"with --config.{key}=..."
    )
  return value


def from_config(config, *, check_files: bool = True) -> Settings:
  """Maps a run config onto `Settings` and validates it.

  Raises UserError (one sentence naming the fix) for a key the settings
  don't know, a missing key, a wrong type or a bad value. `check_files=False`
  skips the checks that paths exist (for configs describing another machine).
  """
  given = _config_leaves(config)
  known = set(config_keys())
  unknown = sorted(set(given) - known)
  if unknown:
    raise UserError(
        f"config key {unknown[0]!r} is not a StreamRL setting; remove it or "
        "rename it to one listed in streamrl/settings.py."
    )
  parts: dict[str, dict] = {p.name: {} for p in _PARTS}
  top: dict = {}
  for part, name, f in _leaves():
    key = f.metadata["key"]
    value = given.get(key, f.default)
    value = _coerce(key, value, f.type)
    (parts[part] if part else top)[name] = value
  s = Settings(**top, **{p.name: _PART_CLS[p.name](**parts[p.name]) for p in _PARTS})
  validate(s, check_files=check_files)
  return s


def to_config(s: Settings) -> ml_collections.ConfigDict:
  """The config that maps back onto `s` (for config.json and Ray)."""
  root: dict = {}
  for part, name, f in _leaves():
    *groups, leaf = f.metadata["key"].split(".")
    node = root
    for g in groups:
      node = node.setdefault(g, {})
    node[leaf] = getattr(getattr(s, part) if part else s, name)
  return ml_collections.ConfigDict(root)


# -------------------------------------------------------------- validation
def _need(ok: bool, message: str) -> None:
  if not ok:
    raise UserError(message)


def _one_of(key: str, value: Any, options) -> None:
  _need(value in options, f"{key}={value!r} is unknown; use one of {tuple(options)}.")


def _positive(key: str, value: float, *, zero_ok: bool = False) -> None:
  ok = value >= 0 if zero_ok else value > 0
  _need(ok, f"{key}={value!r} must be {'>= 0' if zero_ok else '> 0'}; fix --config.{key}.")


def validate(s: Settings, *, check_files: bool = True) -> None:
  """Every cross-field and range check, each failing with one sentence."""
  m, t, smp, e, sch = s.model, s.task, s.sampling, s.engine, s.scheduler
  adv, kl, loss, tr, opt = s.advantage, s.kl, s.loss, s.trainer, s.optimizer
  _one_of("model.dtype", m.dtype, DTYPES)
  if not m.path:
    _one_of("model.tiny", m.tiny, TINY_MODELS)
  _positive("warmstart.steps", s.warmstart.steps, zero_ok=True)
  if s.warmstart.steps:
    _positive("warmstart.batch_size", s.warmstart.batch_size)
    _positive("warmstart.lr", s.warmstart.lr)
    _positive("warmstart.num_examples", s.warmstart.num_examples)
  _one_of("task.kind", t.kind, TASK_KINDS)
  _positive("task.num_eval", t.num_eval, zero_ok=True)
  if t.kind == "trace":
    _positive("task.trace_base_passes", t.trace_base_passes, zero_ok=True)
    _positive("task.trace_passes_per_char", t.trace_passes_per_char, zero_ok=True)
    _need(
        0 < t.trace_token_fraction <= 1,
        f"task.trace_token_fraction={t.trace_token_fraction!r} must be in (0, 1]; "
        f"fix --config.task.trace_token_fraction.",
    )
  if t.kind in ("synthetic", "trace"):
    from streamrl.data import tasks  # pylint: disable=g-import-not-at-top

    bad = [op for op in t.ops if op not in tasks.KNOWN_OPS]
    _need(
        t.ops and not bad,
        f"task.ops={t.ops!r} has unknown ops {bad}; use some of " f"{tuple(tasks.KNOWN_OPS)}.",
    )
    _positive("task.max_answer_len", t.max_answer_len)
  from streamrl.data import rewards  # pylint: disable=g-import-not-at-top

  _need(
      t.reward in rewards.known_reward_fns(),
      f"task.reward={t.reward!r} is unknown; use one of {rewards.known_reward_fns()}.",
  )

  _need(smp.temperature >= 0, f"generation.temperature={smp.temperature} must be >= 0.")
  _need(0 < smp.top_p <= 1, f"generation.top_p={smp.top_p} must be in (0, 1].")
  _positive("generation.max_tokens", smp.max_tokens)
  _positive("generation.max_model_len", e.max_model_len)
  _need(
      smp.max_tokens < e.max_model_len,
      f"generation.max_tokens={smp.max_tokens} must be below generation.max_model_len="
      f"{e.max_model_len}; raise max_model_len or lower max_tokens.",
  )
  _positive("generation.max_num_seqs", e.max_num_seqs)
  _positive("generation.kv_cache_gib", e.kv_cache_gib)
  _need(
      e.num_instances >= 1,
      f"generation.num_instances={e.num_instances} must be >= 1 (one vLLM engine at least).",
  )
  _need(
      e.num_instances == 1 or s.pipeline.mode != "colocated",
      f"pipeline.mode='colocated' runs one engine in the trainer's process; set "
      f"generation.num_instances=1 or use sync / stream / async for {e.num_instances}.",
  )
  _positive("generation.coalesce_s", e.coalesce_s, zero_ok=True)
  _positive("generation.gpus_per_instance", e.gpus_per_instance, zero_ok=True)
  _positive("generation.tensor_parallel_size", e.tensor_parallel_size)
  _need(
      e.gpus_per_instance == 0 or e.tensor_parallel_size == e.gpus_per_instance,
      f"generation.tensor_parallel_size={e.tensor_parallel_size} must equal "
      f"generation.gpus_per_instance={e.gpus_per_instance} (one engine shards over all its "
      f"GPUs); set tensor_parallel_size={e.gpus_per_instance}.",
  )
  _need(
      0 < e.gpu_memory_utilization <= 1,
      f"generation.gpu_memory_utilization={e.gpu_memory_utilization} must be in (0, 1].",
  )

  _one_of("generation.scheduler", sch.kind, SCHEDULERS)
  _need(
      0 <= sch.long_tail_alpha <= 1,
      f"generation.long_tail_alpha={sch.long_tail_alpha} must be in [0, 1].",
  )
  _one_of("generation.dispatch_objective", sch.objective, DISPATCH_OBJECTIVES)
  _one_of("generation.dispatch_latency_model", sch.latency_model, LATENCY_MODELS)
  _positive("generation.length_history", sch.length_history)
  _one_of("generation.ranker_side", sch.ranker_side, ("generators", "trainer"))
  _one_of("generation.sibling_lengths", sch.sibling_lengths, ("off", "on"))
  _need(
      sch.sibling_lengths == "off" or sch.kind != "fifo",
      "generation.sibling_lengths='on' refines the length predictions of the skew or "
      "oracle scheduler; set generation.scheduler=skew or generation.sibling_lengths=off.",
  )
  if sch.kind == "oracle":
    _need(
        t.kind in ("synthetic", "trace"),
        "generation.scheduler='oracle' needs the synthetic task's "
        "known answer lengths; use 'skew' for task.kind='jsonl'.",
    )

  _one_of("algo.advantage", adv.estimator, ADVANTAGES)
  _need(adv.group_size >= 1, f"algo.group_size={adv.group_size} must be >= 1.")
  _need(
      adv.estimator != "gae" or adv.use_critic,
      "algo.advantage='gae' needs a critic; set algo.use_critic=True or use 'grpo' / "
      "'rloo' / 'reinforce_pp'.",
  )
  _need(
      adv.estimator not in ("grpo", "rloo") or adv.group_size >= 2,
      f"algo.advantage={adv.estimator!r} compares samples of one prompt; set "
      "algo.group_size >= 2.",
  )
  _need(0 <= adv.gamma <= 1 and 0 <= adv.lam <= 1, "algo.gamma and algo.lam must be in [0, 1].")
  _one_of("algo.kl_estimator", kl.estimator, KL_ESTIMATORS)
  _positive("algo.kl_coef", kl.coef, zero_ok=True)
  _need(
      not kl.coef or kl.use_reference,
      f"algo.kl_coef={kl.coef} needs the reference model; set algo.use_reference=True or "
      "algo.kl_coef=0.",
  )
  _positive("algo.clip_low", loss.clip_low)
  _positive("algo.clip_high", loss.clip_high)
  _need(
      loss.dual_clip == 0 or loss.dual_clip > 1,
      f"algo.dual_clip={loss.dual_clip} must be 0 (off) or > 1.",
  )
  _one_of("algo.loss_agg", loss.agg, LOSS_AGGS)
  _positive("algo.entropy_coef", loss.entropy_coef, zero_ok=True)
  _positive("algo.vf_clip", loss.vf_clip, zero_ok=True)
  _one_of("algo.rollout_correction", loss.rollout_correction, ROLLOUT_CORRECTIONS)
  _need(loss.is_cap >= 1, f"algo.is_cap={loss.is_cap} must be >= 1.")
  _need(loss.mis_threshold > 1, f"algo.mis_threshold={loss.mis_threshold} must be > 1.")

  for key in (
      "num_iterations",
      "prompts_per_iteration",
      "mini_batch_size",
      "micro_batch_size",
      "ppo_epochs",
  ):
    _positive(f"trainer.{key}", getattr(tr, key))
  n = s.samples_per_iteration
  _need(
      n % tr.mini_batch_size == 0,
      f"prompts_per_iteration * group_size = {n} is not a multiple of "
      f"trainer.mini_batch_size={tr.mini_batch_size}; change one of them.",
  )
  _need(
      tr.mini_batch_size % tr.micro_batch_size == 0,
      f"trainer.mini_batch_size={tr.mini_batch_size} is not a multiple of "
      f"trainer.micro_batch_size={tr.micro_batch_size}; change one of them.",
  )
  _need(
      tr.compute_dtype in ("auto",) + COMPUTE_DTYPES,
      f"trainer.compute_dtype={tr.compute_dtype!r} is not supported; use one of "
      f"{('auto',) + COMPUTE_DTYPES} (float16 training would need loss scaling).",
  )
  _one_of("trainer.remat", tr.remat, REMAT_POLICIES)
  _need(
      tr.logprob_chunk >= 0,
      f"trainer.logprob_chunk={tr.logprob_chunk} must be >= 0 (positions scored at a "
      "time; 0 scores all at once).",
  )
  if s.pipeline.mode == "stream":
    _need(
        tr.mini_batch_size % adv.group_size == 0,
        f"pipeline.mode='stream' trains whole groups as they finish, so "
        f"trainer.mini_batch_size={tr.mini_batch_size} must be a multiple of "
        f"algo.group_size={adv.group_size}.",
    )
  _positive("trainer.lr", opt.lr)
  if adv.use_critic:
    _positive("trainer.critic_lr", opt.critic_lr)
  _positive("trainer.warmup_steps", opt.warmup_steps, zero_ok=True)
  _positive("trainer.weight_decay", opt.weight_decay, zero_ok=True)
  _positive("trainer.grad_clip", opt.grad_clip)

  for axis, size in s.mesh.axes().items():
    _need(size >= 1 or size == -1, f"mesh.{axis}={size} must be >= 1, or -1 for the rest.")
  _need(sum(v == -1 for v in s.mesh.axes().values()) <= 1, "at most one mesh axis may be -1.")
  fixed = [v for v in s.mesh.axes().values() if v != -1]
  mesh_size = math.prod(fixed)
  if s.cluster.trainer_gpus and len(fixed) == 3:
    _need(
        mesh_size == s.cluster.trainer_gpus,
        f"the mesh (data x fsdp x tensor = {mesh_size}) must cover cluster.trainer_gpus="
        f"{s.cluster.trainer_gpus}; change the mesh axes or set one of them to -1.",
    )
  elif s.cluster.trainer_gpus:
    _need(
        s.cluster.trainer_gpus % mesh_size == 0,
        f"cluster.trainer_gpus={s.cluster.trainer_gpus} is not a multiple of the fixed mesh "
        f"axes' product {mesh_size}; change the mesh or the trainer's GPU count.",
    )

  _one_of("pipeline.mode", s.pipeline.mode, PIPELINE_MODES)
  _need(
      s.pipeline.max_staleness >= 1,
      f"pipeline.max_staleness={s.pipeline.max_staleness} must be >= 1 (async is one step "
      "off-policy at least).",
  )
  _positive("pipeline.stall_timeout_s", s.pipeline.stall_timeout_s)
  _one_of("generation.partial", s.pipeline.partial, ("off", "on", "auto"))
  if s.partial_rollouts:
    _need(
        s.pipeline.mode == "async",
        f"generation.partial='on' resumes responses under newer weights, which only "
        f"pipeline.mode='async' does; set pipeline.mode=async or generation.partial=off "
        f"(got pipeline.mode={s.pipeline.mode!r}).",
    )
    _need(
        0 < s.pipeline.partial_oversample <= 4,
        f"generation.partial_oversample={s.pipeline.partial_oversample} must be in (0, 4]: "
        "the fraction of extra prompt groups each round starts.",
    )
    _need(
        s.pipeline.max_token_version_gap >= s.pipeline.max_staleness,
        f"generation.max_token_version_gap={s.pipeline.max_token_version_gap} must be >= "
        f"pipeline.max_staleness={s.pipeline.max_staleness}, or no fresh sample could be "
        "trained on; raise it.",
    )
  c = s.cluster
  _positive("cluster.generator_cpus", c.generator_cpus)
  _positive("cluster.trainer_cpus", c.trainer_cpus)
  _positive("cluster.trainer_gpus", c.trainer_gpus, zero_ok=True)
  _positive("cluster.trainer_processes", c.trainer_processes)
  if c.trainer_processes > 1:
    _need(
        s.pipeline.mode != "colocated" and c.trainer_actor,
        f"cluster.trainer_processes={c.trainer_processes} needs the trainer on Ray actors: "
        "use pipeline.mode sync, stream or async with cluster.trainer_actor=True.",
    )
    _need(
        c.trainer_gpus % c.trainer_processes == 0,
        f"cluster.trainer_gpus={c.trainer_gpus} must split evenly over "
        f"cluster.trainer_processes={c.trainer_processes}.",
    )
    if not c.trainer_gpus and -1 not in s.mesh.axes().values():
      _need(
          mesh_size % c.trainer_processes == 0,
          f"the mesh (data x fsdp x tensor = {mesh_size}) must split evenly over "
          f"cluster.trainer_processes={c.trainer_processes} (each process offers "
          "mesh size / processes CPU devices).",
      )
  _positive("cluster.connect_timeout_s", c.connect_timeout_s)
  tf = s.transfer
  _need(
      tf.chunk_bytes > 0 and tf.chunk_bytes % 8 == 0,
      f"transfer.chunk_bytes={tf.chunk_bytes} must be a positive multiple of 8.",
  )
  _one_of("transfer.topology", tf.topology, ("tree", "direct"))
  _positive("transfer.fanout", tf.fanout)
  _need(
      s.pipeline.mode != "colocated"
      or not s.engine.gpus_per_instance
      or s.engine.gpu_memory_utilization <= 0.6,
      f"colocated on GPU, vLLM shares each device with the trainer, so "
      f"generation.gpu_memory_utilization={s.engine.gpu_memory_utilization} leaves JAX too "
      "little; set it to 0.6 or less (0.4 is a good start).",
  )
  _need(
      not tf.enabled or s.pipeline.mode != "colocated",
      "transfer.enabled=True sends weights to Ray generators; colocated mode has none, so "
      "set transfer.enabled=False (configs/colocated.py:<config> sets the whole baseline) or "
      "use sync / stream / async.",
  )
  _need(
      bool(tf.bind.strip()),
      "transfer.bind is empty; use 127.0.0.1 (this machine only) or the address the "
      "generators reach the trainer at.",
  )
  _positive("transfer.cross_dc_bytes_per_s", tf.cross_dc_bytes_per_s, zero_ok=True)
  _positive("transfer.uplink_bytes_per_s", tf.uplink_bytes_per_s, zero_ok=True)
  from streamrl import cluster as cluster_lib  # pylint: disable=g-import-not-at-top

  for key, value in (
      ("cluster.generation_labels", c.generation_labels),
      ("cluster.training_labels", c.training_labels),
  ):
    try:
      cluster_lib.parse_labels(value)
    except ValueError as e:
      raise UserError(f"{key}={value!r}: {e}") from None
  _validate_elastic(s)
  _positive("checkpoint.every", s.checkpoint.every)
  _positive("checkpoint.keep", s.checkpoint.keep)
  _positive("log.eval_every", s.log.eval_every, zero_ok=True)

  if check_files:
    _check_files(s)


def _validate_elastic(s: Settings) -> None:
  el = s.elastic
  if not el.enabled:
    return
  _need(
      s.pipeline.mode != "colocated",
      "elastic.enabled=True adds and removes Ray generator instances; colocated mode has "
      "one engine in the trainer's process, so use sync / stream / async or disable it.",
  )
  _need(
      1 <= el.min_instances <= s.engine.num_instances <= el.max_instances,
      f"elastic needs 1 <= elastic.min_instances ({el.min_instances}) <= "
      f"generation.num_instances ({s.engine.num_instances}) <= elastic.max_instances "
      f"({el.max_instances}); fix one of them.",
  )
  _need(
      s.transfer.enabled,
      "elastic.enabled=True needs transfer.enabled=True: an instance added mid-run "
      "catches up to the current weights through the checkpoint-transfer service.",
  )
  _positive("elastic.observe_iterations", el.observe_iterations)
  _need(0 <= el.min_gain <= 1, f"elastic.min_gain={el.min_gain} must be in [0, 1].")
  _positive("elastic.cooldown_iterations", el.cooldown_iterations, zero_ok=True)
  _positive("elastic.warmup_iterations", el.warmup_iterations, zero_ok=True)
  from streamrl.planner import elastic as elastic_lib  # pylint: disable=g-import-not-at-top

  try:
    elastic_lib.parse_schedule(el.schedule)
  except ValueError as e:
    raise UserError(f"elastic.schedule={el.schedule!r}: {e}") from None


def _check_files(s: Settings) -> None:
  m, t, sch = s.model, s.task, s.scheduler
  if m.path:
    _need(
        os.path.isfile(os.path.join(m.path, "config.json")),
        f"model.path={m.path!r} is not a Hugging Face model directory (no config.json); "
        "point it at a local checkpoint directory.",
    )
  if t.kind == "jsonl":
    _need(
        bool(t.jsonl_path) and os.path.isfile(t.jsonl_path),
        f"task.jsonl_path={t.jsonl_path!r} does not exist; point it at a JSONL file of "
        '{"prompt": ..., "answer": ...} rows.',
    )
  if sch.kind != "fifo" and sch.latency_profile:
    _need(
        os.path.isfile(sch.latency_profile),
        f"generation.latency_profile={sch.latency_profile!r} does not exist; measure one "
        "with streamrl.generator.profiler or leave it empty for the paper's curve.",
    )
  if sch.kind == "skew":
    if sch.ranker_checkpoint:
      from streamrl.ranker import train as ranker_train  # pylint: disable=g-import-not-at-top

      ckpts = os.path.join(sch.ranker_checkpoint, ranker_train.CHECKPOINT_DIR)
      _need(
          os.path.isdir(ckpts) and any(n.isdigit() for n in os.listdir(ckpts)),
          f"generation.ranker_checkpoint={sch.ranker_checkpoint!r} holds no ranker "
          "checkpoint; train one with launch/train_ranker.py --workdir=... or leave it "
          "empty to learn online.",
      )
    else:
      path = sch.ranker_config.split(":", 1)[0]
      _need(
          os.path.isfile(path),
          f"generation.ranker_config={sch.ranker_config!r}: no file {path!r}; use "
          "configs/ranker.py:tiny or a path to a ranker config.",
      )
