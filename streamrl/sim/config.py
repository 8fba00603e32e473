"""One simulated run (`SimConfig`), its knobs named as the run settings name them.

A field that is also a run setting carries that setting's name and meaning
(`long_tail_alpha` is `scheduler.long_tail_alpha`, `mini_batch_size` is
`trainer.mini_batch_size`, ...), and the scheduler's defaults are the
`Scheduler` part's own; `SimConfig.from_settings` builds one from a run's
resolved settings. The other fields say what only a simulation needs: the
cost models, the length distribution, the simulated ranker's noise, measured
seconds (weight transfer, the ranker's refresh), shared cores.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.scheduling.config import Scheduler
from streamrl.scheduling.dispatch import LATENCY_MODELS, OBJECTIVES
from streamrl.scheduling.pool import POOLS
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.lengths import LengthDistribution

if TYPE_CHECKING:
  from streamrl.config.settings import Settings

MODES = ("colocated", "verl", "sync", "stream", "async")
SCHEDULERS = ("fifo", "skew")


@dataclasses.dataclass(frozen=True)
class ToolModel:
  """Multi-turn trajectories (streamrl/envs): a sample's output is written in
  turns of `turn_tokens` policy tokens (the last one shorter), and between two
  turns it calls a tool: it leaves its instance's batch for `latency_s` (the
  engine decodes the others meanwhile), then comes back with
  `observation_tokens` more context, of which only the observation is
  prefilled (the rest is in the prefix cache), ahead of the instance's
  pending prompts, at the instance's next admission (or at once when its
  batch is empty). A sample of L output tokens makes ceil(L / turn_tokens) - 1
  calls, so long trajectories are the many-turn ones, as in an agentic run.
  Admission inside a running batch waits for the next finish, as every
  admission in this engine does."""

  latency_s: float
  turn_tokens: int
  observation_tokens: int = 0

  def __post_init__(self):
    if self.latency_s < 0 or self.turn_tokens < 1 or self.observation_tokens < 0:
      raise ValueError(
          "tool latency_s and observation_tokens must be >= 0 and turn_tokens >= 1, got "
          f"{self.latency_s}, {self.observation_tokens} and {self.turn_tokens}."
      )

  def calls(self, output_tokens) -> np.ndarray:
    """Tool calls of samples of these output lengths."""
    out = np.asarray(output_tokens, np.int64)
    return np.maximum(-(-out // self.turn_tokens) - 1, 0)


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated run.

  Fields named as a run setting (the setting's key in brackets):
    mode: one of MODES [pipeline.mode]; "verl" is colocated with verl's
      decode overhead (the paper's baseline).
    num_instances: generator instances, each gen.gpus GPUs
      [engine.num_instances].
    trainer_gpus: GPUs the trainer runs on, all GPUs when colocated
      [cluster.trainer_gpus; a CPU trainer is one].
    samples_per_iteration: samples per iteration [Settings.samples_per_iteration].
    num_iterations: iterations simulated [trainer.num_iterations].
    mini_batch_size: samples per PPO mini-batch; the updates are sequential
      [trainer.mini_batch_size].
    ppo_epochs: passes over the batch per iteration; TrainCostModel's update
      cost covers them all. Stream trains each mini-batch's first epoch as it
      fills and the others after generation (the other modes: all epochs
      after their forward work, so only stream's timing depends on it)
      [trainer.ppo_epochs].
    scheduler: "fifo" (random FIFO) or "skew" (Algorithm 2 + LPT)
      [scheduler.kind; "oracle" is "skew" with ranker_sigma 0].
    long_tail_alpha: long-tail fraction for Algorithm 2 [scheduler.long_tail_alpha].
    objective: Algorithm 2's objective, "makespan" or "sum" (the paper's)
      [scheduler.objective].
    latency_model: Algorithm 2's latency estimate, "paper"
      (PTL(BS) * L_avg * ceil(M / BS)) or "simulate" (continuous batching
      replayed per instance); see streamrl.scheduling.dispatch
      [scheduler.latency_model].
    pool: "fixed" (each instance admits from its own list) or "shared" (every
      instance admits from one queue, the plan's lists interleaved: the
      shared work pool of streamrl/scheduling/pool.py) [scheduler.pool].
    migrate: with pool="shared", stragglers move as the run moves them: once
      the pool is empty, an idle instance takes the running request with the
      most tokens from the instance with the most in flight (`pool.donor`),
      which resumes there (prefilling prompt + tokens so far) [scheduler.migrate].
    max_staleness: async only; generation j uses the weights of
      j - 1 - max_staleness [pipeline.max_staleness].
    partial_oversample: async only; > 0 turns partial rollouts on (see
      engine.py): each round starts max(1, ceil(groups * this)) extra groups
      [pipeline.partial_oversample, when pipeline.partial is on].
    max_token_version_gap: partial rollouts: the oldest token a response may
      carry into training, in weight versions [pipeline.max_token_version_gap].
    group_size: samples per prompt group (samples_per_iteration / group_size
      groups per iteration); partial rollouts train whole groups
      [advantage.group_size].
    seed: all randomness derives from it [seed].
  Fields of the simulation alone:
    gen: cost of one generator instance.
    train: trainer cost model.
    lengths: length distribution, or one per iteration (len >= num_iterations).
    warmup: iterations excluded from the steady-state throughput (>= 1 when
      num_iterations > 1: the first async iteration has no overlap).
    ranker_sigma: log-space noise of the simulated ranker (0 = oracle).
    transfer_s: weight transfer (or colocated reshard) seconds per update.
    gen_cores: cores the generator instances share (one machine's generation
      pool), in units of what one instance uses alone (pool cores / threads
      per instance); None = each instance has its own hardware. With more
      instances decoding than that, each one's costs scale by
      instances / gen_cores.
    share_cost: the extra cost factor (>= 1) of an instance while more
      instances decode than there are `gen_cores`, over perfect time-sharing;
      1.0 = sharing costs nothing.
    tools: multi-turn trajectories with tool calls (`ToolModel`); None:
      single-turn samples.
    ranker_refresh_s: seconds of the generation side's core that the length
      ranker's refresh takes after each round (`scheduler.kind="skew"` with
      `ranker_side="generators"`: the refresh runs beside the generators,
      at a lower priority, from the round's end). What of it is left when
      the next round starts is taken from that round's generation (one core:
      the refresh's leftover seconds add to the round); 0: no refresh.
    added_round_s: seconds by which a round run on more instances than the
      round before starts generating later, per added instance: an added
      engine's first round is slow (its first steps, caches filling), which
      the latency profile of a warm engine does not hold. Measured on the
      generator alone (experiments/bench/bench_elastic.py: the first two-instance
      round after the addition against the later ones); 0: not modelled.
  """

  mode: str
  gen: GenCostModel
  num_instances: int
  train: TrainCostModel
  trainer_gpus: int
  lengths: LengthDistribution | tuple
  samples_per_iteration: int
  num_iterations: int
  mini_batch_size: int
  ppo_epochs: int = 1
  warmup: int = 1
  scheduler: str = Scheduler.kind
  ranker_sigma: float = 0.0
  long_tail_alpha: float = Scheduler.long_tail_alpha
  objective: str = Scheduler.objective
  latency_model: str = Scheduler.latency_model
  pool: str = Scheduler.pool
  migrate: bool = Scheduler.migrate
  transfer_s: float = 0.0
  max_staleness: int = 1
  partial_oversample: float = 0.0
  max_token_version_gap: int = 2
  group_size: int = 1
  seed: int = 0
  gen_cores: int | None = None
  share_cost: float = 1.0
  tools: ToolModel | None = None
  ranker_refresh_s: float = 0.0
  added_round_s: float = 0.0

  @property
  def partial(self) -> bool:
    return self.partial_oversample > 0

  @property
  def num_minibatches(self) -> int:
    """PPO updates per epoch: the mini-batches one iteration's samples fill."""
    return -(-self.samples_per_iteration // self.mini_batch_size)

  @classmethod
  def from_settings(
      cls,
      s: Settings,
      *,
      gen: GenCostModel,
      train: TrainCostModel,
      lengths: LengthDistribution | tuple,
      **simulation: Any,
  ) -> SimConfig:
    """The simulated run of a run's resolved settings `s`.

    Every field named as a setting is read from `s` (an oracle scheduler is
    "skew" with ranker_sigma 0; partial rollouts count only where
    `s.partial_rollouts` turns them on); `gen`, `train`, `lengths` and the
    keywords (the fields of the simulation alone: warmup, ranker_sigma,
    transfer_s, gen_cores, share_cost, tools, ranker_refresh_s,
    added_round_s) say what a run does not.
    """
    run_keys = set(_SETTINGS_FIELDS) & set(simulation)
    if run_keys:
      raise ValueError(
          f"{sorted(run_keys)} come from the run's settings; change them there, not here."
      )
    sched = s.scheduler
    if sched.kind == "oracle":
      simulation["ranker_sigma"] = 0.0
    return cls(
        mode=s.pipeline.mode,
        gen=gen,
        num_instances=s.engine.num_instances,
        train=train,
        trainer_gpus=max(1, s.cluster.trainer_gpus),
        lengths=lengths,
        samples_per_iteration=s.samples_per_iteration,
        num_iterations=s.trainer.num_iterations,
        mini_batch_size=s.trainer.mini_batch_size,
        ppo_epochs=s.trainer.ppo_epochs,
        scheduler="skew" if sched.kind == "oracle" else sched.kind,
        long_tail_alpha=sched.long_tail_alpha,
        objective=sched.objective,
        latency_model=sched.latency_model,
        pool=sched.pool,
        migrate=sched.migrate,
        max_staleness=s.pipeline.max_staleness,
        partial_oversample=s.pipeline.partial_oversample if s.partial_rollouts else 0.0,
        max_token_version_gap=s.pipeline.max_token_version_gap,
        group_size=s.advantage.group_size,
        seed=s.seed,
        **simulation,
    )

  def __post_init__(self):
    if self.ppo_epochs < 1:
      raise ValueError(f"ppo_epochs must be >= 1, got {self.ppo_epochs}.")
    if self.group_size < 1 or self.samples_per_iteration % self.group_size:
      raise ValueError(
          f"samples_per_iteration={self.samples_per_iteration} must be a multiple of "
          f"group_size={self.group_size}."
      )
    if self.partial:
      if self.mode != "async" or self.tools is not None:
        raise ValueError(
            "partial rollouts (partial_oversample > 0) are simulated in async mode without "
            f"tools; got mode={self.mode!r}, tools={self.tools!r}."
        )
      if self.max_token_version_gap < self.max_staleness:
        raise ValueError(
            f"max_token_version_gap={self.max_token_version_gap} must be >= "
            f"max_staleness={self.max_staleness}."
        )
    if self.pool not in POOLS:
      raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}.")
    if self.migrate and self.pool != "shared":
      raise ValueError(
          "migrate moves requests between the instances of a shared pool; set pool='shared'."
      )
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
    if self.scheduler not in SCHEDULERS:
      raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}.")
    if self.objective not in OBJECTIVES:
      raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}.")
    if self.latency_model not in LATENCY_MODELS:
      raise ValueError(
          f"latency_model must be one of {LATENCY_MODELS}, got {self.latency_model!r}."
      )
    if self.num_instances < 1 or self.trainer_gpus < 1:
      raise ValueError("need at least one generator instance and one trainer GPU.")
    if self.samples_per_iteration < 1 or self.num_iterations < 1 or self.mini_batch_size < 1:
      raise ValueError("samples_per_iteration, num_iterations and mini_batch_size must be >= 1.")
    if self.gen_cores is not None and not (
        isinstance(self.gen_cores, (int, np.integer)) and self.gen_cores >= 1
    ):
      raise ValueError(f"gen_cores must be None or an int >= 1, got {self.gen_cores!r}.")
    if not (math.isfinite(self.share_cost) and self.share_cost >= 1.0):
      raise ValueError(f"share_cost must be a finite factor >= 1, got {self.share_cost!r}.")
    if not (math.isfinite(self.ranker_refresh_s) and self.ranker_refresh_s >= 0):
      raise ValueError(
          f"ranker_refresh_s must be finite seconds >= 0, got {self.ranker_refresh_s!r}."
      )
    if not (math.isfinite(self.added_round_s) and self.added_round_s >= 0):
      raise ValueError(f"added_round_s must be finite seconds >= 0, got {self.added_round_s!r}.")
    if isinstance(self.lengths, (tuple, list)) and len(self.lengths) < self.num_iterations:
      raise ValueError(
          f"got {len(self.lengths)} length distributions for {self.num_iterations} iterations; "
          "give one per iteration."
      )

  def lengths_at(self, j: int) -> LengthDistribution:
    return self.lengths[j] if isinstance(self.lengths, (tuple, list)) else self.lengths


# The fields `from_settings` reads from the run's settings.
_SETTINGS_FIELDS = (
    "mode",
    "num_instances",
    "trainer_gpus",
    "samples_per_iteration",
    "num_iterations",
    "mini_batch_size",
    "ppo_epochs",
    "scheduler",
    "long_tail_alpha",
    "objective",
    "latency_model",
    "pool",
    "migrate",
    "max_staleness",
    "partial_oversample",
    "max_token_version_gap",
    "group_size",
    "seed",
)
