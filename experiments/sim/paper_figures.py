"""Simulating the paper's experiments: the cells behind experiments/sim/reproduce_paper.py.

The paper's setups (models, GPU counts, output lengths) run through the
simulator in streamrl/sim. The reference numbers come from
experiments/reference/streamrl_paper.json (a copy kept in the repository).
Nothing here reads a paper *result* into a simulation: the JSON feeds the
Table 4 ranker recall (an input to the cost models) and, in `fit_*`, the 7B
cells of Fig. 8 as fitting targets for the three declared parameters; the
other figures are only compared against.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Iterable, Sequence

import numpy as np

from streamrl.planner.allocation import Pool, Workload, plan
from streamrl.sim import hardware
from streamrl.sim.best_split import best_split_makespan
from streamrl.sim.engine import simulate
from streamrl.sim.generation import simulate_generation
from streamrl.sim.lengths import paper_lengths
from streamrl.sim.ranker_model import sigma_for_recall
from streamrl.sim.systems import SystemCalibration, disaggregated_config, gen_cost, system_config

FIG8_SYSTEMS = ("verl", "colocation", "streamrl_sync", "streamrl_async")
LENGTHS = {"5K": 5120, "10K": 10240, "20K": 20480}
MODEL_GPUS = {"qwen2.5-7b": 32, "qwen2.5-32b": 64, "qwen2.5-72b": 128}

# The paper's figures as numbers, kept next to this file.
REFERENCE_JSON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reference", "streamrl_paper.json"
)


def find_reference(path: str | None = None) -> str:
  """Path of the paper's reference JSON: `path` if given, else REFERENCE_JSON."""
  path = path or REFERENCE_JSON
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{path} does not exist; pass --paper_json=<path to streamrl_paper.json> "
        "(the repository keeps one in experiments/reference/)."
    )
  return path


def load_reference(path: str | None = None) -> dict:
  """The paper's reference numbers (see find_reference)."""
  with open(find_reference(path)) as f:
    return json.load(f)


def ranker_sigma_from_table4(ref: dict, ranker: str = "ranker_7b", column: str = "tail20") -> float:
  """Noise level whose top-20 % recall on the paper-shaped lengths equals Table 4's."""
  t4 = ref["table4_ranker_recall_of_true_long_tail"]
  recall = t4[ranker][t4["_columns"].index(column)]
  frac = {"tail20": 0.2, "tail10": 0.1, "tail5": 0.05}[column]
  return sigma_for_recall(recall, paper_lengths(20480), frac=frac)


@dataclasses.dataclass(frozen=True)
class CellResult:
  model: str
  length: str
  samples_per_s: dict  # system -> samples/s
  gen_gpus: int  # the planner's generation share for the streamrl systems
  results: dict  # system -> SimResult

  def ratios(self, baseline: str = "colocation") -> dict:
    base = self.samples_per_s[baseline]
    return {s: v / base for s, v in self.samples_per_s.items()}


def planned_gen_gpus(
    model_name: str, num_gpus: int, lengths, calib: SystemCalibration, *, seed: int = 0
) -> int:
  """Algorithm 1 (single DC, throughput) on `num_gpus` H800."""
  w = Workload(model=hardware.MODELS[model_name], lengths=lengths, calib=calib, seed=seed)
  return plan([Pool("main", "H800", num_gpus)], w).best.gen_gpus


def run_cell(
    model_name: str,
    length: str,
    calib: SystemCalibration,
    *,
    systems: Sequence[str] = FIG8_SYSTEMS,
    iterations: int = 4,
    seed: int = 0,
    gen_gpus: int | None = None,
) -> CellResult:
  """Simulates `systems` on one Fig. 8 cell (same length draws for all systems)."""
  model = hardware.MODELS[model_name]
  gpu = hardware.GPUS["H800"]
  n = MODEL_GPUS[model_name]
  lengths = paper_lengths(LENGTHS[length])
  if gen_gpus is None and any(s.startswith("streamrl") or s == "disagg_sync" for s in systems):
    gen_gpus = planned_gen_gpus(model_name, n, lengths, calib, seed=seed)
  out, res = {}, {}
  for s in systems:
    cfg = system_config(
        s,
        model,
        gpu,
        n,
        lengths,
        calib,
        gen_gpus=gen_gpus if s.startswith(("streamrl", "disagg")) else None,
        iterations=iterations,
        seed=seed,
    )
    r = simulate(cfg)
    out[s], res[s] = r.samples_per_s, r
  return CellResult(
      model=model_name, length=length, samples_per_s=out, gen_gpus=gen_gpus or 0, results=res
  )


