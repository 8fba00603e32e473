"""The elastic policy: after each iteration, add or release one generator
instance, from the measured stage times alone (pure; no simulator, no Ray).

A real run applies it through `streamrl/elastic/controller.py`; the
simulator replays the same rule (`streamrl/planner/elastic.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


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
    """From a `streamrl.config.settings.Elastic`."""
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
