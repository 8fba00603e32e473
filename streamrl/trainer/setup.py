"""The parts of an RL run, made from its typed settings (streamrl/config/settings.py).

`streamrl.train.run` builds its run from these, in this order (and the
mode over its rollout with `pipeline.make_mode`); the experiments and tests
that drive the loop themselves use the same ones:

  open_checkpoints   the workdir's checkpoints (refusing another config's)
  load_examples      the task's train and held-out examples
  policy_dir         the policy directory (`model.path`, or a warm-started tiny one)
  plan_memory        the memory plan, checked before the weights load
  load_policy        the policy's weights, in the dtype the trainer keeps them
  make_tokenizer     its tokenizer, with the task's chat template
  fit_prompts        the examples without the prompts too long for the engine
  make_rewarder      the task's verifier
  resume             the last checkpoint restored into the trainer, loader and rewarder
  write_placement    <workdir>/placement.json: where each process runs
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import typing

import numpy as np

from streamrl.config import settings as settings_lib
from streamrl.data import calc, dataset, gym, loader as loader_lib, tasks as tasks_lib
from streamrl.data.loader import PromptLoader
from streamrl.data.rewards import Rewarder
from streamrl.data.tokenizer import Tokenizer
from streamrl.errors import MissingFileError
from streamrl.models import hf
from streamrl.trainer import memory_plan, protocol, warmstart
from streamrl.trainer.checkpoint import Checkpointer, drop_defaults

if typing.TYPE_CHECKING:  # Only named in annotations: the rollout is a layer above.
  from streamrl.generator.rollout import Rollout

log = logging.getLogger(__name__)


# --------------------------------------------------------------- the task
def load_examples(s: settings_lib.Settings) -> tuple[list, list]:
  """Train and held-out eval examples of the configured task."""
  task = s.task
  if task.kind in ("synthetic", "trace"):
    kw = dict(ops=tuple(task.ops), max_answer_len=task.max_answer_len)
    train = tasks_lib.make_examples(s.warmstart.num_examples, s.seed, **kw)
    evals = tasks_lib.make_examples(task.num_eval, s.seed + 10_000, first_id=10**6, **kw)
    trace = trace_config(s)
    if trace is not None:
      train, evals = tasks_lib.add_traces(train, trace), tasks_lib.add_traces(evals, trace)
    return train, evals
  if task.kind == "calc":
    cfg = task.calc_config()
    train = calc.make_examples(s.warmstart.num_examples, s.seed, cfg)
    evals = calc.make_examples(task.num_eval, s.seed + 10_000, cfg, first_id=10**6)
    return train, evals
  if task.kind == "gym":
    train = gym.make_examples(task.gym_dataset, task.gym_size, s.seed)
    evals = gym.make_examples(task.gym_dataset, task.num_eval, s.seed + 10_000, first_id=10**6)
    return train, evals
  keys = dict(prompt_key=task.prompt_key, answer_key=task.answer_key)
  examples = dataset.load_file(task.train_path, **keys)
  if task.eval_path:
    # Held-out rows of their own file, ids apart from the training rows'.
    evals = dataset.load_file(task.eval_path, first_id=len(examples), **keys)
    return examples, evals[: task.num_eval]
  n_eval = min(task.num_eval, len(examples) // 10)
  return examples[n_eval:], examples[:n_eval]


def trace_config(s: settings_lib.Settings) -> tasks_lib.TraceConfig | None:
  """The work-trace shape of a `task.kind="trace"` run (None otherwise)."""
  if s.task.kind != "trace":
    return None
  return tasks_lib.TraceConfig(
      base_passes=s.task.trace_base_passes,
      passes_per_char=s.task.trace_passes_per_char,
      max_tokens=max(int(s.task.trace_token_fraction * s.sampling.max_tokens), 2),
  )


def answer_of(s: settings_lib.Settings):
  """What the verifier and the accuracy read of a decoded response: the text
  after the work trace for trace tasks, else all of it."""
  return tasks_lib.final_answer if s.task.kind in ("trace", "calc") else str.strip


# ------------------------------------------------------------- the policy
def policy_dir(s: settings_lib.Settings, workdir: str, train_examples) -> str:
  """The run's policy directory (`model.path`, or the warm-started tiny one
  cached in the workdir)."""
  return warmstart.prepare_model_dir(
      s.model,
      s.warmstart,
      s.task,
      seed=s.seed,
      workdir=workdir,
      train_examples=train_examples,
      trace=trace_config(s),
      calc=s.task.calc_config() if s.task.kind == "calc" else None,
  )


def saved_policy_dir(s: settings_lib.Settings, workdir: str) -> str:
  """The run's policy directory, as `policy_dir` chose it, without creating
  anything: `model.path`, or the warm-started tiny model in the workdir."""
  if s.model.path:
    path = s.model.path
    if not os.path.isdir(path):
      raise MissingFileError(
          f"model.path={path} (from {workdir}/config.json) does not exist here; export on a "
          "machine that has the run's policy directory at that path."
      )
    return path
  path = warmstart.tiny_model_dir(
      s.model,
      s.warmstart,
      s.task,
      seed=s.seed,
      workdir=workdir,
      trace=trace_config(s),
  )
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise MissingFileError(
        f"the run's warm-started policy directory {path} is missing (its config and "
        "tokenizer are exported with the weights); resuming the run recreates it."
    )
  return path


def plan_memory(s: settings_lib.Settings, model_dir: str) -> settings_lib.Settings:
  """Before the weights load or any generator starts: will the run fit? Logs
  the memory plan's table (streamrl/trainer/memory_plan.py) and stops the run
  with its advice when it does not fit; returns `s` with `trainer.remat=auto`
  resolved."""
  model_cfg = hf.read_config(model_dir)
  if s.trainer.remat == "auto":
    s = memory_plan.resolve_remat(s, model_cfg)
    log.info("trainer.remat=auto: %s (the first that fits the memory plan)", s.trainer.remat)
  plan, fix = memory_plan.for_run(s, model_cfg)
  log.info("%s", plan.table())
  plan.check(fix)
  return s


def load_policy(s: settings_lib.Settings, model_dir: str):
  """The policy as the trainer takes it: fp32 master weights, or under LoRA
  the weights as the checkpoint stores them (the frozen base is only read, in
  the forward pass's dtypes: an fp32 copy of it would be a transient extra
  copy of the whole model)."""
  return hf.load_hf(model_dir, dtype=None if s.trainer.lora_rank else np.float32)[1]


def make_tokenizer(s: settings_lib.Settings, model_dir: str) -> Tokenizer:
  """The policy's tokenizer, rendering prompts with its chat template as the
  task says."""
  return Tokenizer(
      model_dir,
      chat_template=s.task.chat_template,
      system_prompt=s.task.system_prompt,
      chat_template_kwargs=s.task.template_kwargs(),
  )


def fit_prompts(s: settings_lib.Settings, tokenizer, train_examples, eval_examples):
  """Both sets without the prompts too long for the engine (or with them cut,
  as task.truncation says)."""
  kw = dict(
      max_model_len=s.engine.max_model_len,
      max_tokens=s.sampling.max_tokens,
      truncation=s.task.truncation,
  )
  train_examples = loader_lib.fit_prompts(train_examples, tokenizer, what="training", **kw)
  if eval_examples:
    eval_examples = loader_lib.fit_prompts(eval_examples, tokenizer, what="held-out", **kw)
  return train_examples, eval_examples


def make_rewarder(s: settings_lib.Settings, tokenizer, probe=None) -> Rewarder:
  """The task's reward functions over decoded responses (reading what
  `answer_of` cuts), in `task.reward_workers` processes; close() it. With
  `probe` (a training example) each function is first called once on it, so
  one that cannot work stops the run here (UserError)."""
  rewarder = Rewarder(
      s.task.reward,
      tokenizer,
      answer_of(s),
      workers=s.task.reward_workers,
      timeout_s=s.task.reward_timeout_s,
      correct_threshold=s.task.correct_threshold,
      weights=s.task.weights(),
      answer_key=s.task.answer_key,
      max_error_rate=s.task.max_reward_error_rate,
  )
  if probe is not None:
    try:
      rewarder.probe(probe)
    except BaseException:
      rewarder.close()
      raise
  return rewarder


# ------------------------------------------------------------ checkpoints
def fingerprint(s: settings_lib.Settings) -> dict:
  """What must match for a workdir's checkpoints to be resumed, without the
  fields at their default (so a new field never stops an old workdir)."""
  return drop_defaults(full_fingerprint(s), full_fingerprint(settings_lib.Settings()))


def full_fingerprint(s: settings_lib.Settings) -> dict:
  """Every field the fingerprint covers (what checkpoints held before 0.1)."""
  asdict = dataclasses.asdict
  return {
      "model": {"path": s.model.path, "tiny": s.model.tiny, "tokenizer": s.model.tokenizer},
      "warmstart": asdict(s.warmstart),
      # The trace settings only where they matter (and a workdir written
      # before they existed still resumes).
      "task": {
          k: v
          for k, v in asdict(s.task).items()
          if s.task.kind == "trace" or not k.startswith("trace_")
      },
      "env": asdict(s.env),
      "advantage": asdict(s.advantage),
      "kl": asdict(s.kl),
      "loss": asdict(s.loss),
      "mesh": asdict(s.mesh),
      "prompts_per_iteration": s.trainer.prompts_per_iteration,
      "seed": s.seed,
  }


def open_checkpoints(s: settings_lib.Settings, workdir: str) -> Checkpointer:
  """The workdir's checkpoints; refuses one written by an incompatible config."""
  return Checkpointer(
      os.path.join(workdir, "checkpoints"),
      keep=s.checkpoint.keep,
      fingerprint=fingerprint(s),
      defaults=full_fingerprint(settings_lib.Settings()),
  )


