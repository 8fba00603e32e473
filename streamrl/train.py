"""The RL run: the one loop every pipeline mode shares.

One iteration, whatever the mode:

  old = trainer.snapshot()                          the old policy, explicit
  for chunk in mode.chunks(it):                     samples, as the mode releases them
    rewards = rewarder(chunk) + overlong penalty     the task's verifier, shaped
    minis = trainer.prepare(chunk, rewards, old)    old/ref logprobs, values, advantages
    trainer.update(mini) for each mini-batch        first PPO epoch
  trainer.update(...) for the other PPO epochs
  mode.push(trainer.export_weights(), it + 1)       new weights to the generators
  log

The mode (streamrl/pipeline) decides only when chunks are released (the
whole batch after generation in colocated/sync/async, each full length
bucket as it fills in stream) and whether the push waits (not in async,
whose generation of the next batch overlaps this iteration's training).
With dynamic sampling (`advantage.filter_groups`) the mode also judges each
prompt group by the same shaped rewards (`shaped_rewards`) and releases the
informative ones only.
`run` sets up the parts from typed settings (streamrl/config/settings.py) and
resumes from the workdir's last checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import socket

import jax
import numpy as np

from streamrl import metrics as metrics_lib
from streamrl import rl
from streamrl.config import settings as settings_lib
from streamrl.data import calc, dataset, gym, loader as loader_lib, tasks as tasks_lib
from streamrl.data.loader import PromptLoader, make_requests
from streamrl.data.rewards import Rewarder
from streamrl.data.tokenizer import Tokenizer
from streamrl.envs import runner as envs_runner
from streamrl.generator import make_rollout
from streamrl.models import hf, lora
from streamrl.errors import MissingFileError, UserError
from streamrl.trainer import export, warmstart
from streamrl.pipeline import base as mode_base
from streamrl.pipeline import make_mode
from streamrl.pipeline.timeline import Timeline
from streamrl.scheduling.scheduler import GenerationScheduler
from streamrl.trainer import compiles, memory_plan, protocol
from streamrl.trainer.checkpoint import Checkpointer, drop_defaults
from streamrl.trainer.rl_trainer import RLTrainer

log = logging.getLogger(__name__)

TRAINER = "trainer"
HF_DIR = "hf"  # <workdir>/hf: the trained policy, for transformers and vLLM.
ADAPTER_DIR = "adapter"  # <workdir>/adapter: a LoRA run's adapter alone (PEFT).


# ------------------------------------------------------------------- setup
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


def make_tokenizer(s: settings_lib.Settings, model_dir: str) -> Tokenizer:
  """The policy's tokenizer, rendering prompts with its chat template as the
  task says."""
  return Tokenizer(
      model_dir,
      chat_template=s.task.chat_template,
      system_prompt=s.task.system_prompt,
      chat_template_kwargs=s.task.template_kwargs(),
  )


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


def accuracy_by_source(name: str, samples, correct, by_id) -> dict:
  """`name` over all samples, and `name/<data_source>` per source when the
  rows carry one."""
  out = {name: float(np.mean(correct))}
  sources = [by_id[x.prompt_id].source for x in samples]
  for src in sorted({x for x in sources if x is not None}):
    out[f"{name}/{src}"] = float(np.mean([c for c, x in zip(correct, sources) if x == src]))
  return out


def evaluate(rollout, examples, tokenizer, rewarder: Rewarder, s: settings_lib.Settings) -> dict:
  """Held-out accuracy by the task's verifier: sampled (the policy's pass@1)
  and greedy, and per data source when the rows name one."""
  requests, by_id = make_requests(examples, tokenizer, 1)
  out = {}
  for name, temp in (("accuracy", s.sampling.temperature), ("accuracy_greedy", 0.0)):
    sampling = dataclasses.replace(s.sampling, temperature=temp)
    samples = list(rollout.generate(requests, sampling, seed=s.seed))
    _, correct = rewarder(samples, by_id)
    out.update(accuracy_by_source(name, samples, correct, by_id))
  rewarder.metrics()  # The eval's reward metrics are not the training iteration's.
  return out


_GENERATOR_FIELDS = ("pid", "cores", "torch_threads", "gpu_ids", "node_id", "datacenter", "labels")


def write_placement(workdir: str, placement: dict | None, rollout) -> None:
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
  retired = getattr(rollout, "retired", [])
  if retired or rollout.dead_instances:
    placement["removed_generators"] = [i for i, _, _ in retired]
    placement["dead_generators"] = [d.instance_id for d in rollout.dead_instances]
  plan_path = os.path.join(workdir, "plan.json")
  if os.path.isfile(plan_path):
    with open(plan_path) as f:
      placement["plan"] = json.load(f).get("plan")
  with open(os.path.join(workdir, "placement.json"), "w") as f:
    json.dump(placement, f, indent=1, default=str)


def make_rounds(loader: PromptLoader, tokenizer, group_size: int):
  """`rounds(it)`: the next prompt batch of `loader` as iteration it's Round."""

  def rounds(it: int) -> mode_base.Round:
    examples = next(loader)
    requests, by_id = make_requests(examples, tokenizer, group_size)
    return mode_base.Round(it, requests, by_id, loader.get_state())

  return rounds


