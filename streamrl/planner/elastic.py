"""Elastic generation scaling: add a generation unit when the stage gap pays for it.

Policy (paper, Sec. on elasticity): after each iteration, with
  Delta  = T_gen - T_train  (measured stage gap of the last finished iteration)
  saving = T_gen(x) - T_gen(x + unit)  (estimated on that iteration's lengths),
add one unit of generation instances when Delta > saving, i.e. when the extra
unit's whole saving turns into throughput (the pipeline stays generation-bound
or exactly balanced); a unit whose estimated saving is <= 0 is never added. Each decision looks only at iterations that ran with the
current instance count, so a new unit is judged after it has taken effect.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from streamrl.sim.costs import GenCostModel
from streamrl.sim.engine import IterationStats, SimConfig, SimResult, simulate, simulate_generation


@dataclasses.dataclass(frozen=True)
class ElasticStep:
  """One look at the stage gap (made when iteration `iteration` starts generating)."""

  iteration: int
  observed_iteration: int
  instances: int
  gap_s: float
  saving_s: float
  added: bool


class ElasticController:
  """SimConfig controller: returns the number of generator instances per iteration.

  Args:
    gen: cost of one instance (to estimate the saving of one more unit).
    start_instances: instances at the start.
    unit_instances: instances per added unit (e.g. 8 GPUs / TP).
    max_instances: never grow beyond this.
    scheduler, ranker_sigma, objective, seed: as in simulate_generation.
  """

  def __init__(
      self,
      gen: GenCostModel,
      start_instances: int,
      unit_instances: int,
      max_instances: int,
      *,
      scheduler: str = "skew",
      ranker_sigma: float = 0.0,
      objective: str = "makespan",
      seed: int = 0,
  ):
    if unit_instances < 1 or start_instances < 1:
      raise ValueError("start_instances and unit_instances must be >= 1.")
    self.gen = gen
    self.x = start_instances
    self.unit = unit_instances
    self.max_instances = max_instances
    self.scheduler = scheduler
    self.sigma = ranker_sigma
    self.objective = objective
    self.seed = seed
    self.steps: list[ElasticStep] = []
    self._seen: set[int] = set()

  def estimate_gen(self, instances: int, stats: IterationStats) -> float:
    return simulate_generation(
        self.gen,
        instances,
        stats.prompt_lens,
        stats.output_lens,
        scheduler=self.scheduler,
        ranker_sigma=self.sigma,
        recent_lengths=stats.output_lens,
        objective=self.objective,
        seed=self.seed + stats.index,
    ).makespan

  def __call__(self, j: int, finished: Sequence[IterationStats]) -> int:
    current = [s for s in finished if s.num_instances == self.x and s.index not in self._seen]
    if current and self.x + self.unit <= self.max_instances:
      last = current[-1]
      self._seen.add(last.index)
      saving = self.estimate_gen(self.x, last) - self.estimate_gen(self.x + self.unit, last)
      gap = last.stage_gap
      # A unit that saves nothing (the stage is long-tail bound) is never added.
      added = gap > saving > 0
      self.steps.append(
          ElasticStep(
              iteration=j,
              observed_iteration=last.index,
              instances=self.x,
              gap_s=gap,
              saving_s=saving,
              added=added,
          )
      )
      if added:
        self.x += self.unit
    return self.x


@dataclasses.dataclass(frozen=True)
class ElasticRun:
  result: SimResult
  steps: tuple[ElasticStep, ...]
  instances: np.ndarray  # [iterations]
  gaps: np.ndarray  # [iterations] measured stage gap

  @property
  def additions(self) -> list[ElasticStep]:
    return [s for s in self.steps if s.added]


def run_elastic(config: SimConfig, controller: ElasticController) -> ElasticRun:
  """Simulates `config` with the elastic controller deciding the instance count."""
  result = simulate(config, controller=controller)
  inst = np.asarray([s.num_instances for s in result.iterations])
  gaps = np.asarray([s.stage_gap for s in result.iterations])
  return ElasticRun(result=result, steps=tuple(controller.steps), instances=inst, gaps=gaps)


# --------------------------------------------- the rule a real run applies
# One rule for the real Stream Generation Service (streamrl/train.py applies
# it after every iteration) and for the simulator's replay of a run
# (`policy_controller` below): it sees only measured stage times.


@dataclasses.dataclass(frozen=True)
class StageTimes:
  """What one finished iteration measured."""

  iteration: int
  instances: int  # generator instances that served it
  generation_s: float  # first request sent -> last sample received
  training_s: float  # the trainer's busy time


@dataclasses.dataclass(frozen=True)
class Decision:
  """The policy's answer after `iteration`: change the instance count by
  `delta` (+1, -1 or 0), to `instances`, because of `reason`."""

  iteration: int
  delta: int
  instances: int
  reason: str


def parse_schedule(text: str) -> dict[int, int]:
  """ "2:+1,4:-1" -> {2: +1, 4: -1} (after iteration 2 add one, after 4 remove one)."""
  out: dict[int, int] = {}
  for part in (p.strip() for p in (text or "").split(",")):
    if not part:
      continue
    it, sep, delta = part.partition(":")
    try:
      it_n, delta_n = int(it), int(delta)
    except ValueError:
      it_n = delta_n = None
    if not sep or it_n is None or it_n < 0 or delta_n == 0:
      raise ValueError(f"{part!r} is not iteration:+n or iteration:-n; write e.g. '2:+1,4:-1'.")
    out[it_n] = out.get(it_n, 0) + delta_n
  return out


class ElasticPolicy:
  """Decides, after each iteration, whether to add or release a generator instance.

  Expected saving of one more instance with x running: T_gen / (x + 1)
  (generation throughput-bound, scaling linearly). Rules, in order:
  - schedule (forced changes) replaces everything else when given;
  - an instance added `observe` iterations ago whose measured saving (median
    T_gen before minus median after) is below `min_gain` of the expected
    saving is released ("it did not pay"), and adding waits `cooldown`
    iterations, doubled for every such failed addition;
  - add one when T_gen - T_train > T_gen / (x + 1) (the run stays
    generation-bound or balanced with it, the paper's rule), x < max and the
    pool has a free slot;
  - release one when T_train > T_gen * x / (x - 1) (still training-bound
    without it) and x > min.
  The first `warmup_iterations` iterations are never looked at (the trainer
  compiles its steps there). Every look uses the medians of the last
  `observe` iterations whose round
  ran with the current count (`StageTimes.instances`): in async mode the
  round after a change was generated ahead, with the old count, and is
  ignored.
  """

  def __init__(
      self,
      *,
      start_instances: int,
      min_instances: int = 1,
      max_instances: int = 4,
      observe_iterations: int = 2,
      min_gain: float = 0.5,
      cooldown_iterations: int = 4,
      schedule: dict[int, int] | str | None = None,
      warmup_iterations: int = 1,
  ):
    self.instances = int(start_instances)
    self.min_instances = int(min_instances)
    self.max_instances = int(max_instances)
    self.observe = max(1, int(observe_iterations))
    self.min_gain = float(min_gain)
    self.cooldown = int(cooldown_iterations)
    self.warmup = int(warmup_iterations)
    self.schedule = parse_schedule(schedule) if isinstance(schedule, str) else dict(schedule or {})
    self._since_change: list[StageTimes] = []
    self._before: list[StageTimes] = []  # the window before the last addition
    self._trial = False  # the last change was an addition not judged yet
    self._no_add_until = -1
    self._failed_trials = 0
    self.decisions: list[Decision] = []

  @classmethod
  def from_settings(cls, el, start_instances: int) -> "ElasticPolicy":
    """From a `streamrl.settings.Elastic`."""
    return cls(
        start_instances=start_instances,
        min_instances=el.min_instances,
        max_instances=el.max_instances,
        observe_iterations=el.observe_iterations,
        min_gain=el.min_gain,
        cooldown_iterations=el.cooldown_iterations,
        schedule=el.schedule,
        warmup_iterations=el.warmup_iterations,
    )

  def _change(self, t: StageTimes, delta: int, reason: str) -> Decision:
    if delta > 0:
      self._before = list(self._since_change)
      self._trial = not self.schedule
    else:
      self._trial = False
    self.instances += delta
    self._since_change = []
    d = Decision(t.iteration, delta, self.instances, reason)
    self.decisions.append(d)
    return d

  def set_instances(self, n: int) -> None:
    """The count changed outside the policy (e.g. an instance died, unreplaced)."""
    if n != self.instances:
      self.instances = int(n)
      self._since_change, self._trial = [], False

  def decide(self, t: StageTimes, free_slots: int = 1 << 30) -> Decision:
    keep = Decision(t.iteration, 0, self.instances, "")
    if self.schedule:
      delta = self.schedule.get(t.iteration, 0)
      delta = max(self.min_instances, min(self.max_instances, self.instances + delta)) - (
          self.instances
      )
      if delta > 0 and free_slots < delta:
        return Decision(t.iteration, 0, self.instances, f"scheduled +{delta}: no free slot")
      if delta:
        return self._change(t, delta, f"scheduled {delta:+d} after iteration {t.iteration}")
      return keep
    if t.instances != self.instances or t.iteration < self.warmup:
      # Served by the count before the last change (async generates ahead),
      # or a warm-up iteration (the trainer's compilation, cold caches).
      return keep
    self._since_change.append(t)
    window = self._since_change[-self.observe :]
    if len(window) < self.observe:
      return keep
    gen = float(np.median([w.generation_s for w in window]))
    train = float(np.median([w.training_s for w in window]))
    x = self.instances
    if self._trial:
      self._trial = False
      before = float(np.median([w.generation_s for w in self._before[-self.observe :]]))
      expected = before / x
      saved = before - gen
      if saved < self.min_gain * expected and x > self.min_instances:
        # Each addition that did not pay doubles the wait before the next try.
        self._failed_trials += 1
        self._no_add_until = t.iteration + self.cooldown * 2 ** (self._failed_trials - 1)
        return self._change(
            t,
            -1,
            f"the added instance ({x} running) saved {saved:.3f} s of generation per "
            f"iteration ({before:.3f} -> "
            f"{gen:.3f} s), below {self.min_gain:.0%} of the expected {expected:.3f} s: released",
        )
    saving = gen / (x + 1)
    if (
        gen - train > saving
        and x < self.max_instances
        and free_slots >= 1
        and t.iteration >= self._no_add_until
    ):
      return self._change(
          t,
          +1,
          f"generation-bound: generation {gen:.3f} s - training {train:.3f} s > the "
          f"{saving:.3f} s one more instance is expected to save",
      )
    if x > self.min_instances and train > gen * x / (x - 1):
      return self._change(
          t,
          -1,
          f"training-bound: training {train:.3f} s > generation {gen:.3f} s even with one "
          f"instance fewer ({gen * x / (x - 1):.3f} s)",
      )
    return keep


# ------------------------------------------- the same rule in the simulator
FreeSlots = int | Callable[[int, int], int]


def stage_times(stats: IterationStats) -> StageTimes:
  """What a real run would measure for a simulated iteration: generation from the
  round's start to its last sample, training = the trainer's busy time."""
  return StageTimes(
      iteration=int(stats.index),
      instances=int(stats.num_instances),
      generation_s=float(stats.gen_time),
      training_s=float(stats.train_busy),
  )


class PolicyController:
  """`simulate` controller that applies an ElasticPolicy with a real run's timing.

  The engine calls `iteration_finished(stats)` the moment iteration `it`
  finishes training; the policy then decides on `stage_times(stats)` (what
  streamrl/train.py measures after `it`). The engine calls the controller
  itself when a generation round starts, and the round runs on the policy's
  count at that moment: a decision after `it` applies to the first round that
  starts after it (round it + 1 in sync, stream and colocated modes; in async
  mode, where round it + 1 usually starts while `it` still trains, the first
  round starting later, it + 1 + max_staleness at the latest). The simulated
  instance joins its round at the start, with no start-up time, and a removed
  one is gone by the round's start (it drained the previous round).

  Args:
    policy: a fresh ElasticPolicy (its start_instances is round 0's count).
    free_slots: the generation pool's free slots the policy is told, an int
      or free_slots(iteration, instances) -> int, called at each decision with
      the iteration just finished and the instances running then.
  Attributes:
    looks: every Decision `decide` returned, in order (delta 0 included).
    decisions: the changes (the policy's `decisions`); simulate() copies them
      into SimResult.decisions.
    instances: {round: instances it ran on}.
    applied: {iteration of a change: first round run on its count}, None for
      changes after the last round started.
  """

  def __init__(self, policy: ElasticPolicy, free_slots: FreeSlots = 1 << 30):
    self.policy = policy
    self.free_slots = free_slots
    self.looks: list[Decision] = []
    self.instances: dict[int, int] = {}
    self.applied: dict[int, int | None] = {}
    self._seen: set[int] = set()

  @property
  def decisions(self) -> tuple[Decision, ...]:
    return tuple(self.policy.decisions)

  def _free(self, iteration: int) -> int:
    if callable(self.free_slots):
      return int(self.free_slots(iteration, self.policy.instances))
    return int(self.free_slots)

  def iteration_finished(self, stats: IterationStats) -> None:
    if stats.index in self._seen:
      return
    self._seen.add(stats.index)
    d = self.policy.decide(stage_times(stats), self._free(stats.index))
    self.looks.append(d)
    if d.delta:
      self.applied[d.iteration] = None

  def __call__(self, j: int, finished: Sequence[IterationStats]) -> int:
    # An engine without the `iteration_finished` hook: decide now, in order.
    for s in finished:
      self.iteration_finished(s)
    for it, first in self.applied.items():
      if first is None:
        self.applied[it] = j
    n = self.policy.instances
    self.instances[j] = n
    return n


def policy_controller(policy: ElasticPolicy, free_slots: FreeSlots = 1 << 30) -> PolicyController:
  """simulate(config, controller=policy_controller(policy)) runs `policy`'s
  decisions on the simulated stage times (see PolicyController)."""
  return PolicyController(policy, free_slots)