def resume(
    ckpt: Checkpointer,
    trainer,
    loader: PromptLoader,
    rewarder: Rewarder,
    followers: protocol.Followers | None = None,
) -> tuple[int, dict]:
  """Restores the workdir's last checkpoint, if there is one, into `trainer`
  (and the `followers`' trainers), `loader` and `rewarder`; returns its step
  and the metadata saved with it, or (0, {})."""
  if ckpt.latest_step() is None:
    return 0, {}
  if followers:
    followers.send(protocol.Restore())
  start, arrays, meta = ckpt.restore(trainer.checkpoint_arrays())
  trainer.load_checkpoint_arrays(arrays)
  loader.set_state(meta["loader"])
  rewarder.errors = meta.get("reward_errors", 0)
  log.info("Resumed from iteration %d", start)
  return start, meta


# -------------------------------------------------------------- placement
_GENERATOR_FIELDS = ("pid", "cores", "torch_threads", "gpu_ids", "node_id", "datacenter", "labels")


def write_placement(workdir: str, placement: dict | None, rollout: Rollout) -> None:
  """Where the trainer and each generator instance run: <workdir>/placement.json
  (rewritten when elastic generation changes the instances). A plan applied
  with `launch/main.py --plan` (<workdir>/plan.json) is recorded with it."""
  placement = dict(
      placement
      or {
          "trainer": {
              "pid": os.getpid(),
              "host": socket.gethostname(),
              "cores": sorted(os.sched_getaffinity(0)),
          }
      }
  )
  live = set(rollout.live_instances)
  placement["generators"] = {
      str(i): {k: v for k, v in info.items() if k in _GENERATOR_FIELDS}
      for i, info in rollout.placement.items()
      if i in live
  }
  if not placement["generators"]:
    placement["generators"] = {"0": {"in_trainer_process": True}}
  if rollout.retired or rollout.dead_instances:
    placement["removed_generators"] = [i for i, _, _ in rollout.retired]
    placement["dead_generators"] = [d.instance_id for d in rollout.dead_instances]
  plan_path = os.path.join(workdir, "plan.json")
  if os.path.isfile(plan_path):
    with open(plan_path) as f:
      placement["plan"] = json.load(f).get("plan")
  with open(os.path.join(workdir, "placement.json"), "w") as f:
    json.dump(placement, f, indent=1, default=str)
