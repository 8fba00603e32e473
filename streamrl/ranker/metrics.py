"""How well a ranker finds the long tail (paper, Table 4) and orders prompts."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import scipy.stats

TAIL_FRACTIONS = (0.2, 0.1, 0.05)


def recall_at_top(predicted: Sequence[float], true: Sequence[float], fraction: float) -> float:
  """Recall of the true longest `fraction` among the predicted longest `fraction`.

  k = max(1, round(fraction * n)). The predicted top-k are the k highest
  predictions; one of them is a hit when its true length is at least the
  k-th largest true length. Counting ties at the boundary as hits matters
  when lengths are small integers: otherwise which of several equally long
  prompts "is" in the true top-k would be arbitrary and even a perfect
  ranker would score below 1.

  Args:
    predicted: [n] predicted lengths or scores.
    true: [n] observed output lengths.
  Returns:
    Hits / k in [0, 1].
  """
  pred = np.asarray(predicted, dtype=np.float64).reshape(-1)
  true = np.asarray(true, dtype=np.float64).reshape(-1)
  if pred.shape != true.shape or pred.size == 0:
    raise ValueError(
        f"need equally many predictions and lengths (> 0), got {pred.size} and {true.size}."
    )
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}.")
  k = max(1, int(round(fraction * pred.size)))
  threshold = np.sort(true)[::-1][k - 1]
  top_pred = np.argsort(-pred, kind="stable")[:k]
  return float(np.mean(true[top_pred] >= threshold))


def spearman(predicted: Sequence[float], true: Sequence[float]) -> float:
  """Spearman rank correlation (ties get average ranks); NaN if either side is constant."""
  pred = np.asarray(predicted, dtype=np.float64).reshape(-1)
  true = np.asarray(true, dtype=np.float64).reshape(-1)
  if pred.size < 2 or np.all(pred == pred[0]) or np.all(true == true[0]):
    return math.nan
  return float(scipy.stats.spearmanr(pred, true).statistic)


def ranking_metrics(predicted: Sequence[float], true: Sequence[float]) -> dict[str, float]:
  """{"recall20", "recall10", "recall5", "spearman"} for one held-out set."""
  out = {f"recall{int(round(f * 100))}": recall_at_top(predicted, true, f) for f in TAIL_FRACTIONS}
  out["spearman"] = spearman(predicted, true)
  return out
