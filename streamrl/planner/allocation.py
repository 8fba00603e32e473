"""Resource allocation (the paper's Algorithm 1) over homogeneous or heterogeneous pools.

Stage times come from the simulator's cost models:
  T_gen(x):   makespan of one batch generated on x GPUs (simulated, with the
              configured scheduler, averaged over a few length draws);
  T_train(y): FLOPs of one batch on y GPUs (TrainCostModel).
In steady state a disaggregated pipeline runs at batch / max(T_gen, T_train)
(async; stream adds the part of training that cannot overlap), so:

  single DC, budget n:  enumerate x + y <= n (multiples of `unit`), keep the
                        best objective (min max(T_gen, T_train) for throughput).
  two pools (e.g. two DCs), budgets m and n: both stages at full allocation,
                        then shrink the faster stage to the k minimising
                        |T_faster(k) - T_slower| and release the rest.

Objectives: "throughput" (samples/s) or "throughput_per_cost" (samples/s per
unit of machine cost, Table 1 prices).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from streamrl.sim import costs, hardware
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.generation import simulate_generation
from streamrl.sim.hardware import GpuSpec, ModelSpec
from streamrl.sim.systems import SystemCalibration, gen_cost

OBJECTIVES = ("throughput", "throughput_per_cost")


@dataclasses.dataclass(frozen=True)
class Pool:
  """GPUs of one type in one datacenter that the plan may use."""

  name: str
  gpu: str
  num_gpus: int
  datacenter: str = "dc0"

  def __post_init__(self):
    if self.num_gpus < 1:
      raise ValueError(f"pool {self.name!r} must have at least one GPU, got {self.num_gpus}.")


@dataclasses.dataclass(frozen=True)
class Workload:
  """What one RL iteration needs: model, lengths, batch, and the calibration."""

  model: ModelSpec
  lengths: object
  calib: SystemCalibration
  batch_size: int = 1024
  scheduler: str = "skew"
  num_draws: int = 2
  seed: int = 0
  tools: object = None  # sim.engine.ToolModel: multi-turn trajectories with tool calls
  pool: str = "fixed"  # sim.engine.SimConfig.pool: the generators' work pool (scheduler.pool)
  migrate: bool = False  # sim.engine.SimConfig.migrate: stragglers move (scheduler.migrate)


@dataclasses.dataclass(frozen=True)
class Allocation:
  """One candidate: x GPUs generate in `gen_pool`, y GPUs train in `train_pool`."""

  gen_pool: str
  gen_gpu: str
  gen_gpus: int
  train_pool: str
  train_gpu: str
  train_gpus: int
  t_gen: float
  t_train: float
  transfer_s: float
  cross_dc: bool
  cost: float
  batch_size: int

  @property
  def stage_time(self) -> float:
    return max(self.t_gen, self.t_train)

  @property
  def samples_per_s(self) -> float:
    """Stage-model throughput (async steady state: the slower stage)."""
    return self.batch_size / self.stage_time if self.stage_time > 0 else 0.0

  def objective(self, name: str) -> float:
    if name == "throughput":
      return self.samples_per_s
    return self.samples_per_s / self.cost

  def describe(self) -> str:
    where = "cross-DC" if self.cross_dc else "one DC"
    return (
        f"gen {self.gen_gpus} x {self.gen_gpu} ({self.gen_pool}) + train {self.train_gpus} x "
        f"{self.train_gpu} ({self.train_pool}), {where}: T_gen {self.t_gen:.1f} s, "
        f"T_train {self.t_train:.1f} s, stage model {self.samples_per_s:.2f} samples/s, "
        f"cost {self.cost:.2f}"
    )


class StageEstimator:
  """Cached T_gen(gpu, x) and T_train(gpu, y) for one workload."""

  def __init__(self, workload: Workload, gpus: Mapping[str, GpuSpec] | None = None):
    self.w = workload
    self.gpus = dict(hardware.GPUS if gpus is None else gpus)
    self._gen: dict = {}
    self._train: dict = {}
    rng = np.random.default_rng([workload.seed, 7])
    # The same draws for every candidate (common random numbers), plus a
    # "recent history" draw for the dispatcher.
    self._draws = [
        workload.lengths.sample(rng, workload.batch_size) for _ in range(workload.num_draws)
    ]
    self._recent = workload.lengths.sample(rng, workload.batch_size)[1]
    for p, o in self._draws:
      if p.size == 0 or np.any(o <= 0):
        raise ValueError("the length distribution produced no or non-positive lengths; fix it.")

  def gpu(self, name: str) -> GpuSpec:
    return hardware.get_gpu(name, self.gpus)

  def tp(self, gpu_name: str) -> int:
    return hardware.default_tp(self.w.model, self.gpu(gpu_name))

  def gen_cost(self, gpu_name: str) -> GenCostModel:
    return gen_cost(
        self.w.model, self.gpu(gpu_name), self.w.calib, self.w.lengths, tp=self.tp(gpu_name)
    )

  def gen_time(self, gpu_name: str, num_gpus: int) -> float:
    key = (gpu_name, num_gpus)
    if key not in self._gen:
      tp = self.tp(gpu_name)
      n_inst = num_gpus // tp
      if n_inst < 1:
        self._gen[key] = math.inf
      else:
        gen = self.gen_cost(gpu_name)
        times = [
            simulate_generation(
                gen,
                n_inst,
                p,
                o,
                scheduler=self.w.scheduler,
                ranker_sigma=self.w.calib.ranker_sigma,
                recent_lengths=self._recent,
                objective=self.w.calib.dispatch_objective,
                seed=self.w.seed + i,
                latency_model=self.w.calib.dispatch_latency_model,
                tools=self.w.tools,
            ).makespan
            for i, (p, o) in enumerate(self._draws)
        ]
        self._gen[key] = float(np.mean(times))
    return self._gen[key]

  def train_time(self, gpu_name: str, num_gpus: int) -> float:
    key = (gpu_name, num_gpus)
    if key not in self._train:
      if num_gpus < 1:
        self._train[key] = math.inf
      else:
        train = TrainCostModel.for_gpu(
            self.w.model, self.gpu(gpu_name), self.w.calib.mfu, critic=self.w.calib.critic
        )
        self._train[key] = float(
            np.mean(
                [
                    train.iteration_seconds(
                        (p + o).astype(np.float64), num_gpus, self.w.calib.num_minibatches
                    )
                    for p, o in self._draws
                ]
            )
        )
    return self._train[key]

  def allocation(self, gen_pool: Pool, x: int, train_pool: Pool, y: int) -> Allocation:
    cross = gen_pool.datacenter != train_pool.datacenter
    gen_gpu = self.gpu(gen_pool.gpu)
    transfer = costs.weight_transfer_seconds(
        self.w.model,
        x,
        gen_gpu.gpus_per_machine,
        inter_dc_link=hardware.INTER_DC_LINK if cross else None,
    )
    cost = x * gen_gpu.cost_per_gpu + y * self.gpu(train_pool.gpu).cost_per_gpu
    return Allocation(
        gen_pool=gen_pool.name,
        gen_gpu=gen_pool.gpu,
        gen_gpus=x,
        train_pool=train_pool.name,
        train_gpu=train_pool.gpu,
        train_gpus=y,
        t_gen=self.gen_time(gen_pool.gpu, x),
        t_train=self.train_time(train_pool.gpu, y),
        transfer_s=transfer,
        cross_dc=cross,
        cost=cost,
        batch_size=self.w.batch_size,
    )


def _sizes(total: int, unit: int) -> list[int]:
  return list(range(unit, total + 1, unit))


def _key(a: Allocation, objective: str):
  # Best objective first; ties: fewer GPUs, then more generation GPUs.
  return (-a.objective(objective), a.gen_gpus + a.train_gpus, -a.gen_gpus)


def single_dc(
    pool: Pool,
    est: StageEstimator,
    *,
    unit: int = 8,
    objective: str = "throughput",
    budget: int | None = None,
) -> list[Allocation]:
  """Algorithm 1, one DC: every x + y <= budget (multiples of unit), best first."""
  n = pool.num_gpus if budget is None else budget
  if n < 2 * unit:
    raise ValueError(
        f"pool {pool.name!r} has {n} GPUs; a disaggregated plan needs at least "
        f"{2 * unit} (one {unit}-GPU unit per stage)."
    )
  tp = est.tp(pool.gpu)
  options = []
  for x in _sizes(n - unit, unit):
    if x < tp:
      continue
    for y in _sizes(n - x, unit):
      options.append(est.allocation(pool, x, pool, y))
  if not options:
    raise ValueError(f"no split of pool {pool.name!r} fits a TP{tp} generator instance; add GPUs.")
  return sorted(options, key=lambda a: _key(a, objective))


def shrink_faster(
    gen_pool: Pool,
    train_pool: Pool,
    est: StageEstimator,
    *,
    unit: int = 8,
    gen_budget: int | None = None,
    train_budget: int | None = None,
) -> list[Allocation]:
  """Algorithm 1, two pools: full allocation, then shrink the faster stage.

  The faster stage shrinks to the size k minimising |T_faster(k) - T_slower|
  among the sizes that keep it no slower than the other stage (with coarse
  units the unconstrained minimiser can overshoot and make the shrunk stage
  the bottleneck; we never do that). Returns [chosen, full allocation, other
  sizes of the shrunk stage...].
  """
  m = gen_pool.num_gpus if gen_budget is None else gen_budget
  n = train_pool.num_gpus if train_budget is None else train_budget
  full = est.allocation(gen_pool, m, train_pool, n)
  if not (math.isfinite(full.t_gen) and math.isfinite(full.t_train)):
    raise ValueError(
        f"pools {gen_pool.name!r}/{train_pool.name!r} cannot hold one generator instance "
        "and one trainer GPU; add GPUs."
    )
  if full.t_gen <= full.t_train:
    cands = [
        est.allocation(gen_pool, k, train_pool, n)
        for k in _sizes(m, unit)
        if k >= est.tp(gen_pool.gpu)
    ]
    slower = full.t_train
    shrunk = lambda a: a.t_gen
  else:
    cands = [est.allocation(gen_pool, m, train_pool, k) for k in _sizes(n, unit)]
    slower = full.t_gen
    shrunk = lambda a: a.t_train
  ok = [a for a in cands if shrunk(a) <= slower] or [full]
  # Ties: the smaller allocation (releases more).
  chosen = min(ok, key=lambda a: (abs(shrunk(a) - slower), a.gen_gpus + a.train_gpus))
  rest = sorted(
      (a for a in cands if a is not chosen and a != full),
      key=lambda a: (abs(shrunk(a) - slower), a.gen_gpus + a.train_gpus),
  )
  return [chosen] + ([full] if full != chosen else []) + rest


@dataclasses.dataclass(frozen=True)
class PlanResult:
  best: Allocation
  options: tuple[Allocation, ...]  # best first, including best
  objective: str


def plan(
    pools: Sequence[Pool],
    workload: Workload,
    *,
    objective: str = "throughput",
    unit: int = 8,
    budgets: Mapping[str, int] | None = None,
    gpus: Mapping[str, GpuSpec] | None = None,
    estimator: "StageEstimator | None" = None,
) -> PlanResult:
  """Best allocation over the given pools.

  One pool: Algorithm 1 (single DC). Several pools: every (gen pool, train
  pool) pair goes through the shrink-the-faster-stage rule, and every pool
  alone through the single-DC enumeration; the best objective wins.
  `estimator` replaces the paper-calibrated stage estimator (e.g. one with
  measured costs, streamrl/planner/run.py).
  """
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
  if not pools:
    raise ValueError("the plan has no GPU pools; list at least one under cluster.pools.")
  budgets = dict(budgets or {})
  for p in pools:
    b = budgets.get(p.name, p.num_gpus)
    if b > p.num_gpus:
      raise ValueError(
          f"the plan asks for {b} GPUs in pool {p.name!r}, but only {p.num_gpus} exist; "
          "lower the request or add GPUs to the pool."
      )
  est = estimator or StageEstimator(workload, gpus)
  for p in pools:
    est.gpu(p.gpu)  # Unknown GPU types fail here, with one sentence.
  options: list[Allocation] = []
  for p in pools:
    b = budgets.get(p.name, p.num_gpus)
    if b >= 2 * unit:
      options += single_dc(p, est, unit=unit, objective=objective, budget=b)
  for gp in pools:
    for tp_ in pools:
      if gp is tp_:
        continue
      options += shrink_faster(
          gp,
          tp_,
          est,
          unit=unit,
          gen_budget=budgets.get(gp.name, gp.num_gpus),
          train_budget=budgets.get(tp_.name, tp_.num_gpus),
      )
  if not options:
    raise ValueError("no allocation is possible with these pools; add GPUs.")
  # Two-pool candidates are ranked by the rule above, the rest by objective.
  uniq = list(dict.fromkeys(options))
  two_pool_best = [a for a in uniq if a.gen_pool != a.train_pool]
  chosen_pairs = []
  for gp in pools:
    for tp_ in pools:
      if gp is not tp_:
        pair = [a for a in two_pool_best if a.gen_pool == gp.name and a.train_pool == tp_.name]
        if pair:
          chosen_pairs.append(pair[0])  # shrink_faster puts its choice first
  same_pool = [a for a in uniq if a.gen_pool == a.train_pool]
  finalists = sorted(chosen_pairs + same_pool, key=lambda a: _key(a, objective))
  best = finalists[0]
  others = sorted((a for a in uniq if a is not best), key=lambda a: _key(a, objective))
  return PlanResult(best=best, options=tuple([best] + others), objective=objective)
