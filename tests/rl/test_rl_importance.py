"""Truncated importance weights against numpy loops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.rl import importance as I
from streamrl.rl import losses as L


def ragged_mask(rng, b, t):
  lengths = rng.integers(0, t + 1, size=b)
  lengths[0], lengths[1] = 0, t
  mask = np.zeros((b, t), np.float32)
  for i in range(b):
    mask[i, :lengths[i]] = 1.0
  return mask


def ref_weights(trainer, generator, mask, cap, level):
  b, t = mask.shape
  w = np.zeros((b, t))
  for i in range(b):
    if level == "sequence":
      s = sum(float(trainer[i, j]) - float(generator[i, j]) for j in range(t)
              if mask[i, j])
      seq_w = min(math.exp(s), cap)
    for j in range(t):
      if mask[i, j]:
        w[i, j] = (seq_w if level == "sequence" else
                   min(math.exp(float(trainer[i, j]) - float(generator[i, j])),
                       cap))
  return w


def mismatched_logps(seed, b=6, t=8, scale=0.5):
  """Trainer logprobs vs a 'generator' copy rounded to bf16 plus drift."""
  rng = np.random.default_rng(seed)
  mask = ragged_mask(rng, b, t)
  trainer = -np.abs(rng.normal(size=(b, t))).astype(np.float32)
  generator = np.asarray(jnp.asarray(trainer, jnp.bfloat16), np.float32)
  generator = (generator + scale * rng.normal(size=(b, t))).astype(np.float32)
  return trainer, generator, mask


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("cap", [1.5, 5.0])
def test_weights_match_numpy(level, cap):
  trainer, generator, mask = mismatched_logps(0)
  fn = jax.jit(functools.partial(I.truncated_is_weights, level=level))
  w = np.asarray(fn(trainer, generator, mask, cap))
  np.testing.assert_allclose(w, ref_weights(trainer, generator, mask, cap,
                                            level), rtol=1e-5, atol=1e-6)
  assert np.all(w[mask == 0] == 0.0)
  assert np.all(w <= cap + 1e-6)
  if level == "token" and cap == 1.5:  # the cap binds for some tokens only
    assert 0 < np.mean(np.isclose(w[mask > 0], cap, rtol=1e-6)) < 1


def test_identical_logprobs_give_unit_weights():
  trainer, _, mask = mismatched_logps(1)
  for level in ("token", "sequence"):
    w = I.truncated_is_weights(trainer, trainer, mask, level=level)
    np.testing.assert_array_equal(w, mask)


def test_bf16_generator_input_is_accepted():
  trainer, generator, mask = mismatched_logps(2, scale=0.0)
  w = jax.jit(I.truncated_is_weights)(trainer,
                                      jnp.asarray(generator, jnp.bfloat16),
                                      mask)
  assert w.dtype == jnp.float32
  # Only bf16 rounding differs: weights are close to, but not all, exactly 1.
  valid = np.asarray(w)[mask > 0]
  np.testing.assert_allclose(valid, 1.0, atol=1e-2)


def test_extreme_and_padding_values_stay_finite():
  trainer = np.array([[0.0, -1.0, 0.0, 0.0]], np.float32)
  generator = np.array([[-500.0, -1.0, -np.inf, np.inf]], np.float32)
  mask = np.array([[1, 1, 0, 0]], np.float32)
  for level in ("token", "sequence"):
    w = np.asarray(I.truncated_is_weights(trainer, generator, mask, 2.0,
                                          level))
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(w, [[2.0, 1.0 if level == "token" else 2.0,
                                    0.0, 0.0]])


def test_weights_carry_no_gradient():
  trainer, generator, mask = mismatched_logps(3)
  for level in ("token", "sequence"):
    grad = jax.jit(jax.grad(lambda tr: I.truncated_is_weights(
        tr, generator, mask, 5.0, level).sum()))(trainer)
    np.testing.assert_array_equal(grad, 0.0)


def test_weights_scale_policy_loss_per_token():
  # With is_weights_bt, the token loss is w times the unweighted token loss.
  trainer, generator, mask = mismatched_logps(4)
  rng = np.random.default_rng(4)
  logp = (trainer + 0.1 * rng.normal(size=trainer.shape)).astype(np.float32)
  adv = rng.normal(size=trainer.shape).astype(np.float32)
  w = I.truncated_is_weights(trainer, generator, mask)
  loss_fn = jax.jit(functools.partial(L.ppo_policy_loss, agg="token_sum_norm",
                                      norm_constant=1.0))
  weighted, _ = loss_fn(logp, trainer, adv, mask, is_weights_bt=w)
  ones, _ = loss_fn(logp, trainer, adv, mask, is_weights_bt=mask)
  plain, _ = loss_fn(logp, trainer, adv, mask)
  assert float(ones) == pytest.approx(float(plain), rel=1e-6)
  assert float(weighted) != pytest.approx(float(plain), rel=1e-3)


def test_staleness_helpers():
  trainer, generator, mask = mismatched_logps(5)
  np.testing.assert_array_equal(
      I.staleness_is_weights(trainer, generator, mask, 3.0, "sequence"),
      I.truncated_is_weights(trainer, generator, mask, 3.0, "sequence"))
  keep = jax.jit(functools.partial(I.staleness_mask_b, max_staleness=1))(
      np.array([5, 4, 3, 5]), 5)
  np.testing.assert_array_equal(keep, [1.0, 1.0, 0.0, 1.0])


def test_importance_metrics_match_numpy():
  trainer, generator, mask = mismatched_logps(6)
  m = jax.jit(I.importance_metrics)(trainer, generator, mask, 2.0)
  ratios = [math.exp(float(trainer[i, j]) - float(generator[i, j]))
            for i in range(mask.shape[0]) for j in range(mask.shape[1])
            if mask[i, j]]
  np.testing.assert_allclose(m["is_weight_mean"], np.mean(ratios), rtol=1e-5)
  np.testing.assert_allclose(m["is_capped_frac"],
                             np.mean([r > 2.0 for r in ratios]), rtol=1e-6)
  # KL(μ || π) with tokens from μ: k3 = r - 1 - log r, r = π / μ.
  np.testing.assert_allclose(
      m["mismatch_kl"], np.mean([r - 1 - math.log(r) for r in ratios]),
      rtol=1e-4)


def test_unknown_level_is_rejected():
  trainer, generator, mask = mismatched_logps(7)
  with pytest.raises(ValueError, match=r"'seq'.*\['token', 'sequence'\]"):
    I.truncated_is_weights(trainer, generator, mask, level="seq")


def test_jit_gives_same_results():
  trainer, generator, mask = mismatched_logps(8)
  for level in ("token", "sequence"):
    fn = functools.partial(I.truncated_is_weights, level=level)
    np.testing.assert_allclose(fn(trainer, generator, mask),
                               jax.jit(fn)(trainer, generator, mask),
                               rtol=1e-6)
