"""Reproduces the StreamRL paper's cluster-scale results with the simulator.

  python experiments/sim/reproduce_paper.py [--out=experiments/out/paper] [--skip_scale]

The simulated cells are in experiments/sim/paper_figures.py, Fig. 8, Table 3
and Fig. 9 in experiments/sim/paper_sections.py, the paper's numbers in
experiments/reference/streamrl_paper.json. Writes PNG plots and report.md
(simulated vs paper) into --out and ends
with `RESULT fig8_max_rel_err=.. table3_max_abs_err=.. fig9_max_abs_err=..
fig12_max_rel_err=..`. Errors compare ratios, never absolute samples/s:
Fig. 8 and Table 3 normalise every system to colocation within its cell,
Fig. 9 normalises generation latency to random FIFO, Fig. 12 compares the
hetero/homog ratio of cost-normalised throughput.

Calibration (all printed with their source): the decode model from the
paper's Fig. 7 curve plus hardware specs; the ranker noise from Table 4;
generator admission reserves KV for the maximum output per sequence
(--reserve_max_output, no preemption; False gives vLLM-style admission);
then three parameters fitted on the 7B cells of Fig. 8 only — training MFU
and colocation's offload bandwidth (on the sync/async-vs-colocation ratios),
and verl's per-step decode overhead (on verl-vs-colocation). 32B and 72B are
held out. Takes about 30 s on two cores; --quick skips the scale benchmark
and simulates 2 iterations per cell (the path, not the numbers).

Goals: 0.15 / 0.08 / 0.08 / 0.15 (fig8 / table3 / fig9 / fig12).

Measured results: experiments/RESULTS.md (section reproduce_paper.py).
"""

import dataclasses
import os
import time


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import harness  # noqa: E402
from experiments.sim import paper_figures as paper  # noqa: E402
from experiments.sim.paper_sections import Report, fig8, fig9, table3  # noqa: E402
from streamrl.planner import ElasticController, Workload, run_elastic  # noqa: E402
from streamrl.sim import costs, hardware, plans  # noqa: E402
from streamrl.sim.engine import simulate  # noqa: E402
from streamrl.sim.lengths import paper_lengths  # noqa: E402
from streamrl.sim.systems import SystemCalibration, disaggregated_config, system_config  # noqa: E402

_PAPER = flags.DEFINE_string(
    "paper_json",
    None,
    "The paper's reference numbers (default: experiments/reference/streamrl_paper.json).",
)
_SKIP_SCALE = flags.DEFINE_bool("skip_scale", False, "Skip the 1,024-GPU scale benchmark.")
_ITERS = flags.DEFINE_integer("iterations", 4, "Iterations per simulation (first is warm-up).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of every length draw.")
_RESERVE = flags.DEFINE_bool(
    "reserve_max_output",
    True,
    "Generator admission reserves KV for the maximum output (no preemption); "
    "False: vLLM-style admission on the prompt with preemption.",
)
_LATENCY_MODEL = flags.DEFINE_enum(
    "dispatch_latency_model",
    "paper",
    ["paper", "simulate"],
    "Algorithm 2's latency estimate (streamrl.scheduling.dispatch).",
)


