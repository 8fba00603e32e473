"""Summaries: percentiles of a distribution, a finished run's final metrics, a sweep's table."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from streamrl.metrics.writer import scalar


def percentiles(values: Sequence[float] | np.ndarray, prefix: str = "") -> dict[str, float]:
  """{prefix+"mean", "p50", "p90", "max"} of `values` (e.g. response lengths, [N]).

  Percentiles interpolate linearly (numpy's default). An empty input gives NaN
  for every key rather than an error: an iteration with no finished samples
  should still log.
  """
  arr = np.asarray(values, dtype=np.float64).reshape(-1)
  if arr.size == 0:
    return {f"{prefix}{k}": float("nan") for k in ("mean", "p50", "p90", "max")}
  p50, p90 = np.percentile(arr, [50, 90])
  return {
      f"{prefix}mean": float(arr.mean()),
      f"{prefix}p50": float(p50),
      f"{prefix}p90": float(p90),
      f"{prefix}max": float(arr.max()),
  }


FINAL_METRICS_NAME = "final_metrics.json"  # Written into the run directory by streamrl.train.run.
SUMMARY_METRICS = ("eval/accuracy", "eval/accuracy_greedy", "reward/mean")


def read_final_metrics(run_dir: str) -> dict[str, float] | None:
  """The `final_metrics.json` of a finished run, or None if it is missing or unreadable."""
  try:
    with open(os.path.join(run_dir, FINAL_METRICS_NAME), encoding="utf-8") as f:
      values = json.load(f)
  except (OSError, ValueError):
    return None
  return values if isinstance(values, dict) else None


def _metric(values: Mapping[str, Any] | None, key: str) -> float | None:
  """values[key] as a finite float, else None (missing, null, NaN or not a number)."""
  if not values or key not in values:
    return None
  try:
    x = scalar(key, values[key])
  except (TypeError, ValueError):
    return None
  return x if math.isfinite(x) else None


def results_table(
    runs: Sequence[tuple[str, Mapping[str, Any] | None]],
    columns: Sequence[str] = SUMMARY_METRICS,
    sort_by: str | None = None,
) -> str:
  """A plain-text table of runs and their final metrics, best first.

    rank  run                       eval/accuracy  eval/accuracy_greedy  reward/mean
       1  optimizer.lr=3e-06                 0.5312                0.5625       0.4410
       2  optimizer.lr=1e-06                 0.4219                     -       0.3902
       -  optimizer.lr=1e-05 (failed)             -                     -            -

  Args:
    runs: (run name, final metrics) pairs; metrics None for a run that left
      none (it failed, or was never run).
    columns: the metric keys to show, in order.
    sort_by: the key ranking the runs, higher is better; default the first
      column. Runs without a finite value for it come last, unranked, in
      their given order; ties keep the given order.

  Returns:
    The table, lines joined by newlines (no trailing newline).
  """
  columns = list(columns)
  key = sort_by or (columns[0] if columns else None)
  indexed = list(enumerate(runs))
  ranked = [(i, r) for i, r in indexed if key is not None and _metric(r[1], key) is not None]
  unranked = [(i, r) for i, r in indexed if key is None or _metric(r[1], key) is None]
  ranked.sort(key=lambda ir: (-_metric(ir[1][1], key), ir[0]))
  header = ["rank", "run", *columns]
  body = []
  for pos, (_, (name, values)) in enumerate(ranked + unranked, start=1):
    cells = [str(pos) if pos <= len(ranked) else "-", str(name)]
    for col in columns:
      x = _metric(values, col)
      cells.append("-" if x is None else f"{x:.4f}")
    body.append(cells)
  widths = [max(len(row[j]) for row in [header, *body]) for j in range(len(header))]

  def fmt(row):  # Names left-aligned, numbers right-aligned.
    return "  ".join(
        c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
    ).rstrip()

  return "\n".join(fmt(row) for row in [header, *body])
