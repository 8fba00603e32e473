r"""Pipeline timelines as pictures: one row per stage, busy bars by iteration.

  python experiments/diag/plot_timeline.py experiments/out/bench_modes/timeline_async.json [...]
  python experiments/diag/plot_timeline.py --summary=experiments/out/bench_modes

Reads what `Timeline.to_json` wrote (a list of {"stage", "start", "end",
"label"}, seconds from the run's start) and draws, like the StreamRL paper's
pipeline diagrams, one row per stage (trainer on top, then generator0, ...),
a bar for every busy interval coloured by its iteration (the trailing number
of its label: "gen 2", "train 2", "reward 2"), and white where the stage
idles: the bubbles. With --summary (the folder experiments/bench/bench_modes.py
wrote), it reads summary.json for each mode's last block, its untimed
iterations (shaded) and throughputs, and draws timeline_<mode>.png per mode
and timeline_all.png with every mode on one time scale.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence

from absl import app, flags
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

MODE_ORDER = ("colocated", "sync", "stream", "async")

_SUMMARY = flags.DEFINE_string(
    "summary", "", "A folder experiments/bench/bench_modes.py wrote (its summary.json)."
)


def load_intervals(path: str) -> list[dict]:
  with open(path) as f:
    return json.load(f)


def _iteration(label: str) -> int | None:
  m = re.search(r"(\d+)$", label or "")
  return int(m.group(1)) if m else None


def _stage_order(stages: Sequence[str]) -> list[str]:
  """trainer first, then generator0, generator1, ... (top to bottom)."""
  key = lambda s: (0, 0) if s == "trainer" else (1, int(re.sub(r"\D", "", s) or 0))
  return sorted(stages, key=key)


def _colour(it: int | None):
  cmap = plt.get_cmap("tab10")
  return (0.6, 0.6, 0.6) if it is None else cmap(it % 10)


def _shifted(intervals: list[dict], window: tuple[float, float] | None) -> list[dict]:
  """The intervals overlapping `window`, in seconds from its start."""
  if window is None:
    return intervals
  x0, x1 = window
  return [
      dict(iv, start=iv["start"] - x0, end=iv["end"] - x0)
      for iv in intervals
      if iv["end"] > x0 and iv["start"] < x1
  ]


def draw(
    ax,
    intervals: list[dict],
    *,
    title: str = "",
    xmax: float | None = None,
    untimed: Sequence[tuple[float, float]] = (),
) -> None:
  """Draws one pipeline timeline on `ax` (times in seconds, starting at 0)."""
  stages = _stage_order({iv["stage"] for iv in intervals})
  rows = {st: len(stages) - 1 - k for k, st in enumerate(stages)}  # trainer on top
  end = xmax or max((iv["end"] for iv in intervals), default=1.0)
  min_label_width = end / 40
  for iv in intervals:
    y = rows[iv["stage"]]
    it = _iteration(iv["label"])
    width = iv["end"] - iv["start"]
    # Per-sample trainer work (stream's "reward k") is short: draw it thinner.
    small = iv["label"].startswith("reward")
    h = 0.3 if small else 0.7
    ax.broken_barh(
        [(iv["start"], width)],
        (y - h / 2, h),
        facecolors=_colour(it),
        edgecolors="black" if not small else "none",
        linewidth=0.4,
    )
    if not small and width >= min_label_width and it is not None:
      kind = iv["label"].split()[0]
      ax.text(
          iv["start"] + width / 2,
          y,
          f"{kind} {it}" if width >= 2.5 * min_label_width else str(it),
          ha="center",
          va="center",
          fontsize=7,
          clip_on=True,
      )
  for s, e in untimed:
    ax.axvspan(s, e, color="0.9", zorder=-1)
  ax.set_yticks(list(rows.values()), list(rows.keys()))
  ax.set_ylim(-0.6, len(stages) - 0.4)
  ax.set_xlim(0, end)
  ax.set_title(title, fontsize=9, loc="left")
  ax.grid(axis="x", linestyle=":", linewidth=0.5)


def _legend(fig, its: Sequence[int], shaded: bool) -> None:
  handles = [
      Patch(facecolor=_colour(i), edgecolor="black", label=f"iteration {i}") for i in sorted(its)
  ]
  if shaded:
    handles.append(Patch(facecolor="0.9", label="untimed iteration"))
  fig.legend(
      handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=7, frameon=False
  )


def plot_file(
    path: str,
    out_png: str | None = None,
    title: str = "",
    window: tuple[float, float] | None = None,
    untimed: Sequence[tuple[float, float]] = (),
) -> str:
  """One PNG for one timeline JSON (only `window`, if given); returns its path."""
  intervals = _shifted(load_intervals(path), window)
  out_png = out_png or os.path.splitext(path)[0] + ".png"
  stages = {iv["stage"] for iv in intervals}
  fig, ax = plt.subplots(figsize=(12, 1.3 + 0.6 * len(stages)))
  xmax = window[1] - window[0] if window else None
  draw(ax, intervals, title=title or os.path.basename(path), xmax=xmax, untimed=untimed)
  ax.set_xlabel("seconds")
  _legend(
      fig,
      {i for i in (_iteration(iv["label"]) for iv in intervals) if i is not None},
      bool(untimed),
  )
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(out_png, dpi=130)
  plt.close(fig)
  return out_png


def _untimed_spans(info: dict) -> list[tuple[float, float]]:
  """Parts of the plotted window outside every timed iteration, from its start."""
  x0, x1 = info["plot_window"]
  timed = sorted((s, e) for _, s, e in info["timed_windows"] if e > x0 and s < x1)
  spans, cur = [], x0
  for s, e in timed:
    if s > cur:
      spans.append((cur - x0, s - x0))
    cur = max(cur, e)
  if cur < x1:
    spans.append((cur - x0, x1 - x0))
  return spans


def plot_summary(out_dir: str) -> list[str]:
  """timeline_<mode>.png (each mode's last block) for every mode in
  summary.json, and timeline_all.png with all of them on one time scale."""
  with open(os.path.join(out_dir, "summary.json")) as f:
    summary = json.load(f)
  modes = [m for m in MODE_ORDER if m in summary["modes"]]
  base = summary["throughput"].get("colocated")
  data, pngs = {}, []
  for m in modes:
    info = summary["modes"][m]
    window = tuple(info["plot_window"])
    untimed = _untimed_spans(info)
    ratio = f" = {summary['throughput'][m] / base:.2f} x colocated" if base else ""
    bub = ", ".join(f"{st} {v:.0%}" for st, v in sorted(info["bubbles"].items()))
    title = (
        f"{m}: {info['samples_per_s']:.1f} samples/s{ratio} (all timed iterations); "
        f"idle: {bub}; mean staleness {info['staleness_mean']:.1f}"
    )
    path = os.path.join(out_dir, f"timeline_{m}.json")
    data[m] = (_shifted(load_intervals(path), window), title, window, untimed)
    pngs.append(plot_file(path, os.path.join(out_dir, f"timeline_{m}.png"), title, window, untimed))
  if modes:
    xmax = max(w[1] - w[0] for _, _, w, _ in data.values())
    rows = sum(len({iv["stage"] for iv in ivs}) for ivs, _, _, _ in data.values())
    fig, axes = plt.subplots(
        len(modes),
        1,
        figsize=(13, 1.2 + 0.75 * rows + 0.5 * len(modes)),
        sharex=True,
        squeeze=False,
    )
    its = set()
    for ax, m in zip(axes[:, 0], modes):
      ivs, title, _, untimed = data[m]
      draw(ax, ivs, title=title, xmax=xmax, untimed=untimed)
      its |= {i for i in (_iteration(iv["label"]) for iv in ivs) if i is not None}
    axes[-1, 0].set_xlabel("seconds since the start of the mode's last block")
    _legend(fig, its, True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    out = os.path.join(out_dir, "timeline_all.png")
    fig.savefig(out, dpi=130)
    plt.close(fig)
    pngs.append(out)
  return pngs


def main(argv) -> None:
  paths = argv[1:]  # timeline JSON files (Timeline.to_json)
  if not paths and not _SUMMARY.value:
    raise app.UsageError("give timeline JSON paths or --summary=<folder of bench_modes.py>.")
  outs = [plot_file(p) for p in paths]
  if _SUMMARY.value:
    if not os.path.isfile(os.path.join(_SUMMARY.value, "summary.json")):
      raise app.UsageError(
          f"{_SUMMARY.value!r} has no summary.json; run experiments/bench/bench_modes.py first."
      )
    outs += plot_summary(_SUMMARY.value)
  for p in outs:
    print(p)


if __name__ == "__main__":
  app.run(main)