def calibrate(ref, rep, iters, seed):
  rep.h("Calibration")
  gen = costs.paper_calibration()
  sigma = paper.ranker_sigma_from_table4(ref)
  rep.table(
      ["parameter", "value", "source"],
      [
          [
              "HBM bandwidth reachable",
              f"{gen.mem_bw_eff:.2f} x peak",
              "assumption (typical measured fraction)",
          ],
          [
              "context during Fig. 7 profiling",
              "1024 tokens/seq",
              "assumption (not stated in the paper)",
          ],
          [
              "per-layer decode step overhead",
              f"{gen.layer_overhead_s * 1e3:.4f} ms",
              "fitted: Fig. 7 PTL(1) minus weight read time",
          ],
          [
              "decode/prefill GEMM efficiency",
              f"{gen.decode_compute_eff:.3f}",
              "fitted: Fig. 7 slope minus KV read",
          ],
          [
              "TP all-reduce latency",
              f"{gen.tp_allreduce_s * 1e6:.0f} us x 2 per layer",
              "assumption",
          ],
          ["engine memory / max seqs", f"{gen.gpu_mem_util} / {gen.max_num_seqs}", "vLLM defaults"],
          ["TP per model", "7B:1, 32B:4, 72B:8 (H800)", "rule: weights <= 25 % of instance HBM"],
          [
              "ranker noise sigma (log-length)",
              f"{sigma:.3f}",
              "Table 4 ranker_7b top-20 % recall 0.87",
          ],
          ["PPO mini-batches", "4", "assumption (verl default 1024/256)"],
          [
              "generator admission",
              "reserve KV for prompt + max output per sequence"
              if _RESERVE.value
              else "vLLM: admit on prompt, preempt when full",
              "assumption (engine policy, not stated in the paper); reserving reproduces Fig. 9's model-size ordering, "
              "vLLM admission does not (both shown under Fig. 9)",
          ],
          [
              "Algorithm 2 latency model",
              _LATENCY_MODEL.value,
              "paper formula PTL(BS) * L_avg * ceil(M / BS)"
              if _LATENCY_MODEL.value == "paper"
              else "continuous batching replayed per instance",
          ],
      ],
  )
  base = SystemCalibration(
      gen=gen,
      ranker_sigma=sigma,
      reserve_max_output=_RESERVE.value,
      dispatch_latency_model=_LATENCY_MODEL.value,
  )
  t0 = time.time()
  cal, grid = paper.fit_stream_params(
      ref,
      base,
      mfus=np.round(np.arange(0.25, 0.601, 0.05), 2),
      offloads=[None, 20, 10, 7, 5, 4, 3, 2.5, 2, 1.5, 1],
      iterations=iters,
      seed=seed,
  )
  best_err = min(g[2] for g in grid)
  cal, vgrid = paper.fit_verl(
      ref, cal, np.round(np.arange(0.0, 0.0301, 0.001), 4), iterations=iters, seed=seed
  )
  verr = min(g[1] for g in vgrid)
  rep.p("")
  rep.table(
      ["fitted on 7B cells only", "value", "grid", "7B max rel err at fit"],
      [
          ["training MFU (H800)", f"{cal.mfu:.2f}", "0.25..0.60 step 0.05", f"{best_err:.3f}"],
          [
              "colocation offload bandwidth",
              f"{cal.offload_gb_s} GB/s",
              "none, 20..1 GB/s",
              "(joint with MFU)",
          ],
          [
              "verl extra host time per decode step",
              f"{cal.verl_step_overhead_s * 1e3:.0f} ms",
              "0..30 ms step 1",
              f"{verr:.3f}",
          ],
      ],
  )
  rep.p(f"\n(fit took {time.time() - t0:.0f} s)")
  return cal


