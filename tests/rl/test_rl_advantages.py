"""Advantage estimators against plain-loop numpy references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.rl import advantages as A

pytestmark = [pytest.mark.unit]

RTOL, ATOL = 1e-5, 1e-5


def ragged_mask(rng, b, t, holes=False):
  """Right-padded [b, t] 0/1 mask; row 0 is empty, row 1 full, others random.

  With holes=True some interior positions of each row are also zeroed (e.g.
  tool-output tokens).
  """
  lengths = rng.integers(0, t + 1, size=b)
  lengths[0], lengths[1] = 0, t
  mask = np.zeros((b, t), np.float32)
  for i in range(b):
    for j in range(lengths[i]):
      mask[i, j] = 1.0
  if holes:
    mask *= rng.random((b, t)) > 0.3
  return mask


# --------------------------------------------------------------------------
# numpy references: explicit loops over valid tokens
# --------------------------------------------------------------------------


def ref_gae(rewards, values, mask, gamma, lam):
  b, t = rewards.shape
  adv = np.zeros((b, t))
  ret = np.zeros((b, t))
  for i in range(b):
    valid = [j for j in range(t) if mask[i, j]]
    next_value, next_adv = 0.0, 0.0
    for j in reversed(valid):
      delta = rewards[i, j] + gamma * next_value - values[i, j]
      adv[i, j] = delta + gamma * lam * next_adv
      ret[i, j] = adv[i, j] + values[i, j]
      next_value, next_adv = values[i, j], adv[i, j]
  return adv, ret


def ref_discounted_returns(rewards, mask, gamma):
  b, t = rewards.shape
  out = np.zeros((b, t))
  for i in range(b):
    valid = [j for j in range(t) if mask[i, j]]
    for k, j in enumerate(valid):
      out[i, j] = sum(gamma**n * rewards[i, s] for n, s in enumerate(valid[k:]))
  return out


def ref_whiten(x, mask, shift_mean=True, eps=1e-8):
  vals = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
  mean = sum(vals) / len(vals)
  var = sum((v - mean) ** 2 for v in vals) / len(vals)
  out = np.zeros(x.shape)
  for i in range(x.shape[0]):
    for j in range(x.shape[1]):
      if mask[i, j]:
        out[i, j] = (x[i, j] - mean) / np.sqrt(var + eps)
        if not shift_mean:
          out[i, j] += mean
  return out


def ref_grpo(rewards, k, eps=1e-6, normalize_std=True):
  out = np.zeros(len(rewards))
  for g in range(len(rewards) // k):
    grp = [float(r) for r in rewards[g * k : (g + 1) * k]]
    mean = sum(grp) / k
    std = np.sqrt(sum((r - mean) ** 2 for r in grp) / max(k - 1, 1))
    for n, r in enumerate(grp):
      out[g * k + n] = (r - mean) / (std + eps) if normalize_std else r - mean
  return out


def ref_rloo(rewards, k):
  out = np.zeros(len(rewards))
  for g in range(len(rewards) // k):
    for n in range(k):
      others = [rewards[g * k + m] for m in range(k) if m != n]
      out[g * k + n] = rewards[g * k + n] - sum(others) / len(others)
  return out


def ref_token_level_rewards(scores, mask, kl, kl_coef):
  b, t = mask.shape
  out = np.zeros((b, t))
  for i in range(b):
    valid = [j for j in range(t) if mask[i, j]]
    for j in valid:
      out[i, j] = -kl_coef * kl[i, j]
    if valid:
      out[i, valid[-1]] += scores[i]
  return out


# --------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_numpy(gamma, lam, holes):
  rng = np.random.default_rng(0)
  mask = ragged_mask(rng, 6, 9, holes=holes)
  rewards = rng.normal(size=(6, 9)).astype(np.float32)
  values = rng.normal(size=(6, 9)).astype(np.float32)
  adv, ret = A.gae(rewards, values, mask, gamma, lam)
  ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(adv, ref_adv, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(ret, ref_ret, rtol=RTOL, atol=ATOL)
  assert np.all(np.asarray(adv)[mask == 0] == 0)


def test_gae_lambda1_gamma1_is_returns_minus_values():
  rng = np.random.default_rng(1)
  mask = ragged_mask(rng, 5, 7)
  rewards = rng.normal(size=(5, 7)).astype(np.float32)
  values = rng.normal(size=(5, 7)).astype(np.float32)
  adv, ret = A.gae(rewards, values, mask, 1.0, 1.0)
  # Right-padded: the return-to-go is a reverse cumulative sum of rewards.
  rtg = np.flip(np.cumsum(np.flip(rewards * mask, -1), -1), -1)
  np.testing.assert_allclose(adv, (rtg - values) * mask, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(ret, rtg * mask, rtol=RTOL, atol=ATOL)


def test_gae_bootstraps_zero_after_last_token():
  # One sequence of length 2 in a row of 4: the value at padding must not leak.
  rewards = np.array([[0.0, 1.0, 5.0, 5.0]], np.float32)
  values = np.array([[0.5, 0.25, 100.0, 100.0]], np.float32)
  mask = np.array([[1, 1, 0, 0]], np.float32)
  adv, _ = A.gae(rewards, values, mask, 1.0, 1.0)
  np.testing.assert_allclose(adv, [[1.0 - 0.5, 1.0 - 0.25, 0.0, 0.0]])


def test_discounted_returns_matches_numpy():
  rng = np.random.default_rng(2)
  mask = ragged_mask(rng, 5, 8, holes=True)
  rewards = rng.normal(size=(5, 8)).astype(np.float32)
  out = A.discounted_returns(rewards, mask, 0.9)
  np.testing.assert_allclose(out, ref_discounted_returns(rewards, mask, 0.9), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_numpy(shift_mean):
  rng = np.random.default_rng(3)
  mask = ragged_mask(rng, 6, 5)
  x = (3.0 + 2.0 * rng.normal(size=(6, 5))).astype(np.float32)
  out = A.whiten(x, mask, shift_mean=shift_mean)
  np.testing.assert_allclose(out, ref_whiten(x, mask, shift_mean), rtol=RTOL, atol=ATOL)


def test_whiten_empty_mask_is_zero_not_nan():
  out = A.whiten(np.ones((2, 3), np.float32), np.zeros((2, 3)))
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_numpy(normalize_std):
  rng = np.random.default_rng(4)
  rewards = rng.normal(size=12).astype(np.float32)
  out = A.grpo_advantages(rewards, 4, normalize_std=normalize_std)
  np.testing.assert_allclose(
      out, ref_grpo(rewards, 4, normalize_std=normalize_std), rtol=RTOL, atol=ATOL
  )


def test_grpo_identical_rewards_give_exact_zero():
  # 0.1 is not representable: a naive mean leaves a residue that eps can't hide.
  rewards = np.array([0.1] * 3 + [0.7, 0.7, 0.7] + [0.0, 1.0, 0.0], np.float32)
  out = np.asarray(A.grpo_advantages(rewards, 3))
  np.testing.assert_array_equal(out[:6], 0.0)
  assert np.all(out[6:] != 0.0)
  np.testing.assert_array_equal(np.asarray(A.rloo_advantages(rewards, 3))[:6], 0.0)


def test_grpo_group_size_one_is_zero():
  out = A.grpo_advantages(np.array([1.0, 2.0, 3.0], np.float32), 1)
  np.testing.assert_array_equal(out, 0.0)


def test_grpo_rejects_partial_groups():
  with pytest.raises(ValueError, match="whole groups of 4"):
    A.grpo_advantages(np.zeros(6, np.float32), 4)


def test_rloo_matches_numpy_and_needs_two_samples():
  rng = np.random.default_rng(5)
  rewards = rng.normal(size=12).astype(np.float32)
  np.testing.assert_allclose(
      A.rloo_advantages(rewards, 3), ref_rloo(rewards, 3), rtol=RTOL, atol=ATOL
  )
  with pytest.raises(ValueError, match="at least 2 samples"):
    A.rloo_advantages(rewards, 1)


def test_token_level_rewards_matches_numpy():
  rng = np.random.default_rng(6)
  mask = ragged_mask(rng, 5, 6, holes=True)
  scores = rng.normal(size=5).astype(np.float32)
  kl = rng.normal(size=(5, 6)).astype(np.float32)
  out = A.token_level_rewards(scores, mask, kl, 0.05)
  np.testing.assert_allclose(
      out, ref_token_level_rewards(scores, mask, kl, 0.05), rtol=RTOL, atol=ATOL
  )


def test_reinforce_pp_matches_numpy():
  rng = np.random.default_rng(7)
  mask = ragged_mask(rng, 6, 7)
  scores = rng.normal(size=6).astype(np.float32)
  kl = np.abs(rng.normal(size=(6, 7))).astype(np.float32)
  rewards = ref_token_level_rewards(scores, mask, kl, 0.1).astype(np.float32)
  adv, ret = A.reinforce_pp_advantages(rewards, mask, 0.95)
  ref_ret = ref_discounted_returns(rewards, mask, 0.95)
  np.testing.assert_allclose(ret, ref_ret, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(adv, ref_whiten(ref_ret, mask), rtol=RTOL, atol=ATOL)


def test_registry_adapters_match_raw_functions():
  rng = np.random.default_rng(8)
  mask = ragged_mask(rng, 8, 5)
  mask[0, 0] = 1.0  # every sequence has at least one token
  scores = rng.normal(size=8).astype(np.float32)
  rewards = A.token_level_rewards(scores, mask)
  values = rng.normal(size=(8, 5)).astype(np.float32)

  adv, ret = A.get_advantage_estimator("gae")(rewards, mask, values_bt=values, gamma=0.9, lam=0.8)
  ref = ref_gae(np.asarray(rewards), values, mask, 0.9, 0.8)
  np.testing.assert_allclose(adv, ref[0], rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(ret, ref[1], rtol=RTOL, atol=ATOL)

  adv, ret = A.get_advantage_estimator("grpo")(rewards, mask, group_size=4)
  np.testing.assert_allclose(adv, ref_grpo(scores, 4)[:, None] * mask, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(ret, scores[:, None] * mask, rtol=RTOL, atol=ATOL)

  adv, _ = A.get_advantage_estimator("rloo")(rewards, mask, group_size=2)
  np.testing.assert_allclose(adv, ref_rloo(scores, 2)[:, None] * mask, rtol=RTOL, atol=ATOL)

  adv, _ = A.get_advantage_estimator("reinforce_pp")(rewards, mask, gamma=1.0)
  np.testing.assert_allclose(
      adv,
      ref_whiten(ref_discounted_returns(np.asarray(rewards), mask, 1.0), mask),
      rtol=RTOL,
      atol=ATOL,
  )


def test_registry_errors_are_clear():
  with pytest.raises(ValueError, match=r"'ppo_gae'.*\['gae', 'grpo', 'reinforce_pp', 'rloo'\]"):
    A.get_advantage_estimator("ppo_gae")
  with pytest.raises(ValueError, match="needs critic values"):
    A.get_advantage_estimator("gae")(np.zeros((2, 3)), np.ones((2, 3)))


def test_jit_gives_same_results():
  rng = np.random.default_rng(9)
  mask = ragged_mask(rng, 4, 6, holes=True)
  rewards = rng.normal(size=(4, 6)).astype(np.float32)
  values = rng.normal(size=(4, 6)).astype(np.float32)
  r_b = rng.normal(size=4).astype(np.float32)
  cases = [
      (A.gae, (rewards, values, mask, 0.99, 0.95)),
      (A.discounted_returns, (rewards, mask, 0.9)),
      (A.whiten, (rewards, mask)),
      (A.token_level_rewards, (r_b, mask, values, 0.1)),
      (functools.partial(A.grpo_advantages, group_size=2), (r_b,)),
      (functools.partial(A.rloo_advantages, group_size=2), (r_b,)),
      (A.reinforce_pp_advantages, (rewards, mask, 0.9)),
      (functools.partial(A.get_advantage_estimator("grpo"), group_size=2), (rewards, mask)),
  ]
  for fn, args in cases:
    eager = fn(*args)
    jitted = jax.jit(fn)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), eager, jitted)


def test_gamma_and_lam_may_be_traced():
  rng = np.random.default_rng(10)
  mask = ragged_mask(rng, 3, 4)
  rewards = rng.normal(size=(3, 4)).astype(np.float32)
  values = rng.normal(size=(3, 4)).astype(np.float32)
  adv, _ = jax.jit(A.gae)(rewards, values, mask, jnp.float32(0.9), jnp.float32(0.5))
  np.testing.assert_allclose(adv, ref_gae(rewards, values, mask, 0.9, 0.5)[0], rtol=RTOL, atol=ATOL)


def test_group_size_accepts_numpy_int_and_rejects_bad_values():
  rewards = np.arange(6, dtype=np.float32)
  np.testing.assert_allclose(
      A.grpo_advantages(rewards, np.int64(3)), ref_grpo(rewards, 3), rtol=RTOL, atol=ATOL
  )
  for bad in (0, 2.0, -1):
    with pytest.raises(ValueError, match="positive integer"):
      A.grpo_advantages(rewards, bad)
