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
prompt group by the same shaped rewards (streamrl/trainer/shaping.py) and
releases the informative ones only.
`run` builds the parts from typed settings (streamrl/trainer/setup.py),
resumes from the workdir's last checkpoint, runs the iterations and the
evaluations, and exports the policy (streamrl/trainer/export.py); the other
processes of a multi-process trainer run `streamrl.trainer.follower.follow`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import socket
from collections.abc import Mapping

import jax
import numpy as np

from streamrl import allocator
from streamrl import metrics as metrics_lib
from streamrl import pipeline
from streamrl.config import settings as settings_lib
from streamrl.data.loader import PromptLoader
from streamrl.data.rewards import Rewarder
from streamrl.elastic.controller import ElasticGeneration
from streamrl.envs import runner as envs_runner
from streamrl.generator import make_rollout
from streamrl.generator.rollout import Rollout
from streamrl.models import hf
from streamrl.pipeline import base as mode_base
from streamrl.pipeline.timeline import Timeline
from streamrl.trainer import compiles, evaluation, export, memory_plan, protocol, setup, shaping
from streamrl.trainer.rl_trainer import RLTrainer

log = logging.getLogger(__name__)

TRAINER = "trainer"


# --------------------------------------------------------------- iteration
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
      r, c = shaping.shaped_rewards(rewarder, chunk, mode.round.examples_by_id, loss, max_tokens)
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
  allocator.release_freed()  # the update's temporaries, before the export allocates its own
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


def _combine(parts: list[dict]) -> dict:
  """Per-chunk metrics -> one value each: max of maxima, mean of the rest
  (over the chunks that have the key)."""
  out = {}
  for k in dict.fromkeys(k for p in parts for k in p):
    vals = [float(p[k]) for p in parts if k in p]
    out[k] = max(vals) if "max" in k.rsplit("/", 1)[-1] else float(np.mean(vals))
  return out


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
  """Bytes of one pushed version (`trainer.export_weights()`): a lazy
  `hf.HFTensors`, a mapping of arrays (a LoRA adapter) or a multi-process
  trainer's weights file (`transfer.WeightsFile`)."""
  if isinstance(weights, hf.HFTensors):
    return weights.nbytes()
  if isinstance(weights, Mapping):
    return int(sum(np.asarray(v).nbytes for v in weights.values()))
  return int(weights.nbytes)


def iteration_scalars(x: Iteration, timeline: Timeline, rollout: Rollout) -> dict:
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
  out.update(evaluation.accuracy_by_source("accuracy", x.samples, x.correct, x.examples_by_id))
  out.update(envs_runner.trajectory_metrics(x.samples))
  ids = [s.prompt_id for s in x.samples]
  out["samples/count"] = len(ids)
  # Exactly once: no request's sample reached the trainer twice.
  out["samples/duplicated"] = len(ids) - len(set(ids))
  if rollout.publisher is not None:
    stats = rollout.publisher.stats
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
  multi-process trainer (this is process 0; each runs
  `streamrl.trainer.follower.follow`).
  """
  compiles.install()
  os.makedirs(workdir, exist_ok=True)
  final: dict = {}
  # Every part is closed on the way out, the last made first.
  with contextlib.ExitStack() as stack:
    if followers:
      stack.callback(followers.send, protocol.Stop())
    # Refuse an incompatible workdir before anything is written into it.
    ckpt = stack.enter_context(contextlib.closing(setup.open_checkpoints(s, workdir)))
    train_examples, eval_examples = setup.load_examples(s)
    model_dir = setup.policy_dir(s, workdir, train_examples)
    s = setup.plan_memory(s, model_dir)  # will the run fit? (before the weights load)
    policy = setup.load_policy(s, model_dir)
    tokenizer = setup.make_tokenizer(s, model_dir)
    train_examples, eval_examples = setup.fit_prompts(s, tokenizer, train_examples, eval_examples)
    rewarder = setup.make_rewarder(s, tokenizer, probe=train_examples[0])
    stack.callback(rewarder.close)
    if followers:
      followers.send(protocol.Setup(model_dir, socket.gethostname()))
    trainer = RLTrainer.from_settings(policy, s)
    del policy  # the trainer holds its own (sharded) copy; the loaded one is not kept
    if followers:
      trainer = protocol.Leader(trainer, followers)
    loader = PromptLoader(train_examples, s.trainer.prompts_per_iteration, seed=s.seed)
    start, meta = setup.resume(ckpt, trainer, loader, rewarder, followers)
    if s.trainer.precompile:  # compiled while the generators start and make the first round
      prompts = (
          len(x.prompt_token_ids or tokenizer.encode_prompt(x.prompt)) for x in train_examples
      )
      trainer.start_warm_up(**RLTrainer.warm_up_args(s, max(prompts)))
    rollout = make_rollout(s, model_dir, cluster, workdir)
    stack.callback(rollout.close)
    mode = pipeline.make_mode(
        s,
        rollout,
        rounds=pipeline.make_rounds(loader, tokenizer, s.advantage.group_size),
        model_dir=model_dir,
        workdir=workdir,
        on_sample=rewarder.submit,  # Rewards are scored as samples arrive.
        # Dynamic sampling (if on) judges groups by the rewards trained on.
        group_rewards=shaping.GroupRewards(rewarder, s.loss, s.sampling.max_tokens),
    )
    stack.callback(mode.close)
    if start:
      mode.restore(meta.get("partial"), meta["loader"])
      mode.scheduler.set_state(meta.get("scheduler"))  # each prompt's lengths so far
    setup.write_placement(workdir, placement, rollout)
    elastic = None
    if s.elastic.enabled:
      elastic = ElasticGeneration(
          s.elastic, rollout, pool=s.cluster.generation_pool, workdir=workdir
      )
    if start:
      mode.push(trainer.export_weights(), start)

    writer = metrics_lib.MetricsWriter(
        workdir,
        purge_step=start + 1 if start else None,
        log=s.log,
        run_config=settings_lib.to_config(s).to_dict(),
    )
    stack.callback(writer.close)
    metrics_lib.save_config(settings_lib.to_config(s), workdir)
    # log.progress=False: no bar (the scalars still go to metrics.jsonl).
    progress = metrics_lib.Progress(
        s.trainer.num_iterations,
        "RL",
        initial=start,
        file=None if s.log.progress else io.StringIO(),
    )
    stack.callback(progress.close)
    timeline = Timeline()
    num_it = s.trainer.num_iterations
    if start == 0:
      initial = evaluation.evaluate(rollout, eval_examples, tokenizer, rewarder, s)
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
      scalars.update(memory_plan.measured())  # the trainer's memory/* beside its plan
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
          setup.write_placement(workdir, placement, rollout)
      if s.log.eval_every and (it + 1) % s.log.eval_every == 0 or it + 1 == num_it:
        mode.quiesce()
        ev = evaluation.evaluate(rollout, eval_examples, tokenizer, rewarder, s)
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
            "scheduler": mode.scheduler.get_state(),
        }
        if x.generated.round.carry is not None:
          meta["partial"] = x.generated.round.carry
        if followers:
          followers.send(protocol.Save(it + 1, meta))
        ckpt.save(it + 1, trainer.checkpoint_arrays(), meta)
        allocator.release_freed()  # the checkpoint's buffers, before the next update
      final.update({k: v for k, v in scalars.items() if not k.startswith("eval/")})
    if s.checkpoint.export_hf:
      export.export_trained(s, workdir, trainer, model_dir, multi_process=bool(followers))
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(final, f, indent=2, sort_keys=True)
  return final
