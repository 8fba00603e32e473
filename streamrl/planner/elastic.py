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
from streamrl.sim.config import SimConfig
from streamrl.sim.engine import IterationStats, SimResult, simulate
from streamrl.sim.generation import simulate_generation


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