def fig8_errors(cell: CellResult, ref: dict) -> dict:
  """|simulated ratio / paper ratio - 1| for each system vs colocation."""
  cols = ref["fig8_throughput_samples_per_s"]["_columns"]
  paper = dict(zip(cols, ref["fig8_throughput_samples_per_s"][cell.model][cell.length]))
  sim = cell.ratios()
  return {
      s: abs(sim[s] / (paper[s] / paper["colocation"]) - 1.0) for s in cols if s != "colocation"
  }


def fit_stream_params(
    ref: dict,
    base: SystemCalibration,
    mfus: Iterable[float],
    offloads: Iterable[float | None],
    *,
    iterations: int = 4,
    seed: int = 0,
    models: Sequence[str] = ("qwen2.5-7b",),
) -> tuple[SystemCalibration, list]:
  """Grid-fits (MFU, colocation offload bandwidth) on the sync/async-vs-colocation ratios.

  Minimises the largest relative error over the given models' cells (7B only
  in the reproduction). Returns the best calibration and the whole grid.
  """
  grid = []
  offloads = list(offloads)
  for mfu in mfus:
    cal_m = dataclasses.replace(base, mfu=mfu)
    stream = {}
    for m, length in itertools.product(models, LENGTHS):
      stream[(m, length)] = run_cell(
          m,
          length,
          cal_m,
          systems=("streamrl_sync", "streamrl_async"),
          iterations=iterations,
          seed=seed,
      )
    for off in offloads:
      cal = dataclasses.replace(cal_m, offload_gb_s=off)
      errs = []
      for (m, length), sc in stream.items():
        co = run_cell(m, length, cal, systems=("colocation",), iterations=iterations, seed=seed)
        cell = CellResult(
            model=m,
            length=length,
            samples_per_s={**sc.samples_per_s, **co.samples_per_s},
            gen_gpus=sc.gen_gpus,
            results={},
        )
        e = _ratio_errors(cell, ref, ("streamrl_sync", "streamrl_async"))
        errs += list(e.values())
      grid.append((mfu, off, max(errs)))
  mfu, off, _ = min(grid, key=lambda g: (g[2], g[0]))
  return dataclasses.replace(base, mfu=mfu, offload_gb_s=off), grid


def fit_verl(
    ref: dict,
    calib: SystemCalibration,
    scales: Iterable[float],
    *,
    iterations: int = 4,
    seed: int = 0,
    models: Sequence[str] = ("qwen2.5-7b",),
) -> tuple[SystemCalibration, list]:
  """Grid-fits verl's per-step decode overhead (s) on the verl-vs-colocation ratios."""
  co = {
      (m, length): run_cell(
          m, length, calib, systems=("colocation",), iterations=iterations, seed=seed
      )
      for m, length in itertools.product(models, LENGTHS)
  }
  grid = []
  for s in scales:
    cal = dataclasses.replace(calib, verl_step_overhead_s=s)
    errs = []
    for (m, length), c in co.items():
      v = run_cell(m, length, cal, systems=("verl",), iterations=iterations, seed=seed)
      cell = CellResult(
          model=m,
          length=length,
          samples_per_s={**c.samples_per_s, **v.samples_per_s},
          gen_gpus=0,
          results={},
      )
      errs += list(_ratio_errors(cell, ref, ("verl",)).values())
    grid.append((s, max(errs)))
  best = min(grid, key=lambda g: g[1])[0]
  return dataclasses.replace(calib, verl_step_overhead_s=best), grid