def fig10(ref, cal, rep, iters, seed, out):
  rep.h("Fig. 10: allocation (Algorithm 1) vs even split, async")
  pf = ref["fig10_allocation"]
  rows, speed = [], {}
  for m, key in (("qwen2.5-32b", "qwen2.5-32b_64gpus"), ("qwen2.5-72b", "qwen2.5-72b_128gpus")):
    n = paper.MODEL_GPUS[m]
    for length in paper.LENGTHS:
      lengths = paper_lengths(paper.LENGTHS[length])
      x = paper.planned_gen_gpus(m, n, lengths, cal, seed=seed)
      model, gpu = hardware.MODELS[m], hardware.GPUS["H800"]
      thr = {}
      for name, g in (("chosen", x), ("even", n // 2)):
        thr[name] = simulate(
            system_config(
                "streamrl_async",
                model,
                gpu,
                n,
                lengths,
                cal,
                gen_gpus=g,
                iterations=iters,
                seed=seed,
            )
        ).samples_per_s
      speed[(m, length)] = thr["chosen"] / thr["even"]
      rows.append(
          [m, length, f"{x}/{n - x}", str(pf[key]["chosen_gen_train"]), f"{speed[(m, length)]:.3f}"]
      )
  rep.table(
      ["model", "len", "chosen gen/train (sim)", "paper chosen", "speedup vs even (sim)"], rows
  )
  rep.p(
      f"\npaper: max speedup vs even {pf['max_speedup_vs_even']}; simulated max {max(speed.values()):.3f}"
  )
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.bar(range(len(speed)), list(speed.values()))
  ax.set_xticks(range(len(speed)), [f"{m.split('-')[-1]} {l}" for m, l in speed], fontsize=7)
  ax.axhline(1.0, color="k", lw=0.5)
  ax.set_ylabel("chosen / even split throughput")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "fig10_allocation.png"), dpi=110)
  plt.close(fig)


def _elastic_run(model_name, num_gpus, cal, seed, iters=30, max_units=6):
  model, gpu = hardware.MODELS[model_name], hardware.GPUS["H800"]
  dists = tuple(paper_lengths(int(round(10240 + 10240 * j / (iters - 1)))) for j in range(iters))
  x0 = paper.planned_gen_gpus(model_name, num_gpus, dists[0], cal, seed=seed)
  cfg = disaggregated_config(
      "async", model, gpu, x0, gpu, num_gpus - x0, dists[0], cal, iterations=iters, seed=seed
  )
  cfg = dataclasses.replace(cfg, lengths=dists)
  unit = 8 // cfg.gen.gpus
  ctl = ElasticController(
      cfg.gen,
      cfg.num_instances,
      unit,
      cfg.num_instances + max_units * unit,
      ranker_sigma=cal.ranker_sigma,
      objective=cal.dispatch_objective,
      seed=seed,
  )
  return x0, cfg, run_elastic(cfg, ctl)


def fig11(ref, cal, rep, seed, out):
  rep.h(
      "Fig. 11: elastic generation scale-up as output lengths grow (10K -> 20K over 30 iterations)"
  )
  rep.p(
      "policy: add one 8-GPU generation unit when Delta = T_gen - T_train (last iteration at the current "
      "size) exceeds the simulated saving of one more unit on that iteration's lengths; training GPUs fixed"
  )
  fig, ax = plt.subplots(2, 2, figsize=(11, 6))
  for row, (m, n) in enumerate((("qwen2.5-7b", 32), ("qwen2.5-32b", 64))):
    x0, cfg, run = _elastic_run(m, n, cal, seed)
    adds = run.additions
    rep.p(
        f"\n{m} on {n} GPUs: start {x0} gen + {n - x0} train (Algorithm 1 at 10K)"
        + (" — the paper's setup" if m == "qwen2.5-7b" else " — a larger-batch-per-instance setup")
    )
    rep.table(
        [
            "added at iteration",
            "judged on iteration",
            "gen GPUs before",
            "Delta (s)",
            "saving of one unit (s)",
        ],
        [
            [
                s.iteration,
                s.observed_iteration,
                s.instances * cfg.gen.gpus,
                f"{s.gap_s:.1f}",
                f"{s.saving_s:.1f}",
            ]
            for s in adds
        ],
    )
    rep.p(
        f"additions at iterations {[s.iteration for s in adds]}; Delta per iteration "
        f"{[round(g) for g in run.gaps]}"
    )
    it = np.arange(len(run.gaps))
    ax[row, 0].plot(it, run.instances * cfg.gen.gpus, drawstyle="steps-post")
    ax[row, 0].set_ylabel(f"{m.split('-')[-1]}: generation GPUs")
    ax[row, 1].plot(it, run.gaps, marker=".")
    for s in adds:
      ax[row, 1].axvline(s.iteration, color="r", lw=0.5)
    ax[row, 1].set_ylabel("Delta = T_gen - T_train (s)")
  for a in ax[1]:
    a.set_xlabel("iteration (max output 10K -> 20K)")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "fig11_elastic.png"), dpi=110)
  plt.close(fig)
  rep.p(f"\npaper: {ref['fig11_elastic']}")


