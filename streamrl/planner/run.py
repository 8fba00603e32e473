"""Plan configs (configs/plan/*.py) -> allocation, mode and predicted throughput.

Cost models: the paper's calibration (decode constants fitted on its Fig. 7,
training at `calibration.mfu`) scaled to each pool's GPU type, or, with
`calibration.measured="costs.json"` (written by launch/measure.py), the
generator and trainer costs measured on a real machine: one generator
instance is the measured engine (its tensor-parallel size and PTL(BS)
profile), one trainer GPU does the measured trainer's work per token divided
by the devices it spanned. The measured file then stands for every pool; GPU
types still set prices, GPUs per machine and the weight-transfer links.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

from streamrl.planner.allocation import (
    Allocation,
    PlanResult,
    Pool,
    StageEstimator,
    Workload,
    plan,
)
from streamrl.scheduling.dispatch import dispatch
from streamrl.scheduling.config import Scheduler
from streamrl.sim import costs, hardware
from streamrl.sim.calibrate import from_measured
from streamrl.sim.config import ToolModel
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.engine import simulate
from streamrl.sim.plans import dispatch_inputs
from streamrl.sim.lengths import FixedLengths, PaperLengths, from_lengths
from streamrl.sim.ranker_model import sigma_for_recall
from streamrl.sim.systems import SystemCalibration, disaggregated_config

# The long-tail fraction of Algorithm 2 in every simulation the planner runs
# (the run's default; a plan hands it to scheduler.long_tail_alpha).
LONG_TAIL_ALPHA = Scheduler.long_tail_alpha


def _get(cfg: Any, key: str, default: Any = None) -> Any:
  if isinstance(cfg, Mapping):
    return cfg.get(key, default)
  return getattr(cfg, key, default)


def lengths_from_config(cfg: Any):
  """lengths.kind: "paper" (max_output), "fixed" (prompt_len, output_len) or
  "empirical" (output_lens, prompt_lens)."""
  kind = _get(cfg, "kind", "paper")
  if kind == "paper":
    return PaperLengths(max_output=int(_get(cfg, "max_output", 20480)))
  if kind == "fixed":
    return FixedLengths(
        prompt_len=int(_get(cfg, "prompt_len", 512)), output_len=int(_get(cfg, "output_len", 0))
    )
  if kind == "empirical":
    outs = list(_get(cfg, "output_lens", ()) or ())
    prompts = _get(cfg, "prompt_lens", ()) or ()
    prompts = list(prompts) if len(prompts) else int(_get(cfg, "prompt_len", 512))
    if not outs:
      raise ValueError("lengths.output_lens is empty; give at least one observed output length.")
    return from_lengths(outs, prompts)
  raise ValueError(f"lengths.kind must be 'paper', 'fixed' or 'empirical', got {kind!r}.")


def pools_from_config(cfg: Any) -> list[Pool]:
  pools = []
  for p in _get(cfg, "pools", ()) or ():
    pools.append(
        Pool(
            name=str(_get(p, "name")),
            gpu=str(_get(p, "gpu")),
            num_gpus=int(_get(p, "num_gpus")),
            datacenter=str(_get(p, "datacenter", "dc0")),
        )
    )
  return pools


def tools_from_config(cfg: Any):
  """The `tools` part of a plan config (agentic workloads): `latency_s` per call,
  `turn_tokens` policy tokens per turn, `observation_tokens` per answer; None
  (or latency_s and turn_tokens unset) for single-turn samples."""
  if cfg is None or not _get(cfg, "turn_tokens", 0):
    return None
  return ToolModel(
      latency_s=float(_get(cfg, "latency_s", 0.0)),
      turn_tokens=int(_get(cfg, "turn_tokens")),
      observation_tokens=int(_get(cfg, "observation_tokens", 0)),
  )


def calibration_from_config(cfg: Any, lengths) -> SystemCalibration:
  recall = _get(cfg, "ranker_recall", 0.87)
  sigma = sigma_for_recall(recall, lengths) if recall < 1 else 0.0
  return SystemCalibration(
      gen=costs.paper_calibration(),
      mfu=float(_get(cfg, "mfu", 0.45)),
      ranker_sigma=sigma,
      num_minibatches=int(_get(cfg, "num_minibatches", 4)),
      dispatch_objective=str(_get(cfg, "dispatch_objective", "makespan")),
  )


# ------------------------------------------------------------ measured costs


@dataclasses.dataclass(frozen=True)
class MeasuredCosts:
  """launch/measure.py's costs file as the planner uses it.

  gen: one generator instance as measured (`tp` GPUs, or one CPU engine);
  train: one trainer GPU: the measured seconds per token times the devices
    the measured trainer spanned (a CPU trainer counts as one device);
  raw: the file's dict (what it was measured on); path: where it came from.
  """

  gen: GenCostModel
  train: TrainCostModel
  tp: int
  raw: dict
  path: str = ""

  def describe(self) -> str:
    g, t = self.raw.get("generation") or {}, self.raw.get("trainer") or {}
    return (
        f"measured ({self.path or 'dict'}): generator {g.get('device', '?')} TP{self.tp} "
        f"({g.get('model', '?')}), trainer {t.get('name', '?')} x {t.get('devices', 1)} "
        "device(s)"
    )


def load_measured(source: str | os.PathLike | Mapping[str, Any]) -> MeasuredCosts:
  """Cost models from launch/measure.py's JSON (a path or its dict), through
  streamrl.sim.calibrate.from_measured.

  Raises:
    FileNotFoundError: no such file (the message says how to measure one).
    ValueError: not JSON, or its profile / trainer parts are missing or invalid.
  """
  path = "" if isinstance(source, Mapping) else os.fspath(source)
  if isinstance(source, Mapping):
    d = dict(source)
  else:
    if not os.path.isfile(path):
      raise FileNotFoundError(
          f"calibration.measured={path!r} does not exist; measure it with python "
          f"launch/measure.py --config=configs/ppo.py --out={path} (or leave it empty for "
          "the paper's calibration)."
      )
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(
            f"calibration.measured={path!r} is not valid JSON ({e}); measure it again with "
            "launch/measure.py."
        ) from None
  if not isinstance(d, dict) or not all(
      isinstance(d.get(k), Mapping) for k in ("profile", "trainer")
  ):
    raise ValueError(
        f"calibration.measured={path or '(dict)'!r} needs a 'profile' (PTL(BS)) and a "
        "'trainer' object; write it with launch/measure.py."
    )
  gen_meta = d.get("generation") or {}
  trainer = dict(d["trainer"])
  devices = int(trainer.get("devices", 1))
  if devices < 1:
    raise ValueError(f"calibration.measured: trainer.devices={devices} must be >= 1.")
  for key in ("fwd_s_per_token", "upd_s_per_token"):
    if key in trainer:
      trainer[key] = float(trainer[key]) * devices  # per device
  gen, train = from_measured(
      d["profile"], trainer, max_num_seqs=int(gen_meta.get("max_num_seqs", 256))
  )
  tp = max(1, int(gen_meta.get("tensor_parallel_size", 1)))
  return MeasuredCosts(gen=dataclasses.replace(gen, gpus=tp), train=train, tp=tp, raw=d, path=path)


class MeasuredStageEstimator(StageEstimator):
  """StageEstimator whose generator and trainer costs are measured ones."""

  def __init__(self, workload: Workload, measured: MeasuredCosts, gpus=None):
    super().__init__(workload, gpus)
    self.measured = measured

  def tp(self, gpu_name: str) -> int:
    return self.measured.tp

  def gen_cost(self, gpu_name: str) -> GenCostModel:
    return self.measured.gen

  def train_time(self, gpu_name: str, num_gpus: int) -> float:
    key = (gpu_name, num_gpus)
    if key not in self._train:
      self._train[key] = (
          math.inf
          if num_gpus < 1
          else float(
              np.mean(
                  [
                      self.measured.train.iteration_seconds(
                          (p + o).astype(np.float64), num_gpus, self.w.calib.num_minibatches
                      )
                      for p, o in self._draws
                  ]
              )
          )
      )
    return self._train[key]


def plan_with(
    pools,
    est: StageEstimator,
    *,
    objective: str = "throughput",
    unit: int = 8,
    budgets: Mapping[str, int] | None = None,
) -> PlanResult:
  """`allocation.plan` over a given estimator (here: one with measured costs)."""
  return plan(pools, est.w, objective=objective, unit=unit, budgets=budgets, estimator=est)


# ------------------------------------------------------------------ planning


@dataclasses.dataclass(frozen=True)
class PlanReport:
  """What run_plan decided, and what it decided from (for streamrl.planner.emit).

  tp: GPUs per generator instance of the chosen allocation; cost_model: "paper"
  or MeasuredCosts.describe(); long_tail: Algorithm 2's split of one
  simulated batch on the chosen instances (`long_tail_split`).
  """

  result: PlanResult
  mode: str
  predicted: dict  # mode -> simulated samples/s of the chosen allocation
  text: str
  workload: Workload | None = None
  pools: tuple = ()
  tp: int = 1
  cost_model: str = "paper"
  measured: MeasuredCosts | None = None
  long_tail: dict = dataclasses.field(default_factory=dict)

  def pool(self, name: str) -> Pool:
    return next(p for p in self.pools if p.name == name)


def run_plan(config: Any) -> PlanReport:
  """Plans per `config` (see configs/plan/qwen7b_single_dc.py) and simulates the choice."""
  model = hardware.get_model(str(config.model))
  lengths = lengths_from_config(config.lengths)
  pools = pools_from_config(config.cluster)
  for p in pools:
    hardware.get_gpu(p.gpu)
  calib = calibration_from_config(config.calibration, lengths)
  source = str(_get(config.calibration, "measured", "") or "")
  measured = load_measured(source) if source else None
  budgets = dict(_get(config, "request", {}) or {})
  unknown = sorted(set(budgets) - {p.name for p in pools})
  if unknown:
    raise ValueError(
        f"the request names pools {unknown} that are not in cluster.pools; fix the pool names."
    )
  w = Workload(
      model=model,
      lengths=lengths,
      calib=calib,
      batch_size=int(config.batch_size),
      seed=int(_get(config, "seed", 0)),
      tools=tools_from_config(_get(config, "tools")),
      pool=str(_get(config, "pool", "fixed")),
      migrate=bool(_get(config, "migrate", False)),
  )
  objective, unit = str(config.objective), int(config.unit)
  if measured is None:
    res = plan(pools, w, objective=objective, unit=unit, budgets=budgets)
    est = StageEstimator(w)
  else:
    _check_plan_inputs(pools, budgets, objective)
    est = MeasuredStageEstimator(w, measured)
    res = plan_with(pools, est, objective=objective, unit=unit, budgets=budgets)
  best = res.best
  modes = ("stream", "async") if _get(config, "allow_async", True) else ("stream",)
  predicted = {
      m: simulate_allocation(
          best,
          w,
          m,
          iterations=int(_get(config, "simulate_iterations", 3)),
          measured=measured,
      ).samples_per_s
      for m in modes
  }
  mode = max(predicted, key=predicted.get)
  cost_model = "paper" if measured is None else measured.describe()
  tp = est.tp(best.gen_gpu)
  long_tail = long_tail_split(w, est.gen_cost(best.gen_gpu), best.gen_gpus // tp)
  text = format_report(
      res,
      mode,
      predicted,
      top_k=int(_get(config, "top_k", 5)),
      cost_model=cost_model,
      tp=tp,
  )
  return PlanReport(
      result=res,
      mode=mode,
      predicted=predicted,
      text=text,
      workload=w,
      pools=tuple(pools),
      tp=tp,
      cost_model=cost_model,
      measured=measured,
      long_tail=long_tail,
  )


def _check_plan_inputs(pools, budgets: Mapping[str, int], objective: str) -> None:
  """allocation.plan's input checks, for the measured path (plan_with)."""
  from streamrl.planner.allocation import OBJECTIVES  # pylint: disable=g-import-not-at-top

  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
  if not pools:
    raise ValueError("the plan has no GPU pools; list at least one under cluster.pools.")
  for p in pools:
    b = budgets.get(p.name, p.num_gpus)
    if b > p.num_gpus:
      raise ValueError(
          f"the plan asks for {b} GPUs in pool {p.name!r}, but only {p.num_gpus} exist; "
          "lower the request or add GPUs to the pool."
      )