@dataclasses.dataclass(frozen=True)
class GroupRewards:
  """What dynamic sampling judges a group by (`Mode.group_rewards`): the
  rewards the trainer will use (`shaped_rewards`), held by the rewarder so
  that the trainer's call does not score them again."""

  rewarder: Rewarder
  loss: settings_lib.Loss
  max_tokens: int

  def __call__(self, samples, examples_by_id: dict) -> np.ndarray:
    r, _ = shaped_rewards(
        self.rewarder, samples, examples_by_id, self.loss, self.max_tokens, keep=True
    )
    return r

  def release(self, samples, examples_by_id: dict) -> None:
    self.rewarder.release(samples, examples_by_id)


def setup_mode(
    s: settings_lib.Settings, rollout, *, model_dir: str, workdir: str | None, rounds
) -> mode_base.Mode:
  """The configured mode over `rollout`, with its generation scheduler."""
  scheduler = GenerationScheduler(
      s.scheduler,
      model_dir=model_dir,
      workdir=workdir,
      num_instances=rollout.num_instances,
      max_batch_size=s.engine.max_num_seqs,
      helper=rollout.helper_placement() if hasattr(rollout, "helper_placement") else None,
  )
  return make_mode(s, rollout, scheduler, rounds)


# --------------------------------------------------------------- iteration
def shaped_rewards(
    rewarder: Rewarder,
    samples,
    examples_by_id: dict,
    loss: settings_lib.Loss | None,
    max_tokens: int,
    *,
    keep: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
  """(reward, correctness) per sample: the task's verifier, plus DAPO's
  overlong penalty when `loss.overlong_buffer` is set (`rl.overlong_penalty`
  of the response length against `max_tokens`). `keep`: the verdicts are
  held for the trainer's own call (dynamic sampling judges groups first)."""
  r, c = rewarder(samples, examples_by_id, keep=True) if keep else rewarder(samples, examples_by_id)
  if loss is not None and loss.overlong_buffer:
    lengths = [len(x.token_ids) for x in samples]
    penalty = rl.overlong_penalty(lengths, max_tokens, loss.overlong_buffer, loss.overlong_penalty)
    r = r + np.asarray(penalty, np.float32)
  return r, c


def _combine(parts: list[dict]) -> dict:
  """Per-chunk metrics -> one value each: max of maxima, mean of the rest
  (over the chunks that have the key)."""
  out = {}
  for k in dict.fromkeys(k for p in parts for k in p):
    vals = [float(p[k]) for p in parts if k in p]
    out[k] = max(vals) if "max" in k.rsplit("/", 1)[-1] else float(np.mean(vals))
  return out


@dataclasses.dataclass
class Iteration:
  """What one iteration did, for its scalars."""

  it: int
  samples: list
  rewards: np.ndarray
  correct: np.ndarray
  prepare: dict
  updates: dict
  generated: mode_base.Generated
  t0: float
  t1: float
  training_s: float
  weight_update_s: float
  examples_by_id: dict = dataclasses.field(default_factory=dict)
  update_bytes: int = 0  # what the new version weighs (an adapter alone under LoRA)


def train_iteration(
    it: int,
    mode: mode_base.Mode,
    trainer: RLTrainer,
    rewarder: Rewarder,
    timeline: Timeline,
    *,
    ppo_epochs: int,
    seed: int,
    loss: settings_lib.Loss | None = None,
    max_tokens: int = 0,
) -> Iteration:
  """Runs one iteration of the loop above; returns what it did.

  `loss` (and the sampling's `max_tokens`) shape rewards and loss masks as
  its `overlong_*` and `mask_truncated` say; None: neither."""
  t0 = mode_base.now()
  rng = np.random.default_rng([seed, it])
  old = trainer.snapshot(copy=not mode.scores_up_front)
  minis, prep, updates, samples, rewards, correct = [], [], [], [], [], []
  progress = StepProgress()
  by_id = {}
  training_s = 0.0
  for chunk in mode.chunks(it):
    by_id.update({q.prompt_id: mode.round.examples_by_id[q.prompt_id] for q in chunk})
    start = mode_base.now()
    with timeline.busy(TRAINER, f"train {it}"):
      r, c = shaped_rewards(rewarder, chunk, mode.round.examples_by_id, loss, max_tokens)
      part, metrics = trainer.prepare(chunk, r, old)
      for j in rng.permutation(len(part)):
        updates.append(trainer.update(part[j]))
        progress.step(updates[-1], f"iteration {it}: mini-batch {len(updates)}")
      # The busy interval must cover the compute, not only its dispatch.
      jax.block_until_ready(updates[-1])
    training_s += mode_base.now() - start
    minis.extend(part)
    prep.append(metrics)
    samples.extend(chunk)
    rewards.extend(r)
    correct.extend(c)
  start = mode_base.now()
  with timeline.busy(TRAINER, f"epochs {it}"):
    for _ in range(ppo_epochs - 1):
      for j in rng.permutation(len(minis)):
        updates.append(trainer.update(minis[j]))
        progress.step(updates[-1], f"iteration {it}: mini-batch {len(updates)}")
    jax.block_until_ready(updates[-1])
  training_s += mode_base.now() - start
  t_push = mode_base.now()
  weights = trainer.export_weights()
  mode.push(weights, it + 1)
  t1 = mode_base.now()
  order = np.argsort([x.prompt_id for x in samples], kind="stable")
  return Iteration(
      it=it,
      samples=[samples[i] for i in order],
      rewards=np.asarray(rewards, np.float32)[order],
      correct=np.asarray(correct, np.float32)[order],
      prepare=_combine(prep),
      updates=_combine(jax.device_get(updates)),
      generated=mode.generated,
      t0=t0,
      t1=t1,
      training_s=training_s,
      weight_update_s=t1 - t_push,
      update_bytes=update_nbytes(weights),
      examples_by_id=by_id,
  )


class StepProgress:
  """Logs the trainer's optimizer steps once they get slow (a real model on a
  CPU): after the first step that took over `slow_s`, each step is waited for
  and the ones over a second are logged with their time, so the console shows
  the trainer is working."""

  def __init__(self, slow_s: float = 5.0):
    self.slow_s, self.slow, self.t = slow_s, False, mode_base.now()

  def step(self, metrics, what: str) -> None:
    if not self.slow:
      if mode_base.now() - self.t < self.slow_s:
        return
      self.slow = True
    jax.block_until_ready(metrics)
    now = mode_base.now()
    if now - self.t >= 1.0:
      log.info("%s trained in %.1f s", what, now - self.t)
    self.t = now


def update_nbytes(weights) -> int:
  """Bytes of one pushed version: a mapping of arrays, a lazy `hf.HFTensors`
  or a multi-process trainer's weights file."""
  nbytes = getattr(weights, "nbytes", None)
  if callable(nbytes):
    return int(nbytes())
  if isinstance(nbytes, int):
    return nbytes
  if hasattr(weights, "values"):
    return int(sum(np.asarray(v).nbytes for v in weights.values()))
  return 0


def iteration_scalars(x: Iteration, timeline: Timeline, rollout) -> dict:
  """The scalars of one iteration (TensorBoard and metrics.jsonl)."""
  timeline.copy_generator_intervals(rollout.busy_intervals)
  lengths = np.array([len(s.token_ids) for s in x.samples], np.float64)
  wall = max(x.t1 - x.t0, 1e-9)
  staleness = np.array([x.it - s.weight_version for s in x.samples], np.float64)
  out = {
      "reward/mean": float(np.mean(x.rewards)),
      "response_length/mean": lengths.mean(),
      "response_length/p50": float(np.percentile(lengths, 50)),
      "response_length/p90": float(np.percentile(lengths, 90)),
      "response_length/max": lengths.max(),
      # Cut at sampling.max_tokens (what loss.mask_truncated leaves out of the loss).
      "response_length/truncated_fraction": float(
          np.mean([s.finish_reason == "length" for s in x.samples])
      ),
      "throughput/samples_per_s": len(x.samples) / wall,
      "throughput/tokens_per_s": float(lengths.sum()) / wall,
      "time/iteration_s": wall,
      "time/generation_s": x.generated.generation_s,
      "time/training_s": x.training_s,
      "time/weight_update_s": x.weight_update_s,
      "transfer/update_bytes": x.update_bytes,
      "staleness/mean": staleness.mean(),
      "staleness/max": staleness.max(),
      "generators/instances": len(rollout.live_instances),
      "generators/dead": len(rollout.dead_instances),
  }
  out.update(accuracy_by_source("accuracy", x.samples, x.correct, x.examples_by_id))
  out.update(envs_runner.trajectory_metrics(x.samples))
  ids = [s.prompt_id for s in x.samples]
  out["samples/count"] = len(ids)
  # Exactly once: no request's sample reached the trainer twice.
  out["samples/duplicated"] = len(ids) - len(set(ids))
  publisher = getattr(rollout, "publisher", None)
  if publisher is not None:
    stats = publisher.stats
    # Streams the trainer's publisher served over a cross-datacenter edge
    # (one per version and remote datacenter: relays fan out there).
    out["transfer/cross_dc_streams_total"] = stats.get("served_cross_dc", 0)
    out["transfer/cross_dc_bytes_total"] = stats.get("cross_dc_full_bytes", 0) + stats.get(
        "cross_dc_delta_bytes", 0
    )
    out["transfer/local_streams_total"] = stats.get("served_local", 0)
  if x.generated.wait_s:
    out["time/generation_wait_s"] = x.generated.wait_s
  for k, v in {**x.prepare, **x.updates}.items():
    if k.startswith("mismatch_by_version/"):
      # Partial rollouts: trainer/generator mismatch per version gap of the tokens.
      _, version, name = k.split("/")
      out[f"mismatch/gap{x.it - int(version)}/{name}"] = float(v)
      continue
    out[k if "/" in k else f"train/{k}"] = float(v)
  for stage, frac in timeline.bubble_fractions(x.t0, x.t1).items():
    out[f"bubble/{stage}"] = frac
  out.update(x.generated.scheduler_metrics)
  return out


# --------------------------------------------------------------------- run
def run(
    s: settings_lib.Settings,
    workdir: str,
    cluster=None,
    placement: dict | None = None,
    followers: protocol.Followers | None = None,
) -> dict:
  """Runs (or resumes) the experiment in `workdir` with the trainer in this
  process; returns the final metrics.

  `cluster` (a ClusterInfo) is the Ray cluster the generators go to, when
  the caller already joined it; `placement` describes this process, for
  <workdir>/placement.json. `streamrl.experiment.run` puts this on a Ray
  actor for the disaggregated modes. `followers`: the other processes of a
  multi-process trainer (this is process 0; each runs `follow`).
  """
  compiles.install()
  os.makedirs(workdir, exist_ok=True)
  # Refuse an incompatible workdir before anything is written into it.
  ckpt = open_checkpoints(s, workdir)
  train_examples, eval_examples = load_examples(s)
  model_dir = policy_dir(s, workdir, train_examples)
  # Before the weights load or any generator starts: will the run fit?
  model_cfg = hf.read_config(model_dir)
  if s.trainer.remat == "auto":
    s = memory_plan.resolve_remat(s, model_cfg)
    log.info("trainer.remat=auto: %s (the first that fits the memory plan)", s.trainer.remat)
  plan, fix = memory_plan.for_run(s, model_cfg)
  log.info("%s", plan.table())
  plan.check(fix)
  _, policy = hf.load_hf(model_dir)
  tokenizer = make_tokenizer(s, model_dir)
  train_examples, eval_examples = fit_prompts(s, tokenizer, train_examples, eval_examples)
  rewarder = make_rewarder(s, tokenizer, probe=train_examples[0])
  if followers:
    followers.send(protocol.Setup(model_dir, socket.gethostname()))
  trainer = RLTrainer.from_settings(policy, s)
  del policy  # the trainer holds its own (sharded) copy; the loaded one is not kept
  if followers:
    trainer = protocol.Leader(trainer, followers)
  loader = PromptLoader(train_examples, s.trainer.prompts_per_iteration, seed=s.seed)
  start, carry = 0, None
  if ckpt.latest_step() is not None:
    if followers:
      followers.send(protocol.Restore())
    start, arrays, meta = ckpt.restore(trainer.checkpoint_arrays())
    trainer.load_checkpoint_arrays(arrays)
    loader.set_state(meta["loader"])
    rewarder.errors = meta.get("reward_errors", 0)
    carry = meta.get("partial")
    log.info("Resumed from iteration %d", start)

  try:
    rollout = make_rollout(s, model_dir, cluster, workdir)
  except BaseException:
    rewarder.close()
    raise
  try:
    mode = setup_mode(
        s,
        rollout,
        model_dir=model_dir,
        workdir=workdir,
        rounds=make_rounds(loader, tokenizer, s.advantage.group_size),
    )
  except BaseException:
    rollout.close()
    rewarder.close()
    raise
  mode.on_sample = rewarder.submit  # Rewards are scored as samples arrive.
  if s.advantage.filter_groups:  # Dynamic sampling judges groups by the trained rewards.
    mode.group_rewards = GroupRewards(rewarder, s.loss, s.sampling.max_tokens)
  if start and hasattr(mode, "restore"):
    mode.restore(carry, meta["loader"])
  elif carry and carry.get("groups"):
    log.warning(
        "The checkpoint holds %d prompt groups of unfinished partial responses; this run "
        "(pipeline.partial=off) drops them. Resume with pipeline.partial=on to keep them.",
        len(carry["groups"]),
    )
  write_placement(workdir, placement, rollout)
  elastic = None
  if s.elastic.enabled:
    from streamrl.elastic.controller import ElasticGeneration  # pylint: disable=g-import-not-at-top

    elastic = ElasticGeneration(s.elastic, rollout, pool=s.cluster.generation_pool, workdir=workdir)
  if start:
    mode.push(trainer.export_weights(), start)

  writer = metrics_lib.MetricsWriter(
      workdir,
      purge_step=start + 1 if start else None,
      log=s.log,
      run_config=settings_lib.to_config(s).to_dict(),
  )
  metrics_lib.save_config(settings_lib.to_config(s), workdir)
  # log.progress=False: no bar (the scalars still go to metrics.jsonl).
  progress = metrics_lib.Progress(
      s.trainer.num_iterations, "RL", initial=start, file=None if s.log.progress else io.StringIO()
  )
  timeline = Timeline()
  final: dict = {}
  num_it = s.trainer.num_iterations
  try:
    if start == 0:
      initial = evaluate(rollout, eval_examples, tokenizer, rewarder, s)
      writer.scalars(0, {f"eval/{k}": v for k, v in initial.items()})
      final.update({f"initial_eval/{k}": v for k, v in initial.items()})
      log.info("Warm-start eval: %s", initial)
    for it in range(start, num_it):
      x = train_iteration(
          it,
          mode,
          trainer,
          rewarder,
          timeline,
          ppo_epochs=s.trainer.ppo_epochs,
          seed=s.seed,
          loss=s.loss,
          max_tokens=s.sampling.max_tokens,
      )
      scalars = iteration_scalars(x, timeline, rollout)
      scalars.update(compiles.totals())  # this process's XLA programs so far
      scalars["reward/errors_total"] = rewarder.errors
      scalars.update(rewarder.metrics())
      served_by = mode.round_instances.pop(it, None)
      if served_by is not None:
        # The instances that generated this iteration's samples.
        scalars["generators/instances"] = served_by
      if elastic is not None and it + 1 < num_it:  # No change serves only the final eval.
        changes, t_elastic = len(elastic.events), mode_base.now()
        scalars.update(
            elastic.after_iteration(it, x.generated.generation_s, x.training_s, served_by)
        )
        # Starting an instance (engine start-up, weight catch-up) holds the loop here;
        # outside time/iteration_s, so reported on its own.
        scalars["time/elastic_s"] = mode_base.now() - t_elastic
        if len(elastic.events) != changes:
          write_placement(workdir, placement, rollout)
      if s.log.eval_every and (it + 1) % s.log.eval_every == 0 or it + 1 == num_it:
        mode.quiesce()
        ev = evaluate(rollout, eval_examples, tokenizer, rewarder, s)
        scalars.update({f"eval/{k}": v for k, v in ev.items()})
        final.update({f"eval/{k}": v for k, v in ev.items()})
      writer.scalars(it + 1, scalars)
      writer.histogram(it + 1, "response_length", [len(q.token_ids) for q in x.samples])
      writer.histogram(it + 1, "staleness", [it - q.weight_version for q in x.samples])
      progress.update(1, reward=f"{scalars['reward/mean']:.3f}", acc=f"{scalars['accuracy']:.3f}")
      if (it + 1) % s.checkpoint.every == 0 or it + 1 == num_it:
        meta = {
            "loader": x.generated.round.loader_state,
            "reward_errors": rewarder.errors,
            "weight_version": it + 1,
        }
        if x.generated.round.carry is not None:
          meta["partial"] = x.generated.round.carry
        if followers:
          followers.send(protocol.Save(it + 1, meta))
        ckpt.save(it + 1, trainer.checkpoint_arrays(), meta)
      final.update({k: v for k, v in scalars.items() if not k.startswith("eval/")})
    if s.checkpoint.export_hf:
      export_hf(s, workdir, trainer, model_dir, multi_process=bool(followers))
  finally:
    progress.close()
    writer.close()
    try:
      mode.close()
    finally:
      rollout.close()
      rewarder.close()
      ckpt.close()
      if followers:
        followers.send(protocol.Stop())
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(final, f, indent=2, sort_keys=True)
  return final


def export_hf(s: settings_lib.Settings, workdir: str, trainer, model_dir: str, *, multi_process):
  """The trained policy as a Hugging Face directory, <workdir>/hf (replaced
  whole on a rerun). A multi-process trainer's shards live in several
  processes: every process writes its own into one weights file (the
  collective `export_weights`, as for a weight push), which process 0 saves.
  (Reading the final checkpoint instead would hang: Orbax waits for every
  process of the run at each restore.)"""
  out = os.path.join(workdir, HF_DIR)
  if getattr(trainer, "lora", None):  # the adapter alone too, beside the merged policy
    export.export_adapter(
        trainer.export_weights(s.model.dtype),
        model_dir=model_dir,
        out=os.path.join(workdir, ADAPTER_DIR),
        overwrite=True,
    )
  weights = trainer.export_weights() if multi_process else None
  try:
    export.export_policy(
        trainer.policy(),
        model_dir=model_dir,
        out=out,
        dtype=s.model.dtype,
        overwrite=True,
        tensors=None if weights is None else weights.tensors(),
    )
  finally:
    if weights is not None:
      weights.unlink()
  log.info("Trained policy exported to %s", out)


# ------------------------------------------------------------------ export
def read_settings(workdir: str) -> settings_lib.Settings:
  """The settings a run saved in <workdir>/config.json.

  Raises:
    MissingFileError: no such directory, or no config.json in it.
    UserError: config.json is not a run config this version reads.
  """
  if not os.path.isdir(workdir):
    raise MissingFileError(
        f"workdir {workdir} does not exist; pass the --workdir of a training run."
    )
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise MissingFileError(
        f"{workdir} has no config.json, so it is not the workdir of a training run; pass "
        "the --workdir that launch/main.py wrote."
    )
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}).") from None
  # The data and profile files the run read need not exist where it is exported.
  return settings_lib.from_config(config, check_files=False)


