import math

import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.ranker.losses import log_mse_loss, pairwise_logistic_loss, ranker_loss
from streamrl.ranker.metrics import ranking_metrics, recall_at_top, spearman

pytestmark = [pytest.mark.unit]


def test_recall_perfect_reversed_and_ties():
  true = np.arange(100)
  assert recall_at_top(true, true, 0.2) == 1.0
  assert recall_at_top(-true, true, 0.2) == 0.0
  # Ties at the boundary: lengths 5,5,5,1,1 with k=2 — any two of the 5s are right.
  assert recall_at_top([0.1, 0.9, 0.5, 0.0, 0.0], [5, 5, 5, 1, 1], 0.4) == 1.0
  assert recall_at_top([0.0, 0.0, 0.5, 0.9, 0.0], [5, 5, 5, 1, 1], 0.4) == 0.5


def test_random_ranker_recall_is_about_the_fraction():
  rng = np.random.default_rng(0)
  true = rng.lognormal(3, 1, size=20000)
  m = ranking_metrics(rng.random(true.size), true)
  assert m["recall20"] == pytest.approx(0.2, abs=0.02)
  assert m["recall5"] == pytest.approx(0.05, abs=0.02)
  assert abs(m["spearman"]) < 0.03


def test_spearman_matches_definition_and_constant_is_nan():
  x = np.array([1.0, 2.0, 3.0, 4.0])
  assert spearman(x, x**3) == pytest.approx(1.0)
  assert spearman(x, -x) == pytest.approx(-1.0)
  assert math.isnan(spearman(x, np.ones(4)))
  with pytest.raises(ValueError):
    recall_at_top([1.0], [1.0, 2.0], 0.2)


def _np_pairwise(s, n):
  num, den = 0.0, 0
  for i in range(len(s)):
    for j in range(len(s)):
      if n[i] > n[j]:
        num += math.log1p(math.exp(-(s[i] - s[j])))
        den += 1
  return num / max(den, 1)


def test_losses_match_numpy():
  rng = np.random.default_rng(1)
  s = rng.normal(size=7).astype(np.float32)
  n = rng.integers(1, 50, size=7).astype(np.float32)
  n[3] = n[4]  # A tie, which the pairwise loss must skip.
  w = np.ones(7, np.float32)
  assert float(log_mse_loss(s, n, w)) == pytest.approx(np.mean((s - np.log1p(n)) ** 2), rel=1e-5)
  assert float(pairwise_logistic_loss(s, n, w)) == pytest.approx(_np_pairwise(s, n), rel=1e-5)
  # Zero-weight rows (padding) are ignored.
  w2 = w.copy()
  w2[5:] = 0
  assert float(pairwise_logistic_loss(s, n, w2)) == pytest.approx(
      _np_pairwise(s[:5], n[:5]), rel=1e-5
  )
  both, terms = ranker_loss(jnp.asarray(s), jnp.asarray(n), jnp.asarray(w), "both", 0.5)
  assert float(both) == pytest.approx(
      float(terms["mse"]) + 0.5 * float(terms["pairwise"]), rel=1e-6
  )
  with pytest.raises(ValueError, match="config.loss"):
    ranker_loss(s, n, w, "hinge")