def fig12(ref, cal, rep, iters, seed, out):
  rep.h("Fig. 12: heterogeneous (32 H20 gen, other DC, + 16 H800 train) vs 32 H800, per cost")
  p12 = ref["fig12_hetero_cost_normalized_samples_per_s"]
  rows, errs, sim_r, pap_r = [], [], [], []
  for length in paper.LENGTHS:
    h = paper.hetero_vs_homog(length, cal, iterations=iters, seed=seed)
    r = h["hetero_per_cost"] / h["homog_per_cost"]
    pr = p12[length][0] / p12[length][1]
    errs.append(abs(r / pr - 1))
    sim_r.append(r)
    pap_r.append(pr)
    rows.append(
        [
            length,
            f"{h['hetero_sps']:.2f}",
            f"{h['homog_sps']:.2f} ({h['homog_gen_gpus']} gen)",
            f"{h['hetero_cost']:.2f} / {h['homog_cost']:.2f}",
            f"{r:.3f} / {pr:.3f}",
            f"{errs[-1]:.3f}",
            f"{h['hetero_transfer_s']:.1f} s",
        ]
    )
  rep.table(
      [
          "len",
          "hetero samples/s",
          "homog samples/s",
          "cost hetero/homog",
          "per-cost ratio sim/paper",
          "rel err",
          "cross-DC transfer",
      ],
      rows,
  )
  fig, ax = plt.subplots(figsize=(5, 3.5))
  x = np.arange(3)
  ax.bar(x - 0.2, sim_r, 0.4, label="simulated")
  ax.bar(x + 0.2, pap_r, 0.4, label="paper")
  ax.set_xticks(x, list(paper.LENGTHS))
  ax.set_ylabel("hetero / homog samples/s per cost")
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "fig12_hetero.png"), dpi=110)
  plt.close(fig)
  return max(errs)


def fig2_check(ref, cal, rep, seed):
  rep.h("Check (not fitted): Fig. 2 scaling of 7B from 8 to 32 GPUs")
  model = hardware.MODELS["qwen2.5-7b"]
  w = Workload(model=model, lengths=paper_lengths(20480), calib=cal, seed=seed)
  from streamrl.planner.allocation import StageEstimator

  est = StageEstimator(w)
  g = est.gen_time("H800", 32) / est.gen_time("H800", 8)
  t = est.train_time("H800", 32) / est.train_time("H800", 8)
  rep.p(
      f"generation time x{g:.2f} (paper x0.69), training time x{t:.2f} (paper x0.19: the paper's trainer "
      "scales super-linearly, ours is linear in GPUs)"
  )


