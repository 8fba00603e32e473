"""KL estimators against numpy loops and Monte Carlo."""

import math

import jax
import numpy as np
import pytest

from streamrl.rl import kl as K

pytestmark = [pytest.mark.unit]


def ref_estimators(logp, ref):
  k1 = np.zeros(logp.shape)
  k2 = np.zeros(logp.shape)
  k3 = np.zeros(logp.shape)
  for idx in np.ndindex(logp.shape):
    d = float(ref[idx]) - float(logp[idx])  # log r, r = p_ref / q
    k1[idx] = -d
    k2[idx] = 0.5 * d * d
    k3[idx] = math.exp(d) - 1.0 - d
  return k1, k2, k3


def test_estimators_match_numpy_and_signs():
  rng = np.random.default_rng(0)
  logp = -np.abs(rng.normal(size=(4, 6))).astype(np.float32)
  ref = -np.abs(rng.normal(size=(4, 6))).astype(np.float32)
  r1, r2, r3 = ref_estimators(logp, ref)
  k1, k2, k3 = jax.jit(lambda a, b: (K.kl_k1(a, b), K.kl_k2(a, b), K.kl_k3(a, b)))(logp, ref)
  np.testing.assert_allclose(k1, r1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(k2, r2, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(k3, r3, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(k2) >= 0) and np.all(np.asarray(k3) >= 0)
  assert np.any(np.asarray(k1) < 0)  # k1 is unbiased but not pointwise >= 0
  # Equal distributions: all three are exactly zero.
  for fn in (K.kl_k1, K.kl_k2, K.kl_k3):
    np.testing.assert_array_equal(jax.jit(fn)(logp, logp), 0.0)


def test_k3_accurate_for_tiny_log_ratios():
  d = np.array([1e-4, -1e-4, 3e-3], np.float32)
  out = np.asarray(jax.jit(K.kl_k3)(np.zeros_like(d), d))
  # exp(d) - 1 - d = d^2/2 + d^3/6 + ...
  expected = d.astype(np.float64) ** 2 / 2 + d.astype(np.float64) ** 3 / 6
  # float32 expm1 keeps ~1e-3 relative accuracy here; the naive
  # exp(d) - 1 - d would be off by ~1e-8 absolute, i.e. > 100% of the value.
  np.testing.assert_allclose(out, expected, rtol=1e-2)
  assert np.all(out > 0)


def test_k1_k3_unbiased_k2_biased_monte_carlo():
  # Tokens sampled from q; the sample means of k1 and k3 estimate KL(q || p).
  q = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
  p = np.array([0.3, 0.3, 0.2, 0.1, 0.1])
  true_kl = float(np.sum(q * np.log(q / p)))
  rng = np.random.default_rng(1)
  x = rng.choice(len(q), size=200_000, p=q)
  logp = np.log(q)[x].astype(np.float32)
  ref = np.log(p)[x].astype(np.float32)
  for fn in (K.kl_k1, K.kl_k3):
    samples = np.asarray(jax.jit(fn)(logp, ref), np.float64)
    stderr = samples.std() / math.sqrt(samples.size)
    assert abs(samples.mean() - true_kl) < 5 * stderr, fn.__name__
  k2 = np.asarray(jax.jit(K.kl_k2)(logp, ref), np.float64)
  assert abs(k2.mean() - true_kl) > 10 * k2.std() / math.sqrt(k2.size)
  # k3 has lower variance than k1 here (q and p are close).
  k1 = np.asarray(jax.jit(K.kl_k1)(logp, ref))
  k3 = np.asarray(jax.jit(K.kl_k3)(logp, ref))
  assert k3.std() < k1.std()


def test_get_kl_estimator():
  assert K.get_kl_estimator("k3") is K.kl_k3
  with pytest.raises(ValueError, match=r"'low_var'.*\['k1', 'k2', 'k3'\]"):
    K.get_kl_estimator("low_var")


def test_jit_gives_same_results():
  rng = np.random.default_rng(2)
  logp = rng.normal(size=(3, 4)).astype(np.float32)
  ref = rng.normal(size=(3, 4)).astype(np.float32)
  for fn in (K.kl_k1, K.kl_k2, K.kl_k3):
    np.testing.assert_allclose(fn(logp, ref), jax.jit(fn)(logp, ref), rtol=1e-6)
