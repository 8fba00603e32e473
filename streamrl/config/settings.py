"""The run config: every part's settings assembled, the rules between parts,
and the `ConfigDict` both ways.

Each part of the system owns a frozen dataclass of its settings, with its
defaults and its own checks, next to the code that reads it:

  model                         streamrl/models/config.py
  task                          streamrl/data/config.py
  env                           streamrl/envs/config.py
  sampling, engine              streamrl/generator/config.py
  scheduler                     streamrl/scheduling/config.py
  advantage, kl, loss           streamrl/rl/config.py
  trainer, optimizer, mesh,
  checkpoint, warmstart         streamrl/trainer/config.py
  pipeline                      streamrl/pipeline/config.py
  cluster                       streamrl/cluster/config.py
  transfer                      streamrl/transfer/config.py
  elastic                       streamrl/elastic/config.py
  log                           streamrl/metrics/config.py

The key you type is the attribute you grep: field `x` of part `p` is the
config key `p.x` (`--config.pipeline.partial=on` sets `s.pipeline.partial`).
A run config (configs/*.py) is a plain `ml_collections.ConfigDict` built from
`default_config()`; `from_config` maps it onto `Settings` and checks every
value (each part's `check()`, then `CROSS_PART_RULES`) before anything heavy
starts. Keys from before this layout are accepted until 0.2.0
(streamrl/config/renames.py).

  config = settings.default_config()        # every key, with its default
  s = settings.from_config(config)          # typed, validated; UserError if not
  s.sampling.temperature, s.loss.clip_low, s.pipeline.mode
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import ml_collections

from streamrl.cluster.config import Cluster
from streamrl.config import renames
from streamrl.config.checks import coerce, need
from streamrl.data.config import Task
from streamrl.elastic.config import Elastic
from streamrl.envs.config import Env
from streamrl.errors import UserError
from streamrl.generator.config import Engine, Sampling
from streamrl.metrics.config import Log
from streamrl.models.config import Model
from streamrl.pipeline.config import PIPELINE_MODES, Pipeline
from streamrl.rl.config import Advantage, Kl, Loss
from streamrl.scheduling.config import Scheduler
from streamrl.trainer.config import Checkpoint, Mesh, Optimizer, Trainer, Warmstart
from streamrl.transfer.config import Transfer

__all__ = [
    "Advantage",
    "Checkpoint",
    "Cluster",
    "Elastic",
    "Engine",
    "Env",
    "Kl",
    "Log",
    "Loss",
    "Mesh",
    "Model",
    "Optimizer",
    "PIPELINE_MODES",
    "Pipeline",
    "Sampling",
    "Scheduler",
    "Settings",
    "Task",
    "Trainer",
    "Transfer",
    "Warmstart",
    "config_keys",
    "default_config",
    "from_config",
    "to_config",
    "validate",
]


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything a run reads, by part (attribute = config group)."""

  seed: int = 0
  model: Model = Model()
  warmstart: Warmstart = Warmstart()
  task: Task = Task()
  env: Env = Env()
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
  def optimizer_steps(self) -> int:
    """Optimizer steps over the whole run (the learning rate decays over them)."""
    tr = self.trainer
    return (
        tr.num_iterations * tr.ppo_epochs * max(1, self.samples_per_iteration // tr.mini_batch_size)
    )

  @property
  def partial_rollouts(self) -> bool:
    """Whether rounds resume unfinished responses and trajectories (`auto` resolved by mode)."""
    return self.pipeline.partial_rollouts

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


PARTS: dict[str, type] = {
    f.name: type(f.default) for f in dataclasses.fields(Settings) if f.name != "seed"
}


def _leaves() -> list[tuple[str | None, dataclasses.Field]]:
  """(part name, or None for the top level; field) of every setting."""
  out = [(None, f) for f in dataclasses.fields(Settings) if f.name == "seed"]
  for part, cls in PARTS.items():
    out.extend((part, f) for f in dataclasses.fields(cls))
  return out


def _key(part: str | None, f: dataclasses.Field) -> str:
  return f"{part}.{f.name}" if part else f.name


def config_keys() -> list[str]:
  """Every config key the settings read, dotted (`<part>.<field>`)."""
  return [_key(part, f) for part, f in _leaves()]


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
  try:
    return coerce(value, want)
  except TypeError:
    want = getattr(want, "__name__", want)
    raise UserError(
        f"{key}={value!r} must be {want}; fix it in the config or with --config.{key}=..."
    ) from None


def from_config(config, *, check_files: bool = True) -> Settings:
  """Maps a run config onto `Settings` and validates it.

  Raises UserError (one sentence naming the fix) for a key the settings
  don't know, a wrong type or a bad value; a key left out keeps its
  default. Old key names (streamrl/config/renames.py) are read under their new
  ones. `check_files=False` skips the checks that paths exist (for configs
  describing another machine).
  """
  try:
    given = renames.upgrade_flat(_config_leaves(config))
  except ValueError as e:
    raise UserError(str(e)) from None
  unknown = sorted(set(given) - set(config_keys()))
  if unknown:
    raise UserError(
        f"config key {unknown[0]!r} is not a StreamRL setting; remove it or rename it to "
        "one of settings.config_keys() (each part's fields: streamrl/config/settings.py lists them)."
    )
  parts: dict[str, dict] = {p: {} for p in PARTS}
  top: dict = {}
  for part, f in _leaves():
    key = _key(part, f)
    value = _coerce(key, given.get(key, f.default), f.type)
    (parts[part] if part else top)[f.name] = value
  s = Settings(**top, **{p: cls(**parts[p]) for p, cls in PARTS.items()})
  validate(s, check_files=check_files)
  return s


def to_config(s: Settings) -> ml_collections.ConfigDict:
  """The config that maps back onto `s` (for config.json and Ray)."""
  root: dict = {"seed": s.seed}
  for part in PARTS:
    root[part] = dataclasses.asdict(getattr(s, part))
  return ml_collections.ConfigDict(root)


# ------------------------------------------------------- rules between parts
def _lengths_fit(s: Settings) -> None:
  need(
      s.sampling.max_tokens < s.engine.max_model_len,
      f"sampling.max_tokens={s.sampling.max_tokens} must be below engine.max_model_len="
      f"{s.engine.max_model_len}; raise max_model_len or lower max_tokens.",
  )


def _colocated_has_one_engine(s: Settings) -> None:
  e = s.engine
  if s.pipeline.mode != "colocated":
    return
  need(
      e.num_instances == 1,
      f"pipeline.mode='colocated' runs one engine in the trainer's process; set "
      f"engine.num_instances=1 or use sync / stream / async for {e.num_instances}.",
  )
  need(
      not e.gpus_per_instance or e.gpu_memory_utilization <= 0.6,
      f"colocated on GPU, vLLM shares each device with the trainer, so "
      f"engine.gpu_memory_utilization={e.gpu_memory_utilization} leaves JAX too "
      "little; set it to 0.6 or less (0.4 is a good start).",
  )
  need(
      not s.transfer.enabled,
      "transfer.enabled=True sends weights to Ray generators; colocated mode has none, so "
      "set transfer.enabled=False (configs/colocated.py:<config> sets the whole baseline) or "
      "use sync / stream / async.",
  )


def _oracle_knows_lengths(s: Settings) -> None:
  need(
      s.scheduler.kind != "oracle" or s.task.kind in ("synthetic", "trace"),
      "scheduler.kind='oracle' needs the synthetic task's known answer lengths; use 'skew' "
      "for task.kind='file'.",
  )


def _env_fits(s: Settings) -> None:
  if not s.env.enabled:
    return
  need(
      s.env.max_tokens_per_turn <= s.sampling.max_tokens,
      f"env.max_tokens_per_turn={s.env.max_tokens_per_turn} is more than the whole "
      f"trajectory's sampling.max_tokens={s.sampling.max_tokens}; lower it or raise max_tokens.",
  )


def _batches_divide(s: Settings) -> None:
  tr, n = s.trainer, s.samples_per_iteration
  need(
      n % tr.mini_batch_size == 0,
      f"trainer.prompts_per_iteration * advantage.group_size = {n} is not a multiple of "
      f"trainer.mini_batch_size={tr.mini_batch_size}; change one of them.",
  )
  need(
      s.pipeline.mode != "stream" or tr.mini_batch_size % s.advantage.group_size == 0,
      f"pipeline.mode='stream' trains whole groups as they finish, so "
      f"trainer.mini_batch_size={tr.mini_batch_size} must be a multiple of "
      f"advantage.group_size={s.advantage.group_size}.",
  )


def _critic_lr_set(s: Settings) -> None:
  need(
      not s.advantage.use_critic or s.optimizer.critic_lr > 0,
      f"optimizer.critic_lr={s.optimizer.critic_lr!r} must be > 0 with a critic; fix "
      "--config.optimizer.critic_lr.",
  )


def _mesh_fits_devices(s: Settings) -> None:
  fixed = [v for v in s.mesh.axes().values() if v != -1]
  mesh_size, gpus = math.prod(fixed), s.cluster.trainer_gpus
  if gpus and len(fixed) == 3:
    need(
        mesh_size == gpus,
        f"the mesh (data x fsdp x tensor = {mesh_size}) must cover cluster.trainer_gpus="
        f"{gpus}; change the mesh axes or set one of them to -1.",
    )
  elif gpus:
    need(
        gpus % mesh_size == 0,
        f"cluster.trainer_gpus={gpus} is not a multiple of the fixed mesh axes' product "
        f"{mesh_size}; change the mesh or the trainer's GPU count.",
    )


def _trainer_processes_fit(s: Settings) -> None:
  c = s.cluster
  if c.trainer_processes == 1:
    return
  need(
      s.pipeline.mode != "colocated" and c.trainer_actor,
      f"cluster.trainer_processes={c.trainer_processes} needs the trainer on Ray actors: "
      "use pipeline.mode sync, stream or async with cluster.trainer_actor=True.",
  )
  need(
      c.trainer_gpus % c.trainer_processes == 0,
      f"cluster.trainer_gpus={c.trainer_gpus} must split evenly over "
      f"cluster.trainer_processes={c.trainer_processes}.",
  )
  axes = s.mesh.axes().values()
  need(
      c.trainer_gpus or -1 in axes or math.prod(axes) % c.trainer_processes == 0,
      f"the mesh (data x fsdp x tensor = {math.prod(axes)}) must split evenly over "
      f"cluster.trainer_processes={c.trainer_processes} (each process offers "
      "mesh size / processes CPU devices).",
  )


def _lora_fits(s: Settings) -> None:
  if not s.trainer.lora_rank:
    return
  need(
      s.cluster.trainer_processes == 1,
      f"trainer.lora_rank={s.trainer.lora_rank} trains in one trainer process; set "
      "cluster.trainer_processes=1 (LoRA's small state rarely needs more).",
  )


def _elastic_fits(s: Settings) -> None:
  el = s.elastic
  if not el.enabled:
    return
  need(
      s.pipeline.mode != "colocated",
      "elastic.enabled=True adds and removes Ray generator instances; colocated mode has "
      "one engine in the trainer's process, so use sync / stream / async or disable it.",
  )
  need(
      1 <= el.min_instances <= s.engine.num_instances <= el.max_instances,
      f"elastic needs 1 <= elastic.min_instances ({el.min_instances}) <= "
      f"engine.num_instances ({s.engine.num_instances}) <= elastic.max_instances "
      f"({el.max_instances}); fix one of them.",
  )
  need(
      s.transfer.enabled,
      "elastic.enabled=True needs transfer.enabled=True: an instance added mid-run "
      "catches up to the current weights through the checkpoint-transfer service.",
  )


# Each rule relates two parts or more; a part's own fields are its check()'s.
CROSS_PART_RULES: tuple[Callable[[Settings], None], ...] = (
    _lengths_fit,
    _colocated_has_one_engine,
    _oracle_knows_lengths,
    _env_fits,
    _batches_divide,
    _critic_lr_set,
    _mesh_fits_devices,
    _trainer_processes_fit,
    _lora_fits,
    _elastic_fits,
)


def validate(s: Settings, *, check_files: bool = True) -> None:
  """Each part's own checks, then the rules between parts; each failing with
  one sentence. `check_files` also checks that the paths named exist."""
  for part in PARTS:
    getattr(s, part).check()
  for rule in CROSS_PART_RULES:
    rule(s)
  if check_files:
    _check_files(s)


def _check_files(s: Settings) -> None:
  if s.model.path:
    need(
        os.path.isfile(os.path.join(s.model.path, "config.json")),
        f"model.path={s.model.path!r} is not a Hugging Face model directory (no config.json); "
        "point it at a local checkpoint directory.",
    )
  s.task.check_files()
  s.scheduler.check_files()
