"""The paper's Fig. 8, Table 3 and Fig. 9 as sections of reproduce_paper.py's report.

Each function simulates its cells (experiments/sim/paper_figures.py), adds a
markdown section to the `Report` and a PNG under `out`, and returns its error
against the paper's numbers (experiments/reference/streamrl_paper.json).
"""

import dataclasses
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments.sim import paper_figures as paper  # noqa: E402
from streamrl.sim import hardware  # noqa: E402
from streamrl.sim.lengths import paper_lengths  # noqa: E402
from streamrl.sim.systems import gen_cost  # noqa: E402

SYSTEM_LABEL = {
    "verl": "verl",
    "colocation": "colocation",
    "streamrl_sync": "StreamRL-sync",
    "streamrl_async": "StreamRL-async",
}


class Report:
  """Collects markdown sections."""

  def __init__(self):
    self.lines = ["# StreamRL paper reproduction (simulated)", ""]

  def h(self, title):
    self.lines += ["", f"## {title}", ""]
    print(f"\n== {title}")

  def p(self, text):
    self.lines.append(text)
    print(text)

  def table(self, header, rows):
    self.lines.append("| " + " | ".join(header) + " |")
    self.lines.append("|" + "---|" * len(header))
    for r in rows:
      self.lines.append("| " + " | ".join(str(x) for x in r) + " |")
    print("  " + " | ".join(header))
    for r in rows:
      print("  " + " | ".join(str(x) for x in r))

  def save(self, path):
    with open(path, "w") as f:
      f.write("\n".join(self.lines) + "\n")


def fig8(ref, cal, rep, iters, seed, out):
  rep.h("Fig. 8: throughput, 9 cells x 4 systems (ratios to colocation)")
  cells = {}
  rows = []
  errs_fit, errs_held = [], []
  cols = ref["fig8_throughput_samples_per_s"]["_columns"]
  for m in paper.MODEL_GPUS:
    for length in paper.LENGTHS:
      c = paper.run_cell(m, length, cal, iterations=iters, seed=seed)
      cells[(m, length)] = c
      pv = dict(zip(cols, ref["fig8_throughput_samples_per_s"][m][length]))
      e = paper.fig8_errors(c, ref)
      (errs_fit if m == "qwen2.5-7b" else errs_held).extend(e.values())
      r = c.ratios()
      rows.append(
          [m, length, f"{c.gen_gpus}/{paper.MODEL_GPUS[m] - c.gen_gpus}"]
          + [f"{r[s]:.2f} / {pv[s] / pv['colocation']:.2f}" for s in cols]
          + [
              f"{c.samples_per_s['streamrl_async']:.2f} / {pv['streamrl_async']:.2f}",
              f"{max(e.values()):.3f}",
          ]
      )
  rep.table(
      [
          "model",
          "len",
          "gen/train",
          *[f"{SYSTEM_LABEL[s]} sim/paper" for s in cols],
          "async samples/s sim/paper",
          "max rel err",
      ],
      rows,
  )
  fit_err, held_err = max(errs_fit), max(errs_held)
  rep.p(f"\nmax relative error: 7B (fitted) {fit_err:.3f}; 32B+72B (held out) {held_err:.3f}")
  for s in cols:
    if s == "colocation":
      continue
    e = [paper.fig8_errors(c, ref)[s] for c in cells.values()]
    rep.p(f"  {SYSTEM_LABEL[s]}: max {max(e):.3f}, mean {np.mean(e):.3f}")
  # verl's one parameter (host time per decode step) moves its ratio to
  # colocation almost uniformly across lengths; where the paper's own ratios
  # for one model spread more than that allows, say so with the numbers.
  for m in paper.MODEL_GPUS:
    pr = [
        ref["fig8_throughput_samples_per_s"][m][l][0]
        / ref["fig8_throughput_samples_per_s"][m][l][1]
        for l in paper.LENGTHS
    ]
    sr = [cells[(m, l)].ratios()["verl"] for l in paper.LENGTHS]
    # Best max relative error any length-independent ratio r could reach: r = 2ab/(a+b).
    lo, hi = min(pr), max(pr)
    best = (hi - lo) / (hi + lo)
    rep.p(
        f"  verl/colocation {m}: paper {', '.join(f'{x:.2f}' for x in pr)}; sim "
        f"{', '.join(f'{x:.2f}' for x in sr)}; a length-independent ratio can reach at best "
        f"{best:.3f} max rel err on this model"
    )
  # Plot.
  fig, axes = plt.subplots(3, 3, figsize=(13, 10))
  for ax, ((m, length), c) in zip(axes.flat, cells.items()):
    pv = dict(zip(cols, ref["fig8_throughput_samples_per_s"][m][length]))
    r = c.ratios()
    x = np.arange(len(cols))
    ax.bar(x - 0.2, [r[s] for s in cols], 0.4, label="simulated")
    ax.bar(x + 0.2, [pv[s] / pv["colocation"] for s in cols], 0.4, label="paper")
    ax.set_xticks(x, [SYSTEM_LABEL[s] for s in cols], fontsize=7)
    ax.set_title(f"{m} {length}" + (" (fit)" if m == "qwen2.5-7b" else " (held out)"), fontsize=9)
    ax.set_ylabel("throughput / colocation")
  axes[0, 0].legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "fig8_throughput.png"), dpi=110)
  plt.close(fig)
  return cells, max(errs_fit + errs_held)


