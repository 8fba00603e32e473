"""The elastic policy replayed by the simulator: a `simulate` controller that
applies `streamrl.elastic.policy.ElasticPolicy` with a real run's timing
(the rule itself lives in streamrl/elastic/, which imports no simulator)."""

from __future__ import annotations

from typing import Callable, Sequence

from streamrl.elastic.policy import Decision, ElasticPolicy, StageTimes
from streamrl.sim.engine import IterationStats

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
