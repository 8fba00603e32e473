"""Plan configs (configs/plan/*.py) -> allocation, mode and predicted throughput."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


from streamrl.planner.allocation import Allocation, PlanResult, Pool, Workload, plan
from streamrl.sim import costs
from streamrl.sim.engine import simulate
from streamrl.sim.lengths import FixedLengths, PaperLengths, from_lengths
from streamrl.sim.ranker_model import sigma_for_recall
from streamrl.sim.systems import SystemCalibration, disaggregated_config


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


@dataclasses.dataclass(frozen=True)
class PlanReport:
  result: PlanResult
  mode: str
  predicted: dict  # mode -> simulated samples/s of the chosen allocation
  text: str


def run_plan(config: Any) -> PlanReport:
  """Plans per `config` (see configs/plan/qwen7b_single_dc.py) and simulates the choice."""
  model = costs.get_model(str(config.model))
  lengths = lengths_from_config(config.lengths)
  pools = pools_from_config(config.cluster)
  for p in pools:
    costs.get_gpu(p.gpu)
  calib = calibration_from_config(config.calibration, lengths)
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
  )
  res = plan(pools, w, objective=str(config.objective), unit=int(config.unit), budgets=budgets)
  best = res.best
  modes = ("stream", "async") if _get(config, "allow_async", True) else ("stream",)
  predicted = {
      m: simulate_allocation(
          best, w, m, iterations=int(_get(config, "simulate_iterations", 3))
      ).samples_per_s
      for m in modes
  }
  mode = max(predicted, key=predicted.get)
  text = format_report(res, mode, predicted, top_k=int(_get(config, "top_k", 5)))
  return PlanReport(result=res, mode=mode, predicted=predicted, text=text)


def simulate_allocation(a: Allocation, w: Workload, mode: str, *, iterations: int = 3):
  gen_gpu, train_gpu = costs.get_gpu(a.gen_gpu), costs.get_gpu(a.train_gpu)
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
  )
  return simulate(cfg)


def format_report(
    res: PlanResult, mode: str, predicted: Mapping[str, float], top_k: int = 5
) -> str:
  b = res.best
  lines = [
      f"objective: {res.objective}",
      f"chosen: {b.describe()}",
      f"mode: {mode}  predicted (simulated) samples/s: "
      + ", ".join(f"{m} {v:.3f}" for m, v in predicted.items()),
      f"weight transfer per update: {b.transfer_s:.2f} s",
      "runner-up options:",
  ]
  for a in res.options[1 : 1 + top_k]:
    lines.append(f"  {a.describe()}  [{res.objective} {a.objective(res.objective):.4g}]")
  return "\n".join(lines)