def table3(ref, cal, rep, iters, seed, out):
  rep.h("Table 3: ablation, 72B 20K (normalised to colocation)")
  c = paper.run_cell(
      "qwen2.5-72b",
      "20K",
      cal,
      iterations=iters,
      seed=seed,
      systems=("colocation", "colocation_skew", "streamrl_sync", "streamrl_async"),
  )
  r = c.ratios()
  pt = ref["table3_ablation_72b_20k_normalized_throughput"]
  pairs = [
      ("colocation", "colocation"),
      ("colocation_skew", "+skewness_aware_scheduling"),
      ("streamrl_sync", "+disaggregation_and_streaming"),
      ("streamrl_async", "+asynchronous"),
  ]
  rows, errs = [], []
  for s, k in pairs:
    errs.append(abs(r[s] - pt[k]))
    rows.append([k, f"{r[s]:.3f}", f"{pt[k]:.2f}", f"{errs[-1]:.3f}"])
  rep.table(["row", "simulated", "paper", "abs err"], rows)
  co, asy = c.results["colocation"].iterations[-1], c.results["streamrl_async"].iterations[-1]
  switch = c.results["colocation"].config.transfer_s
  rep.p(
      f"\ncolocation iteration: generation {co.gen_time:.0f} s (128 GPUs) + training {co.train_busy:.0f} s + "
      f"switch {switch:.0f} s; StreamRL-async: generation {asy.gen_time:.0f} s ({c.gen_gpus} GPUs), training "
      f"{asy.train_busy:.0f} s ({paper.MODEL_GPUS['qwen2.5-72b'] - c.gen_gpus} GPUs). Generation is bound by "
      "the longest samples on either GPU count, so async / colocation is about (T_gen + T_train(128) + switch) "
      f"/ T_gen = {(co.gen_time + co.train_busy + switch) / asy.gen_time:.2f}; the paper's "
      f"{pt['+asynchronous']} needs training + switch of {(pt['+asynchronous'] - 1):.2f} x T_gen on 128 GPUs "
      f"(simulated {(co.train_busy + switch) / asy.gen_time:.2f} x, with the MFU fitted on 7B)."
  )
  # Where the ratio gap sits: iteration seconds, simulated vs the paper's Fig. 8 cell (1024 / samples/s).
  f8 = dict(
      zip(
          ref["fig8_throughput_samples_per_s"]["_columns"],
          ref["fig8_throughput_samples_per_s"]["qwen2.5-72b"]["20K"],
      )
  )
  bs = c.results["colocation"].config.samples_per_iteration
  rows3 = [
      [
          SYSTEM_LABEL[s],
          f"{bs / c.samples_per_s[s]:.0f} s",
          f"{bs / f8[s]:.0f} s",
          f"{(bs / c.samples_per_s[s]) / (bs / f8[s]):.2f}",
      ]
      for s in ("colocation", "streamrl_sync", "streamrl_async")
  ]
  rep.p("")
  rep.table(
      ["system", "sim iteration", "paper iteration (1024 / Fig. 8 samples/s)", "sim / paper"], rows3
  )
  # The paper's own split for this model (Fig. 10), instead of the planner's.
  split = ref["fig10_allocation"]["qwen2.5-72b_128gpus"]["chosen_gen_train"][0]
  cp = paper.run_cell(
      "qwen2.5-72b",
      "20K",
      cal,
      iterations=iters,
      seed=seed,
      gen_gpus=split,
      systems=("colocation", "streamrl_sync", "streamrl_async"),
  )
  rp = cp.ratios()
  ap = cp.results["streamrl_async"].iterations[-1]
  rep.p(
      f"\nwith the paper's Fig. 10 split ({split}/{paper.MODEL_GPUS['qwen2.5-72b'] - split}) instead of the "
      f"planner's ({c.gen_gpus}/{paper.MODEL_GPUS['qwen2.5-72b'] - c.gen_gpus}): +disaggregation_and_streaming "
      f"{rp['streamrl_sync']:.3f}, +asynchronous {rp['streamrl_async']:.3f} (generation {ap.gen_time:.0f} s, "
      f"training {ap.train_busy:.0f} s): training on {paper.MODEL_GPUS['qwen2.5-72b'] - split} GPUs becomes "
      "the bottleneck, so the planner's split is the better one under the simulated costs."
  )
  fig, ax = plt.subplots(figsize=(6, 3.5))
  x = np.arange(len(pairs))
  ax.bar(x - 0.2, [r[s] for s, _ in pairs], 0.4, label="simulated")
  ax.bar(x + 0.2, [pt[k] for _, k in pairs], 0.4, label="paper")
  ax.set_xticks(x, [k.replace("_", " ") for _, k in pairs], fontsize=7)
  ax.legend()
  fig.tight_layout()
  fig.savefig(os.path.join(out, "table3_ablation.png"), dpi=110)
  plt.close(fig)
  # Training on 128 GPUs implied by the paper's split if its async iteration is balanced (linear in GPUs).
  n72 = paper.MODEL_GPUS["qwen2.5-72b"]
  tr_paper = (bs / f8["streamrl_async"]) * (n72 - split) / n72
  note = (
      "Table 3: in absolute iteration time the disaggregated rows match the paper's Fig. 8 cell (sim / paper "
      f"{rows3[1][3]} for StreamRL-sync, {rows3[2][3]} for StreamRL-async) but the colocation row is "
      f"{rows3[0][3]} of the paper's: the ratio gap is in the colocated baseline. It is not the trainer: if "
      f"the paper's {split}/{paper.MODEL_GPUS['qwen2.5-72b'] - split} split is balanced at its async iteration, "
      f"its training on 128 GPUs takes about {tr_paper:.0f} s (simulated {co.train_busy:.0f} s). It is "
      "generation under FIFO: the paper's colocated generation + switch would be about "
      f"{bs / f8['colocation'] - tr_paper:.0f} s, simulated {co.gen_time + switch:.0f} s, which is the same "
      "shortfall as Fig. 9 (simulated skew-aware scheduling gains less over FIFO than the paper's). The "
      f"paper's own split does not help ({rp['streamrl_async']:.2f}: training on "
      f"{paper.MODEL_GPUS['qwen2.5-72b'] - split} GPUs becomes the bottleneck)."
  )
  return max(errs), note