def long_tail_split(w: Workload, gen: GenCostModel, num_instances: int) -> dict:
  """Algorithm 2's split of one batch drawn from the plan's lengths.

  The dispatcher decides it again for every batch at run time (from the
  ranker's order and the recent lengths); this is what it picks for a
  typical batch on the chosen instances.
  """
  rng = np.random.default_rng([w.seed, 11])
  prompt, out = w.lengths.sample(rng, w.batch_size)
  recent = w.lengths.sample(rng, w.batch_size)[1]
  max_bs, profile = dispatch_inputs(gen, prompt, recent, w.calib.dispatch_latency_model)
  d = dispatch(
      out.astype(np.float64),
      max(1, num_instances),
      profile,
      recent,
      alpha=LONG_TAIL_ALPHA,
      objective=w.calib.dispatch_objective,
      max_batch_size=max_bs,
      latency_model=w.calib.dispatch_latency_model,
  )
  n_long = d.n_long_instances
  return {
      "alpha": LONG_TAIL_ALPHA,
      "long_tail_prompts": math.ceil(LONG_TAIL_ALPHA * w.batch_size),
      "long_tail_instances": n_long,
      "regular_instances": d.num_instances - n_long,
      "long_tail_batch_cap": max(d.batch_sizes[:n_long], default=0),
      "regular_batch_cap": max(d.batch_sizes[n_long:], default=0),
  }


