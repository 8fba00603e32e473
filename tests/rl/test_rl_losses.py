"""Policy / value / KL losses and aggregation against numpy loops."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.rl import losses as L

pytestmark = [pytest.mark.unit]

RTOL, ATOL = 1e-5, 1e-6


def jitted(fn, **static):
  """jit(fn) with keyword options bound: one compile instead of one per op.

  (Eager JAX compiles every primitive separately; on a loaded 2-core machine
  that costs seconds. Eager == jit is checked once in test_jit_gives_same_results.)
  """
  return jax.jit(functools.partial(fn, **static))


def ragged_mask(rng, b, t):
  """Right-padded [b, t] mask; row 0 empty, row 1 full, the rest random."""
  lengths = rng.integers(0, t + 1, size=b)
  lengths[0], lengths[1] = 0, t
  mask = np.zeros((b, t), np.float32)
  for i in range(b):
    mask[i, : lengths[i]] = 1.0
  return mask


# --------------------------------------------------------------------------
# numpy references
# --------------------------------------------------------------------------


def ref_aggregate(x, mask, mode, norm_constant=None):
  b, t = x.shape
  if mode == "token_mean":
    total, count = 0.0, 0
    for i in range(b):
      for j in range(t):
        if mask[i, j]:
          total += x[i, j]
          count += 1
    return total / count if count else 0.0
  if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
    per_seq = []
    for i in range(b):
      vals = [x[i, j] for j in range(t) if mask[i, j]]
      if vals:
        per_seq.append(sum(vals) / len(vals) if mode == "seq_mean_token_mean" else sum(vals))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0
  if mode == "token_sum_norm":
    const = t if norm_constant is None else norm_constant
    return sum(x[i, j] for i in range(b) for j in range(t) if mask[i, j]) / (b * const)
  raise AssertionError(mode)


def ref_ppo_tokens(logp, old, adv, mask, clip_low, clip_high, dual_clip, weights):
  b, t = logp.shape
  loss = np.zeros((b, t))
  clipped = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      if not mask[i, j]:
        continue
      a = float(adv[i, j])
      r = math.exp(float(logp[i, j]) - float(old[i, j]))
      l1 = -a * r
      l2 = -a * min(max(r, 1 - clip_low), 1 + clip_high)
      loss[i, j] = max(l1, l2)
      clipped[i, j] = l2 > l1
      if dual_clip is not None and a < 0:
        loss[i, j] = min(loss[i, j], dual_clip * abs(a))
      if weights is not None:
        loss[i, j] *= weights[i, j]
  return loss, clipped


def ref_k3(logp, ref):
  d = ref - logp
  return math.exp(d) - d - 1


def ref_masked_mean(x, mask):
  vals = [x[i, j] for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
  return sum(vals) / len(vals) if vals else 0.0


def random_policy_batch(seed, b=5, t=7):
  rng = np.random.default_rng(seed)
  mask = ragged_mask(rng, b, t)
  old = -np.abs(rng.normal(size=(b, t))).astype(np.float32)
  logp = (old + 0.3 * rng.normal(size=(b, t))).astype(np.float32)
  adv = rng.normal(size=(b, t)).astype(np.float32)
  return logp, old, adv, mask, rng


# --------------------------------------------------------------------------
# aggregate
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_aggregate_matches_numpy(mode):
  rng = np.random.default_rng(0)
  mask = ragged_mask(rng, 6, 5)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  np.testing.assert_allclose(
      jitted(L.aggregate, mode=mode)(x, mask), ref_aggregate(x, mask, mode), rtol=RTOL, atol=ATOL
  )


def test_aggregate_token_sum_norm_uses_constant():
  rng = np.random.default_rng(1)
  mask = ragged_mask(rng, 4, 5)
  x = rng.normal(size=(4, 5)).astype(np.float32)
  np.testing.assert_allclose(
      jitted(L.aggregate, mode="token_sum_norm", norm_constant=12.0)(x, mask),
      ref_aggregate(x, mask, "token_sum_norm", 12.0),
      rtol=RTOL,
      atol=ATOL,
  )


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_aggregate_empty_mask_is_zero(mode):
  out = jitted(L.aggregate, mode=mode)(np.ones((3, 4), np.float32), np.zeros((3, 4)))
  assert float(out) == 0.0


def test_aggregate_modes_weigh_sequences_differently():
  # Sequence 0: 1 token of 1.0; sequence 1: 3 tokens of 0.0.
  x = np.array([[1.0, 0, 0], [0.0, 0, 0]], np.float32)
  mask = np.array([[1, 0, 0], [1, 1, 1]], np.float32)
  assert float(jitted(L.aggregate, mode="token_mean")(x, mask)) == (pytest.approx(0.25))
  assert float(jitted(L.aggregate, mode="seq_mean_token_mean")(x, mask)) == (pytest.approx(0.5))


def test_aggregate_unknown_mode_lists_known():
  with pytest.raises(ValueError, match="token_mean.*seq_mean_token_mean"):
    L.aggregate(np.zeros((1, 1)), np.ones((1, 1)), "mean")


# --------------------------------------------------------------------------
# PPO policy loss
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dual_clip,agg",
    [
        (None, "token_mean"),
        (3.0, "seq_mean_token_mean"),
        (3.0, "seq_mean_token_sum"),
        (None, "token_sum_norm"),
    ],
)
def test_ppo_policy_loss_matches_numpy(dual_clip, agg):
  logp, old, adv, mask, rng = random_policy_batch(1)
  weights = rng.uniform(0.5, 2.0, size=logp.shape).astype(np.float32)
  for w in (None, weights):
    loss, metrics = jitted(
        L.ppo_policy_loss, clip_low=0.15, clip_high=0.28, dual_clip=dual_clip, agg=agg
    )(logp, old, adv, mask, is_weights_bt=w)
    ref_tok, ref_clipped = ref_ppo_tokens(logp, old, adv, mask, 0.15, 0.28, dual_clip, w)
    np.testing.assert_allclose(loss, ref_aggregate(ref_tok, mask, agg), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(metrics["clip_frac"], ref_masked_mean(ref_clipped, mask), rtol=RTOL)
  k3 = np.array([[ref_k3(o, l) for o, l in zip(ro, rl)] for ro, rl in zip(old, logp)])
  np.testing.assert_allclose(metrics["approx_kl"], ref_masked_mean(k3, mask), rtol=1e-4, atol=ATOL)
  np.testing.assert_allclose(
      metrics["ratio_mean"], ref_masked_mean(np.exp(logp - old), mask), rtol=RTOL
  )


def _per_token_loss_and_grad(logp, old, adv, **kw):
  """Loss of each token of a [1, T] row on its own, and d(sum of them)/dlogp."""

  def one_token(lp, o, a):
    one = jnp.ones((1, 1))
    return L.ppo_policy_loss(lp.reshape(1, 1), o.reshape(1, 1), a.reshape(1, 1), one, **kw)[0]

  def per_token(lp):
    return jax.vmap(one_token)(lp[0], old[0], adv[0])

  losses, grad = jax.jit(lambda lp: (per_token(lp), jax.grad(lambda x: per_token(x).sum())(lp)))(
      jnp.asarray(logp)
  )
  return np.asarray(losses), np.asarray(grad)[0]


def test_clipping_only_outside_trust_region_and_zero_grad_there():
  ratios = np.array([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 2.0], np.float32)
  old = np.full((1, ratios.size), -1.0, np.float32)
  logp = old + np.log(ratios)[None]
  for sign in (1.0, -1.0):
    adv = np.full_like(old, sign * 2.0)
    _, metrics = jitted(L.ppo_policy_loss, clip_low=0.2, clip_high=0.2)(
        logp, old, adv, np.ones_like(old)
    )
    tok_loss, grad = _per_token_loss_and_grad(logp, old, adv, clip_low=0.2, clip_high=0.2)
    if sign > 0:  # A > 0: only ratio > 1 + eps is clipped.
      expect_clipped = ratios > 1.2
    else:  # A < 0: only ratio < 1 - eps is clipped.
      expect_clipped = ratios < 0.8
    assert float(metrics["clip_frac"]) == pytest.approx(expect_clipped.mean())
    np.testing.assert_array_equal(grad[expect_clipped], 0.0)
    assert np.all(grad[~expect_clipped] != 0.0)
    # Inside the region the loss is the plain surrogate -A * ratio.
    np.testing.assert_allclose(
        tok_loss[~expect_clipped], -sign * 2.0 * ratios[~expect_clipped], rtol=1e-5
    )
    clip_ratio = np.clip(ratios, 0.8, 1.2)
    np.testing.assert_allclose(
        tok_loss[expect_clipped], -sign * 2.0 * clip_ratio[expect_clipped], rtol=1e-5
    )


def test_dual_clip_caps_negative_advantage_loss():
  ratios = np.array([0.5, 1.0, 2.0, 3.5, 10.0], np.float32)
  old = np.zeros((1, ratios.size), np.float32)
  logp = old + np.log(ratios)[None]
  adv = np.full_like(old, -1.5)
  plain, _ = _per_token_loss_and_grad(logp, old, adv)
  dual, grad = _per_token_loss_and_grad(logp, old, adv, dual_clip=3.0)
  # Without dual clip the loss grows with the ratio without bound.
  np.testing.assert_allclose(plain[2:], 1.5 * ratios[2:], rtol=1e-5)
  # With it, capped at c·|A| = 4.5 beyond ratio 3, with zero gradient.
  np.testing.assert_allclose(dual, np.minimum(plain, 4.5), rtol=1e-5)
  np.testing.assert_array_equal(grad[ratios > 3.0], 0.0)
  assert grad[2] != 0.0
  _, metrics = jitted(L.ppo_policy_loss, dual_clip=3.0)(logp, old, adv, np.ones_like(old))
  assert float(metrics["dual_clip_frac"]) == pytest.approx(2 / 5)
  # Positive advantages are never dual-clipped.
  pos, _ = _per_token_loss_and_grad(logp, old, -adv, dual_clip=3.0)
  np.testing.assert_allclose(pos, _per_token_loss_and_grad(logp, old, -adv)[0])
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    L.ppo_policy_loss(logp, old, adv, np.ones_like(old), dual_clip=0.5)


def test_policy_gradient_matches_numpy_and_ignores_padding():
  logp, old, adv, mask, _ = random_policy_batch(2)
  # Garbage in padding (what a model may emit there) must not leak.
  logp = np.where(mask > 0, logp, -np.inf).astype(np.float32)
  old = np.where(mask > 0, old, 50.0).astype(np.float32)

  def f(lp):
    return L.ppo_policy_loss(lp, old, adv, mask)[0]

  loss, grad = jax.jit(jax.value_and_grad(f))(jnp.asarray(logp))
  assert np.isfinite(float(loss))
  grad = np.asarray(grad)
  np.testing.assert_array_equal(grad[mask == 0], 0.0)
  # d/dlogp of -A·ρ is -A·ρ on unclipped tokens, 0 on clipped; / token count.
  ref = np.zeros_like(grad)
  _, clipped = ref_ppo_tokens(logp, old, adv, mask, 0.2, 0.2, None, None)
  n = mask.sum()
  for i in range(mask.shape[0]):
    for j in range(mask.shape[1]):
      if mask[i, j] and not clipped[i, j]:
        ref[i, j] = -adv[i, j] * math.exp(logp[i, j] - old[i, j]) / n
  np.testing.assert_allclose(grad, ref, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------
# value loss, KL loss, entropy
# --------------------------------------------------------------------------


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_value_loss_matches_numpy(clip, agg):
  rng = np.random.default_rng(3)
  mask = ragged_mask(rng, 5, 6)
  old = rng.normal(size=(5, 6)).astype(np.float32)
  values = (old + 0.4 * rng.normal(size=(5, 6))).astype(np.float32)
  returns = rng.normal(size=(5, 6)).astype(np.float32)
  loss, metrics = jitted(L.value_loss, clip=clip, agg=agg)(values, old, returns, mask)
  err = np.zeros((5, 6))
  clipped = np.zeros((5, 6))
  for i in range(5):
    for j in range(6):
      e1 = (values[i, j] - returns[i, j]) ** 2
      if clip is None:
        err[i, j] = e1
        continue
      vc = old[i, j] + min(max(values[i, j] - old[i, j], -clip), clip)
      e2 = (vc - returns[i, j]) ** 2
      err[i, j] = max(e1, e2)
      clipped[i, j] = e2 > e1
  np.testing.assert_allclose(loss, 0.5 * ref_aggregate(err, mask, agg), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(metrics["vf_clip_frac"], ref_masked_mean(clipped, mask), rtol=RTOL)
  res = [(returns[i, j] - values[i, j]) for i in range(5) for j in range(6) if mask[i, j]]
  ret = [returns[i, j] for i in range(5) for j in range(6) if mask[i, j]]
  np.testing.assert_allclose(
      metrics["explained_variance"], 1 - np.var(res) / np.var(ret), rtol=1e-4
  )


def test_value_loss_gradient_zero_when_clipped_and_worse():
  # V moved past the clip range away from R: the clipped error is larger, so
  # the max picks it and the gradient vanishes.
  old = np.array([[0.0]], np.float32)
  returns = np.array([[0.0]], np.float32)
  mask = np.ones((1, 1), np.float32)
  grad = jax.jit(jax.grad(lambda v: L.value_loss(v, old, returns, mask, clip=0.2)[0]))
  assert float(grad(jnp.array([[0.5]]))[0, 0]) != 0.0  # unclipped larger
  old_far = np.array([[1.0]], np.float32)
  g = jax.jit(jax.grad(lambda v: L.value_loss(v, old_far, returns, mask, clip=0.2)[0]))
  # old=1, V=0.5: V_clip = 0.8, (0.8)^2 > (0.5)^2 → clipped branch, no grad.
  assert float(g(jnp.array([[0.5]]))[0, 0]) == 0.0


def test_explained_variance_extremes():
  rng = np.random.default_rng(4)
  mask = ragged_mask(rng, 4, 5)
  r = rng.normal(size=(4, 5)).astype(np.float32)
  ev = jax.jit(L.explained_variance)
  assert float(ev(r, r, mask)) == pytest.approx(1.0)
  assert float(ev(np.zeros_like(r), np.ones_like(r), mask)) == 0.0


def test_kl_loss_matches_numpy():
  logp, ref, _, mask, _ = random_policy_batch(5)
  loss, metrics = jitted(L.kl_loss, estimator="k3")(logp, ref, mask)
  k3 = np.array([[ref_k3(a, b) for a, b in zip(ra, rb)] for ra, rb in zip(logp, ref)])
  np.testing.assert_allclose(loss, ref_masked_mean(k3, mask), rtol=1e-4, atol=ATOL)
  assert float(metrics["kl_loss"]) == float(loss)
  loss1, _ = jitted(L.kl_loss, estimator="k1", agg="seq_mean_token_sum")(logp, ref, mask)
  np.testing.assert_allclose(
      loss1, ref_aggregate(logp - ref, mask, "seq_mean_token_sum"), rtol=RTOL, atol=ATOL
  )


def test_jit_gives_same_results():
  logp, old, adv, mask, _ = random_policy_batch(7)
  cases = [
      (functools.partial(L.aggregate, mode="seq_mean_token_mean"), (adv, mask)),
      (
          functools.partial(L.ppo_policy_loss, dual_clip=3.0, agg="seq_mean_token_sum"),
          (logp, old, adv, mask),
      ),
      (L.value_loss, (logp, old, adv, mask)),
      (L.kl_loss, (logp, old, mask)),
      (L.explained_variance, (logp, adv, mask)),
  ]
  for fn, args in cases:
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        fn(*args),
        jax.jit(fn)(*args),
    )


def test_micro_batches_reproduce_token_mean_with_traced_normaliser():
  # Gradient accumulation: summing micro-batch losses aggregated with
  # token_sum_norm and norm_constant = total tokens / micro-batch rows gives
  # the token_mean of the whole batch (a mean of micro-batch token_means
  # would not, since the micro-batches hold different token counts).
  rng = np.random.default_rng(8)
  mask = ragged_mask(rng, 6, 5)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  whole = ref_aggregate(x, mask, "token_mean")

  @jax.jit
  def micro(x_bt, mask_bt, total_tokens):
    return L.aggregate(x_bt, mask_bt, "token_sum_norm", norm_constant=total_tokens / x_bt.shape[0])

  total = jnp.float32(mask.sum())
  summed = sum(float(micro(x[i : i + 2], mask[i : i + 2], total)) for i in range(0, 6, 2))
  assert summed == pytest.approx(whole, rel=1e-5)
  naive = np.mean(
      [ref_aggregate(x[i : i + 2], mask[i : i + 2], "token_mean") for i in range(0, 6, 2)]
  )
  assert naive != pytest.approx(whole, rel=1e-3)
