"""What every pipeline mode shares: the backend, the timeline, the metrics."""

from __future__ import annotations

import time

import numpy as np

from streamrl.generator import local as backends
from streamrl.pipeline.scheduler import GenerationScheduler
from streamrl.pipeline.timeline import Timeline

TRAINER = "trainer"


def generator_stage(instance_id: int) -> str:
  return f"generator{instance_id}"


class Pipeline:
  """Holds the generation backend, the trainer and the timeline.

  Subclasses implement `iteration(it, loader, tokenizer, rewarder)` and
  return {"scalars", "lengths", "samples", "loader_state"}.
  """

  def __init__(self, config, model_dir: str, trainer, backend=None, workdir: str | None = None,
               cluster=None):
    from streamrl.train import make_requests  # pylint: disable=g-import-not-at-top
    self.make_requests = make_requests
    self.config = config
    self.trainer = trainer
    self.backend = backend or backends.make_backend(config, model_dir, cluster)
    self.timeline = Timeline()
    self.scheduler = GenerationScheduler(config, model_dir, workdir,
                                         getattr(self.backend, "num_instances", 1))
    self.scheduler_metrics: dict = {}
    self._synced_intervals = 0
    self._dead_reported = 0
    self.generator = self  # train.evaluate calls self.generator.generate
    if backend is None and config.pipeline.mode != "colocated":
      self._pin_trainer()

  def _pin_trainer(self) -> None:
    """On a local Ray, keeps the trainer off the generators' cores."""
    if self.config.cluster.address:
      return
    from streamrl import cluster  # pylint: disable=g-import-not-at-top
    c = self.config.cluster
    shares = cluster.plan_cpu_shares(c.generator_cpus, c.trainer_cpus)
    cluster.bound_trainer_threads(shares.trainer_cores)

  # Evaluation and one-off generation go straight to the backend.
  def generate(self, requests, sampling):
    return self.backend.generate(requests, sampling)

  def generate_round(self, requests, by_id, it: int):
    """Streams one round's samples, dispatched by the configured scheduler."""
    assignments, caps = self.scheduler.plan(requests, by_id, seed=self.config.seed + it)
    return self.backend.generate(None if assignments else requests,
                                 backends.sampling_for(self.config, it),
                                 assignments=assignments, caps=caps)

  def observe(self, samples) -> None:
    self.scheduler_metrics = self.scheduler.observe(samples)

  def train_batch(self, it: int, samples, by_id, rewarder):
    """Rewards, scores and trains on a whole batch (sync and async)."""
    with self.timeline.busy(TRAINER, f"train {it}"):
      scores, correct = rewarder(samples, by_id)
      self.trainer.begin_iteration(snapshot=False)
      minis, prep = self.trainer.prepare(samples, scores)
      train_metrics = self.trainer.train(minis, np.random.default_rng([self.config.seed, it]))
    return scores, correct, prep, train_metrics

  def push_weights(self, tensors, version: int) -> None:
    self.backend.update(tensors, version)

  def sync_generator_intervals(self) -> None:
    """Copies the backend's per-instance busy intervals into the timeline."""
    intervals = self.backend.busy_intervals
    for i, start, end, _ in intervals[self._synced_intervals:]:
      self.timeline.add(generator_stage(i), start, end)
    self._synced_intervals = len(intervals)

  def scalars(self, it, t0, t1, samples, scores, correct, prep, train_metrics, times) -> dict:
    self.sync_generator_intervals()
    lengths = np.array([len(s.token_ids) for s in samples], np.float64)
    wall = max(t1 - t0, 1e-9)
    out = {"reward/mean": float(np.mean(scores)), "accuracy": float(np.mean(correct)),
           "response_length/mean": lengths.mean(),
           "response_length/p50": float(np.percentile(lengths, 50)),
           "response_length/p90": float(np.percentile(lengths, 90)),
           "response_length/max": lengths.max(),
           "throughput/samples_per_s": len(samples) / wall,
           "throughput/tokens_per_s": float(lengths.sum()) / wall,
           "time/iteration_s": wall}
    staleness = np.array([it - s.weight_version for s in samples], np.float64)
    out["staleness/mean"] = staleness.mean()
    out["staleness/max"] = staleness.max()
    out.update({f"time/{k}": v for k, v in times.items()})
    out.update({f"train/{k}": v for k, v in prep.items()})
    out.update({f"train/{k}": v for k, v in train_metrics.items()})
    for stage, frac in self.timeline.bubble_fractions(t0, t1).items():
      out[f"bubble/{stage}"] = frac
    out.update(self.scheduler_metrics)
    dead = getattr(self.backend, "dead_instances", [])
    out["generators/dead"] = len(dead)
    return out

  def close(self) -> None:
    self.backend.close()


def take_examples(loader):
  """The next batch, and the loader state a checkpoint after it must hold."""
  examples = next(loader)
  return examples, loader.get_state()


def now() -> float:
  return time.perf_counter()