def saved_policy_dir(s: settings_lib.Settings, workdir: str) -> str:
  """The run's policy directory, as `policy_dir` chose it, without creating
  anything: `model.path`, or the warm-started tiny model in
  the workdir."""
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


def export_checkpoint(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    overwrite: bool = False,
    merge_lora: bool = True,
) -> int:
  """Writes the actor of run `workdir`'s checkpoint `step` (default: the
  newest) as the Hugging Face directory `out`, in the run's `model.dtype`.
  A LoRA run's actor is its policy directory with the adapter merged in, or
  with `merge_lora=False` the adapter alone as a PEFT directory (vLLM's
  `LoRARequest` and `peft` load it on the run's policy directory).

  Returns:
    The step exported.

  Raises:
    UserError: no such workdir (or not a run's), no checkpoints, no
      checkpoint of `step` (the message lists the saved ones), the run's
      policy directory is gone, or `out` is refused (`export.export_policy`).
  """
  s = read_settings(workdir)
  step = export.pick_step(workdir, step)
  model_dir = saved_policy_dir(s, workdir)
  export.check_out(out, overwrite=overwrite, model_dir=model_dir)  # before the restore
  spec = s.trainer.lora_spec()
  if spec is not None and not merge_lora:
    adapters = export.restore_adapter(workdir, model_dir, step, spec)
    export.export_adapter(
        lora.peft_tensors(adapters, spec, s.model.dtype),
        model_dir=model_dir,
        out=out,
        overwrite=overwrite,
    )
    return step
  if spec is None and not merge_lora:
    raise UserError(
        f"run {workdir} trained full weights (trainer.lora_rank=0): it has no adapter; "
        "export it without --nomerge_lora."
    )
  model = export.restore_actor(workdir, model_dir, step, spec)
  export.export_policy(
      model, model_dir=model_dir, out=out, dtype=s.model.dtype, overwrite=overwrite
  )
  return step


def follow(s: settings_lib.Settings, workdir: str, commands, reply) -> None:
  """Trainer process k > 0 of a multi-process trainer: replays, on its own
  shards of the mesh, every trainer operation process 0's `run` sends
  (streamrl/trainer/protocol.py), until told to stop."""
  ckpt = open_checkpoints(s, workdir)  # Orbax, like `run`: every process takes part.
  try:
    make = lambda policy: RLTrainer.from_settings(policy, memory_plan.resolve_remat(s, policy.cfg))
    protocol.follow(protocol.Follower(make, ckpt, reply), commands)
  finally:
    ckpt.close()
