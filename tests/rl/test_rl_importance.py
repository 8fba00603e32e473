"""Rollout-correction weights and mismatch metrics against numpy loops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.rl import importance as I
from streamrl.rl import losses as L

pytestmark = [pytest.mark.unit]


def ragged_mask(rng, b, t):
  lengths = rng.integers(0, t + 1, size=b)
  lengths[0], lengths[1] = 0, t
  mask = np.zeros((b, t), np.float32)
  for i in range(b):
    mask[i, : lengths[i]] = 1.0
  return mask


def ref_weights(trainer, generator, mask, cap, level):
  b, t = mask.shape
  w = np.zeros((b, t))
  for i in range(b):
    if level == "sequence":
      s = sum(float(trainer[i, j]) - float(generator[i, j]) for j in range(t) if mask[i, j])
      seq_w = min(math.exp(s), cap)
    for j in range(t):
      if mask[i, j]:
        w[i, j] = (
            seq_w
            if level == "sequence"
            else min(math.exp(float(trainer[i, j]) - float(generator[i, j])), cap)
        )
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
  np.testing.assert_allclose(
      w, ref_weights(trainer, generator, mask, cap, level), rtol=1e-5, atol=1e-6
  )
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
  w = jax.jit(I.truncated_is_weights)(trainer, jnp.asarray(generator, jnp.bfloat16), mask)
  assert w.dtype == jnp.float32
  # Only bf16 rounding differs: weights are close to, but not all, exactly 1.
  valid = np.asarray(w)[mask > 0]
  np.testing.assert_allclose(valid, 1.0, atol=1e-2)


def test_extreme_and_padding_values_stay_finite():
  trainer = np.array([[0.0, -1.0, 0.0, 0.0]], np.float32)
  generator = np.array([[-500.0, -1.0, -np.inf, np.inf]], np.float32)
  mask = np.array([[1, 1, 0, 0]], np.float32)
  for level in ("token", "sequence"):
    w = np.asarray(I.truncated_is_weights(trainer, generator, mask, 2.0, level))
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(w, [[2.0, 1.0 if level == "token" else 2.0, 0.0, 0.0]])


def test_weights_carry_no_gradient():
  trainer, generator, mask = mismatched_logps(3)
  for level in ("token", "sequence"):
    grad = jax.jit(
        jax.grad(lambda tr: I.truncated_is_weights(tr, generator, mask, 5.0, level).sum())
    )(trainer)
    np.testing.assert_array_equal(grad, 0.0)


def test_weights_scale_policy_loss_per_token():
  # With is_weights_bt, the token loss is w times the unweighted token loss.
  trainer, generator, mask = mismatched_logps(4)
  rng = np.random.default_rng(4)
  logp = (trainer + 0.1 * rng.normal(size=trainer.shape)).astype(np.float32)
  adv = rng.normal(size=trainer.shape).astype(np.float32)
  w = I.truncated_is_weights(trainer, generator, mask)
  loss_fn = jax.jit(functools.partial(L.ppo_policy_loss, agg="token_sum_norm", norm_constant=1.0))
  weighted, _ = loss_fn(logp, trainer, adv, mask, is_weights_bt=w)
  ones, _ = loss_fn(logp, trainer, adv, mask, is_weights_bt=mask)
  plain, _ = loss_fn(logp, trainer, adv, mask)
  assert float(ones) == pytest.approx(float(plain), rel=1e-6)
  assert float(weighted) != pytest.approx(float(plain), rel=1e-3)


def ref_rollout_weights(trainer, generator, mask, mode, cap, threshold):
  """Per-token weights of `rollout_correction_weights`, in plain numpy."""
  if mode == "tis":
    return ref_weights(trainer, generator, mask, cap, "token")
  d = (trainer.astype(np.float64) - generator) * mask
  if mode == "none":
    return mask.astype(np.float64)
  mean_b = d.sum(1) / np.maximum(mask.sum(1), 1)
  ratio_b = np.exp(mean_b)
  keep_b = (ratio_b >= 1 / threshold) & (ratio_b <= threshold)
  return mask * keep_b[:, None]


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_rollout_correction_weights_match_numpy(mode):
  trainer, generator, mask = mismatched_logps(5, b=12, scale=0.4)
  fn = jax.jit(
      functools.partial(I.rollout_correction_weights, mode=mode, is_cap=1.5, mis_threshold=1.15)
  )
  w = np.asarray(fn(trainer, generator, mask))
  ref = ref_rollout_weights(trainer, generator, mask, mode, 1.5, 1.15)
  np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-6)
  if mode == "mis":  # some non-empty sequences kept, some dropped
    kept_b = w.sum(1) > 0
    assert 0 < kept_b.sum() < (mask.sum(1) > 0).sum()
    assert set(np.unique(w)) <= {0.0, 1.0}


def test_mis_keeps_a_sequence_by_its_mean_ratio():
  # Row 0: per-token ratios e^0.5 and e^-0.5, mean log-ratio 0: kept though
  # each token alone is outside [1/1.2, 1.2]. Row 1: mean log-ratio 0.25 >
  # log(1.2): dropped. Row 2: padding holds -inf and is ignored.
  trainer = np.array([[0.0, -1.0], [0.0, 0.0], [-0.1, 0.0]], np.float32)
  generator = np.array([[-0.5, -0.5], [-0.25, -0.25], [-0.1, -np.inf]], np.float32)
  mask = np.array([[1, 1], [1, 1], [1, 0]], np.float32)
  w = I.rollout_correction_weights(trainer, generator, mask, "mis", mis_threshold=1.2)
  np.testing.assert_array_equal(w, [[1, 1], [0, 0], [1, 0]])
  grad = jax.grad(lambda tr: I.rollout_correction_weights(tr, generator, mask, "mis").sum())(
      trainer
  )
  np.testing.assert_array_equal(grad, 0.0)


def test_rollout_correction_rejects_unknown_mode_and_threshold():
  trainer, generator, mask = mismatched_logps(6)
  with pytest.raises(ValueError, match=r"'is'.*\['none', 'tis', 'mis'\]"):
    I.rollout_correction_weights(trainer, generator, mask, "is")
  with pytest.raises(ValueError, match="mis_threshold"):
    I.rollout_correction_weights(trainer, generator, mask, "mis", mis_threshold=0.5)


def test_mismatch_metrics_match_numpy():
  trainer, generator, mask = mismatched_logps(6)
  m = I.mismatch_metrics(trainer, generator, mask)  # numpy in, no jit
  d = (trainer.astype(np.float64) - generator)[mask > 0]
  r = np.exp(d)
  np.testing.assert_allclose(m["k3_kl"], np.mean(r - 1 - d), rtol=1e-4)
  np.testing.assert_allclose(m["max_abs_logprob_diff"], np.abs(d).max(), rtol=1e-6)
  np.testing.assert_allclose(m["is_weight_max"], r.max(), rtol=1e-5)
  jitted = jax.jit(I.mismatch_metrics)(trainer, generator, mask)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), m, jitted)


def test_mismatch_metrics_ignore_padding_and_empty_masks():
  trainer = np.array([[0.0, -1.0, 0.0]], np.float32)
  generator = np.array([[-0.5, -1.0, -np.inf]], np.float32)
  m = I.mismatch_metrics(trainer, generator, np.array([[1, 1, 0]]))
  np.testing.assert_allclose(m["max_abs_logprob_diff"], 0.5)
  np.testing.assert_allclose(m["is_weight_max"], math.exp(0.5), rtol=1e-6)
  np.testing.assert_allclose(m["k3_kl"], (math.exp(0.5) - 1.5) / 2, rtol=1e-5)
  empty = I.mismatch_metrics(trainer, generator, np.zeros((1, 3)))
  assert all(float(v) == 0.0 for v in empty.values())


def test_unknown_level_is_rejected():
  trainer, generator, mask = mismatched_logps(7)
  with pytest.raises(ValueError, match=r"'seq'.*\['token', 'sequence'\]"):
    I.truncated_is_weights(trainer, generator, mask, level="seq")


def test_jit_gives_same_results():
  trainer, generator, mask = mismatched_logps(8)
  for level in ("token", "sequence"):
    fn = functools.partial(I.truncated_is_weights, level=level)
    np.testing.assert_allclose(
        fn(trainer, generator, mask), jax.jit(fn)(trainer, generator, mask), rtol=1e-6
    )