def simulate_allocation(
    a: Allocation,
    w: Workload,
    mode: str,
    *,
    iterations: int = 3,
    measured: MeasuredCosts | None = None,
):
  gen_gpu, train_gpu = hardware.get_gpu(a.gen_gpu), hardware.get_gpu(a.train_gpu)
  cfg = disaggregated_config(
      mode,
      w.model,
      gen_gpu,
      a.gen_gpus,
      train_gpu,
      a.train_gpus,
      w.lengths,
      w.calib,
      cross_dc=a.cross_dc,
      batch_size=w.batch_size,
      iterations=iterations,
      seed=w.seed,
      tp=None if measured is None else measured.tp,
  )
  if measured is not None:
    cfg = dataclasses.replace(cfg, gen=measured.gen, train=measured.train)
  if w.tools is not None:
    cfg = dataclasses.replace(cfg, tools=w.tools)
  if w.pool != "fixed" or w.migrate:
    cfg = dataclasses.replace(cfg, pool=w.pool, migrate=w.migrate)
  return simulate(cfg)


def format_report(
    res: PlanResult,
    mode: str,
    predicted: Mapping[str, float],
    top_k: int = 5,
    *,
    cost_model: str = "paper",
    tp: int | None = None,
) -> str:
  b = res.best
  paper = "paper calibration (Fig. 7 decode fit, training at calibration.mfu)"
  lines = [
      f"objective: {res.objective}",
      f"cost models: {paper if cost_model == 'paper' else cost_model}",
      f"chosen: {b.describe()}",
  ]
  if tp:
    lines.append(f"generator instances: {b.gen_gpus // tp} x TP{tp}")
  lines += [
      f"mode: {mode}  predicted (simulated) samples/s: "
      + ", ".join(f"{m} {v:.3f}" for m, v in predicted.items()),
      f"weight transfer per update: {b.transfer_s:.2f} s",
      "runner-up options:",
  ]
  for a in res.options[1 : 1 + top_k]:
    lines.append(f"  {a.describe()}  [{res.objective} {a.objective(res.objective):.4g}]")
  return "\n".join(lines)