def _ratio_errors(cell: CellResult, ref: dict, systems: Sequence[str]) -> dict:
  cols = ref["fig8_throughput_samples_per_s"]["_columns"]
  paper = dict(zip(cols, ref["fig8_throughput_samples_per_s"][cell.model][cell.length]))
  base = cell.samples_per_s["colocation"]
  return {
      s: abs((cell.samples_per_s[s] / base) / (paper[s] / paper["colocation"]) - 1.0)
      for s in systems
  }


def fig9_latencies(
    model_name: str,
    calib: SystemCalibration,
    gen_gpus: int,
    *,
    length: int = 20480,
    draws: int = 4,
    seed: int = 0,
    best_split: bool = False,
) -> dict:
  """Mean generation makespan (s) with random FIFO, ranker-driven skew, oracle skew.

  Also "floor": the longest sample of each draw decoded alone (batch 1), a
  lower bound on any schedule's makespan; with `best_split`, "best_split":
  the oracle's Algorithm 2 with the split chosen in hindsight per draw
  (`best_split_makespan`, a lower bound on "oracle").
  """
  model = hardware.MODELS[model_name]
  gpu = hardware.GPUS["H800"]
  dist = paper_lengths(length)
  gen = gen_cost(model, gpu, calib, dist)
  n_inst = gen_gpus // gen.gpus
  out = {"fifo": [], "streamrl": [], "oracle": [], "floor": []}
  if best_split:
    out["best_split"] = []
  for d in range(draws):
    rng = np.random.default_rng([seed, 900, d])
    p, o = dist.sample(rng, 1024)
    recent = dist.sample(rng, 1024)[1]
    kw = dict(
        recent_lengths=recent,
        objective=calib.dispatch_objective,
        seed=seed + d,
        latency_model=calib.dispatch_latency_model,
    )
    out["fifo"].append(simulate_generation(gen, n_inst, p, o, scheduler="fifo", **kw).makespan)
    out["streamrl"].append(
        simulate_generation(
            gen, n_inst, p, o, scheduler="skew", ranker_sigma=calib.ranker_sigma, **kw
        ).makespan
    )
    out["oracle"].append(
        simulate_generation(gen, n_inst, p, o, scheduler="skew", ranker_sigma=0.0, **kw).makespan
    )
    if best_split:
      out["best_split"].append(best_split_makespan(gen, n_inst, p, o, recent)[0])
    i = int(np.argmax(o))
    out["floor"].append(gen.prefill_s_per_token * p[i] + gen.decode_time(1, float(p[i]), int(o[i])))
  return {k: float(np.mean(v)) for k, v in out.items()}


def hetero_vs_homog(
    length: str, calib: SystemCalibration, *, iterations: int = 4, seed: int = 0
) -> dict:
  """Fig. 12: 32 H20 (cloud DC) generate + 16 H800 train vs 32 H800 (planned split), async.

  Returns samples/s, cost (Table 1 machine prices) and samples/s per cost.
  """
  model = hardware.MODELS["qwen2.5-7b"]
  h800, h20 = hardware.GPUS["H800"], hardware.GPUS["H20"]
  lengths = paper_lengths(LENGTHS[length])
  het_cfg = disaggregated_config(
      "async",
      model,
      h20,
      32,
      h800,
      16,
      lengths,
      calib,
      cross_dc=True,
      iterations=iterations,
      seed=seed,
  )
  het = simulate(het_cfg)
  x = planned_gen_gpus("qwen2.5-7b", 32, lengths, calib, seed=seed)
  hom = simulate(
      system_config(
          "streamrl_async",
          model,
          h800,
          32,
          lengths,
          calib,
          gen_gpus=x,
          iterations=iterations,
          seed=seed,
      )
  )
  het_cost = 32 * h20.cost_per_gpu + 16 * h800.cost_per_gpu
  hom_cost = 32 * h800.cost_per_gpu
  return {
      "hetero_sps": het.samples_per_s,
      "homog_sps": hom.samples_per_s,
      "hetero_cost": het_cost,
      "homog_cost": hom_cost,
      "hetero_per_cost": het.samples_per_s / het_cost,
      "homog_per_cost": hom.samples_per_s / hom_cost,
      "homog_gen_gpus": x,
      "hetero_transfer_s": het_cfg.transfer_s,
  }