def fig9(ref, cal, rep, cells, seed, out):
  rep.h("Fig. 9: generation latency normalised to random FIFO (20K, StreamRL's generation GPUs)")
  p9 = ref["fig9_generation_latency_normalized_to_random_fifo"]
  rows, errs, sims, phys = [], [], {}, []
  for m in paper.MODEL_GPUS:
    x = cells[(m, "20K")].gen_gpus
    lat = paper.fig9_latencies(m, cal, x, seed=seed, best_split=True)
    alt = paper.fig9_latencies(m, dataclasses.replace(cal, dispatch_objective="sum"), x, seed=seed)
    other = paper.fig9_latencies(
        m, dataclasses.replace(cal, reserve_max_output=not cal.reserve_max_output), x, seed=seed
    )
    norm = {k: v / lat["fifo"] for k, v in lat.items()}
    sims[m] = norm
    for k in ("streamrl", "oracle"):
      errs.append(abs(norm[k] - p9[m][k]))
    gen = gen_cost(hardware.MODELS[m], hardware.GPUS["H800"], cal, paper_lengths(20480))
    kv_ms = gen.per_ctx_token_s * 15000 * 1e3
    phys.append(
        f"{m}: one sequence at 15K context adds {kv_ms:.2f} ms of KV read per decode step "
        f"(batch-1 step {gen.step_time(1, 15000) * 1e3:.1f} ms; Fig. 7-like per-sequence slope at 1K "
        f"context {(gen.per_seq_s + gen.per_ctx_token_s * 1024) * 1e3:.3f} ms)"
    )
    rows.append(
        [
            m,
            x,
            f"{norm['streamrl']:.3f} / {p9[m]['streamrl']:.2f}",
            f"{norm['oracle']:.3f} / {p9[m]['oracle']:.2f}",
            f"{norm['best_split']:.3f}",
            f"{norm['floor']:.3f}",
            f"{alt['streamrl'] / alt['fifo']:.3f}",
            f"{other['streamrl'] / other['fifo']:.3f} / {other['oracle'] / other['fifo']:.3f} / "
            f"{other['floor'] / other['fifo']:.3f}",
            f"{lat['fifo']:.0f} s",
        ]
    )
  other_name = (
      "vLLM admission (no reservation)" if cal.reserve_max_output else "max-output reservation"
  )
  rep.table(
      [
          "model",
          "gen GPUs",
          "ranker sim/paper",
          "oracle sim/paper",
          "oracle, best split in hindsight",
          "floor (longest alone) / FIFO",
          "ranker, 'sum' objective",
          f"{other_name}: ranker / oracle / floor",
          "FIFO latency",
      ],
      rows,
  )
  rep.p(
      "\nfloor = the longest sample decoded alone at batch 1, over FIFO: no schedule can go below it. "
      "Where the paper's oracle is below the simulated floor, no dispatcher can reach the paper's number "
      "under this decode model; the remaining gap is then in the FIFO baseline, not in the scheduler."
  )
  rep.p(
      "\nbest split in hindsight = Algorithm 2 exactly as dispatched (true top 20 % on N_l instances, LPT "
      "balancing, wave-optimal caps) with every N_l simulated and the fastest kept per draw: a lower bound on "
      "the oracle column, i.e. the most any choice of split (any latency model or objective) can give. "
      "It stays above the paper's oracle for every model, so the gap is not in how the split is chosen but in "
      "what a long-tail instance costs: tens of 10-20K-token sequences share each long-tail instance "
      "(about 10 % of outputs lie in the 12K-20K tail), and each reads its whole KV cache every step:"
  )
  for line in phys:
    rep.p(f"  {line}")
  fig, ax = plt.subplots(figsize=(7, 3.5))
  x = np.arange(3)
  ms = list(paper.MODEL_GPUS)
  for i, (k, lab) in enumerate([("streamrl", "ranker"), ("oracle", "oracle")]):
    ax.bar(x + (i - 0.5) * 0.4 - 0.1, [sims[m][k] for m in ms], 0.2, label=f"sim {lab}")
    ax.bar(x + (i - 0.5) * 0.4 + 0.1, [p9[m][k] for m in ms], 0.2, label=f"paper {lab}", alpha=0.6)
  ax.axhline(1.0, color="k", lw=0.5)
  ax.set_xticks(x, ms)
  ax.set_ylabel("latency / random FIFO")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "fig9_skewness.png"), dpi=110)
  plt.close(fig)
  gap = " / ".join(f"{sims[m]['best_split'] - p9[m]['oracle']:+.2f}" for m in ms)
  note = (
      "Fig. 9: the ranker column is within "
      f"{max(abs(sims[m]['streamrl'] - p9[m]['streamrl']) for m in ms):.2f} of the paper; the oracle column "
      "is not, and cannot be under this decode model: even the best long/regular split in hindsight "
      f"(Algorithm 2 with true lengths, every N_l simulated) differs from the paper's oracle by {gap} "
      "(7B / 32B / 72B). The limit is physical: about 10 % of outputs are 12-20K tokens, so every long-tail "
      "instance holds tens of long sequences, each reading its KV cache (0.2-0.4 ms per step at 15K "
      "context, 4-7x Fig. 7's per-sequence slope) every step; the longest sample therefore decodes well "
      "above PTL(1). The paper's oracle being so close to the floor suggests its long-tail instances "
      "decode near PTL(1), which these KV reads do not allow with bf16 KV at this tail weight. "
      "Algorithm 2's text minimises the sum of the two group latencies; the project dispatcher's "
      "'makespan' objective is used (the 'sum' column shows the paper's objective is not closer)."
  )
  return max(errs), note
