"""A noisy output-length ranker for simulation.

The real ranker predicts which prompts will produce long outputs; only its
ordering matters to the dispatcher. We model its score as

    score_i = log(true_length_i) + sigma * eps_i,   eps_i ~ N(0, 1)

and set sigma so that the recall of the true top-alpha tail inside the
predicted top-alpha tail matches a measured recall (the paper's Table 4,
or our own ranker's). sigma = 0 is the oracle.
"""

from __future__ import annotations

import numpy as np

from streamrl.sim.lengths import LengthDistribution


def noisy_scores(output_lens: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
  """[n] ranking scores (higher = predicted longer); exp(score) is a length prediction."""
  out = np.asarray(output_lens, dtype=np.float64)
  if sigma < 0:
    raise ValueError(f"ranker noise sigma must be >= 0, got {sigma}.")
  noise = rng.standard_normal(out.shape) if sigma > 0 else 0.0
  return np.log(out) + sigma * noise


def tail_recall(true_lens: np.ndarray, scores: np.ndarray, frac: float) -> float:
  """|true top-frac ∩ predicted top-frac| / |true top-frac| (ties broken by index)."""
  n = len(true_lens)
  k = max(1, int(round(frac * n)))
  true_top = set(np.argsort(-np.asarray(true_lens), kind="stable")[:k].tolist())
  pred_top = set(np.argsort(-np.asarray(scores), kind="stable")[:k].tolist())
  return len(true_top & pred_top) / k


def sigma_for_recall(
    target_recall: float,
    lengths: LengthDistribution,
    *,
    frac: float = 0.2,
    n: int = 20000,
    seed: int = 0,
) -> float:
  """Noise level whose tail recall equals `target_recall` (bisection, common random numbers)."""
  if not 0 < target_recall <= 1:
    raise ValueError(f"target recall must be in (0, 1], got {target_recall}.")
  rng = np.random.default_rng(seed)
  _, out = lengths.sample(rng, n)
  eps = rng.standard_normal(n)
  logl = np.log(out.astype(np.float64))

  def recall(s: float) -> float:
    return tail_recall(out, logl + s * eps, frac)

  if recall(0.0) <= target_recall:
    return 0.0
  lo, hi = 0.0, 1.0
  while recall(hi) > target_recall:
    hi *= 2
    if hi > 64:
      return hi
  for _ in range(40):
    mid = 0.5 * (lo + hi)
    if recall(mid) > target_recall:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)