def scale_benchmark(cal, rep):
  rep.h(
      "Scale: simulator cost vs events (7B, async, 5K lengths, half the GPUs generate, 2 iterations)"
  )
  model, gpu = hardware.MODELS["qwen2.5-7b"], hardware.GPUS["H800"]
  # Algorithm 2's closed-form latency model: the "simulate" model replays every
  # candidate split, too slow for hundreds of instances.
  cal = dataclasses.replace(cal, dispatch_latency_model="paper")
  rows = []
  real_dispatch = plans.dispatch
  spent = [0.0]

  def timed_dispatch(*a, **kw):  # Separates Algorithm 2's own cost from the event loop's.
    t = time.perf_counter()
    try:
      return real_dispatch(*a, **kw)
    finally:
      spent[0] += time.perf_counter() - t

  plans.dispatch = timed_dispatch
  try:
    for gpus, samples in ((128, 8192), (256, 16384), (512, 32768), (1024, 65536)):
      for sched in ("fifo", "skew"):
        cfg = disaggregated_config(
            "async",
            model,
            gpu,
            gpus // 2,
            gpu,
            gpus // 2,
            paper_lengths(5120),
            cal,
            batch_size=samples,
            iterations=2,
            scheduler=sched,
        )
        spent[0] = 0.0
        t0 = time.perf_counter()
        r = simulate(cfg)
        wall = time.perf_counter() - t0
        loop = wall - spent[0]
        rows.append(
            [
                gpus,
                samples,
                sched,
                r.events,
                f"{wall:.1f}",
                f"{spent[0]:.1f}",
                f"{r.events / loop:.0f}",
                f"{loop / r.events * 1e6:.1f}",
            ]
        )
  finally:
    plans.dispatch = real_dispatch
  rep.table(
      [
          "GPUs",
          "samples/iter",
          "scheduler",
          "events",
          "wall s",
          "of which dispatch s",
          "events/s (loop)",
          "us/event (loop)",
      ],
      rows,
  )
  return rows


def main(argv):
  del argv
  out = harness.out_dir(os.path.join(harness.ROOT, "experiments", "out", "paper"))
  ref = paper.load_reference(_PAPER.value)
  iters, seed = (2 if harness.QUICK.value else _ITERS.value), _SEED.value
  rep = Report()
  t0 = time.time()
  cal = calibrate(ref, rep, iters, seed)
  cells, fig8_err = fig8(ref, cal, rep, iters, seed, out)
  t3_err, t3_note = table3(ref, cal, rep, iters, seed, out)
  f9_err, f9_note = fig9(ref, cal, rep, cells, seed, out)
  fig10(ref, cal, rep, iters, seed, out)
  fig11(ref, cal, rep, seed, out)
  f12_err = fig12(ref, cal, rep, iters, seed, out)
  fig2_check(ref, cal, rep, seed)
  scale = None
  if not (_SKIP_SCALE.value or harness.QUICK.value):
    scale = scale_benchmark(cal, rep)
  rep.h("Summary")
  rep.p(
      f"fig8_max_rel_err={fig8_err:.3f} (goal 0.15), table3_max_abs_err={t3_err:.3f} (goal 0.08), "
      f"fig9_max_abs_err={f9_err:.3f} (goal 0.08), fig12_max_rel_err={f12_err:.3f} (goal 0.15); "
      f"total {time.time() - t0:.0f} s"
  )
  notes = []
  if fig8_err > 0.15:
    notes.append(
        "Fig. 8: the largest errors are verl on 32B 10K/20K (the paper's verl/colocation ratios 0.69, "
        "1.00, 0.95 for 32B cannot all be met by one per-system parameter: see the consistency line "
        "under Fig. 8) and StreamRL-async on 32B 5K (the paper's async gain at 5K is 1.64 for 7B, "
        "1.26 for 32B, 1.78 for 72B: not monotone in model size, which one MFU and one decode model "
        "cannot follow)."
    )
  if t3_err > 0.08:
    notes.append(t3_note)
  if f9_err > 0.08:
    notes.append(f9_note)
  if f12_err > 0.15:
    notes.append("Fig. 12: above the goal.")
  if notes:
    rep.h("Unmet goals: why")
    for n in notes:
      rep.p(f"- {n}")
  rep.save(os.path.join(out, "report.md"))
  print(f"wrote {out}/report.md and plots")
  harness.report(
      out=out,
      summary={"iterations": iters, "seed": seed, "scale": scale},
      fig8_max_rel_err=f"{fig8_err:.4f}",
      table3_max_abs_err=f"{t3_err:.4f}",
      fig9_max_abs_err=f"{f9_err:.4f}",
      fig12_max_rel_err=f"{f12_err:.4f}",
  )


if __name__ == "__main__":
  app.run(main)
