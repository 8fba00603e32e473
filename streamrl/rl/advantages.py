"""Advantage estimators as pure ``jax.numpy`` functions.

Shapes follow `streamrl.rl.masked`: ``B`` sequences, ``T`` response tokens,
``mask_bt`` 1 on valid response tokens. Every function here is
jit-compatible; the only static arguments are Python ints / bools / strings
(``group_size``, ``normalize_std``, ``shift_mean``, estimator names).

Two families:

* token-level (``gae``, ``discounted_returns``, ``reinforce_pp_advantages``)
  take per-token rewards ``rewards_bt`` — usually the verifier's score on the
  last valid token minus a per-token KL penalty, see `token_level_rewards`;
* outcome-level (``grpo_advantages``, ``rloo_advantages``) take one scalar
  reward per sequence ``rewards_b`` laid out as ``G`` contiguous groups of
  ``K = group_size`` samples of the same prompt (``B = G * K``).

`ADVANTAGE_ESTIMATORS` wraps all four behind one signature (see
`AdvantageEstimator`) so a config can pick one by name.
"""

from __future__ import annotations

import operator
from typing import Protocol

import jax
import jax.numpy as jnp

from streamrl.rl.masked import as_float, as_mask, masked_mean, masked_var

Array = jax.Array


# ----------------------------------------------------------------------------
# Token-level helpers
# ----------------------------------------------------------------------------


def last_token_onehot(mask_bt: Array) -> Array:
  """One-hot [B, T] of the last valid token of each row (all-zero rows stay 0).

  Works for any mask, not only right-padded ones: the index is the last
  position where the mask is non-zero.
  """
  m = jnp.asarray(mask_bt) != 0
  t = m.shape[-1]
  last_t = t - 1 - jnp.argmax(m[:, ::-1], axis=-1)
  onehot = jax.nn.one_hot(last_t, t, dtype=jnp.float32)
  return onehot * jnp.any(m, axis=-1, keepdims=True)


def token_level_rewards(
    scores_b: Array,
    mask_bt: Array,
    kl_bt: Array | None = None,
    kl_coef: float | Array = 0.0,
) -> Array:
  """Per-token rewards for PPO / REINFORCE++ (Ziegler et al. reward shaping).

  rewards_bt[b, t] = score_b · [t is the last valid token of b]
                     - kl_coef · kl_bt[b, t]                   (valid tokens)

  Args:
    scores_b: [B] sequence-level rewards from the verifier.
    mask_bt: [B, T] valid response tokens.
    kl_bt: optional [B, T] per-token KL estimate to the reference policy
      (e.g. `streamrl.rl.kl.kl_k1`). Pass it through ``jax.lax.stop_gradient``
      if it was computed from the trained policy.
    kl_coef: KL penalty coefficient β (may be a traced scalar, so an adaptive
      controller does not force recompiles).

  Returns:
    rewards_bt: [B, T], zero outside the mask.
  """
  scores_b = as_float(scores_b)
  onehot_bt = last_token_onehot(mask_bt).astype(scores_b.dtype)
  rewards_bt = scores_b[:, None] * onehot_bt
  if kl_bt is not None:
    kl_bt = as_float(kl_bt)
    rewards_bt = rewards_bt - kl_coef * kl_bt * as_mask(mask_bt, kl_bt)
  return rewards_bt


def sequence_to_tokens(values_b: Array, mask_bt: Array) -> Array:
  """Broadcasts one value per sequence to its valid tokens: [B] -> [B, T]."""
  values_b = as_float(values_b)
  return values_b[:, None] * as_mask(mask_bt, values_b)


def _reverse_gae_scan(rewards_bt: Array, values_bt: Array, mask_bt: Array, gamma, lam) -> Array:
  """Backward recursion shared by GAE and discounted returns.

  For valid tokens, with t' the next *valid* token after t (none → V = A = 0):
    delta_t = r_t + gamma · V_{t'} - V_t
    A_t     = delta_t + gamma · lam · A_{t'}
  Invalid tokens are skipped (they neither receive nor pass on anything
  except the carry), so right padding bootstraps with 0 after the last valid
  token, and masked holes (e.g. tool output) are stepped over.
  Returns A [B, T], zero outside the mask.
  """
  r_tb = as_float(rewards_bt).T
  v_tb = as_float(values_bt).astype(r_tb.dtype).T
  valid_tb = (jnp.asarray(mask_bt) != 0).T
  zeros_b = jnp.zeros(r_tb.shape[1], r_tb.dtype)

  def step(carry, xs):
    next_value_b, next_adv_b = carry
    r_b, v_b, valid_b = xs
    delta_b = r_b + gamma * next_value_b - v_b
    adv_b = delta_b + gamma * lam * next_adv_b
    carry = (jnp.where(valid_b, v_b, next_value_b), jnp.where(valid_b, adv_b, next_adv_b))
    return carry, jnp.where(valid_b, adv_b, 0.0)

  _, adv_tb = jax.lax.scan(step, (zeros_b, zeros_b), (r_tb, v_tb, valid_tb), reverse=True)
  return adv_tb.T


# ----------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------


def gae(
    rewards_bt: Array,
    values_bt: Array,
    mask_bt: Array,
    gamma: float | Array = 1.0,
    lam: float | Array = 1.0,
) -> tuple[Array, Array]:
  """Generalised advantage estimation (Schulman et al. 2016) over tokens.

    delta_t = r_t + gamma · V_{t+1} - V_t,   V after the last valid token = 0
    A_t     = sum_{l>=0} (gamma · lam)^l · delta_{t+l}
    R_t     = A_t + V_t                      (the critic's regression target)

  Padding positions are skipped by the recursion (see `_reverse_gae_scan`).
  With gamma = lam = 1, A_t = sum_{s>=t} r_s - V_t.

  Args:
    rewards_bt: [B, T] per-token rewards (see `token_level_rewards`).
    values_bt: [B, T] critic values V(s_t) (treated as constants).
    mask_bt: [B, T] valid response tokens.
    gamma: discount. lam: GAE λ. Both may be Python floats or traced scalars.

  Returns:
    (advantages_bt, returns_bt), both [B, T] and zero outside the mask.
  """
  values_bt = jax.lax.stop_gradient(as_float(values_bt))
  adv_bt = _reverse_gae_scan(rewards_bt, values_bt, mask_bt, gamma, lam)
  returns_bt = (adv_bt + values_bt) * as_mask(mask_bt, adv_bt)
  return adv_bt, returns_bt


def discounted_returns(rewards_bt: Array, mask_bt: Array, gamma: float | Array = 1.0) -> Array:
  """Return-to-go over valid tokens: G_t = r_t + gamma · G_{t'}.

  t' is the next valid token (none → 0), so for right-padded masks this is the
  usual G_t = sum_{s>=t} gamma^{s-t} r_s. Equals `gae` with V = 0, lam = 1.

  Args: rewards_bt, mask_bt: [B, T]. Returns: returns_bt [B, T] (0 outside
  the mask).
  """
  rewards_bt = as_float(rewards_bt)
  return _reverse_gae_scan(rewards_bt, jnp.zeros_like(rewards_bt), mask_bt, gamma, 1.0)


def whiten(x_bt: Array, mask_bt: Array, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
  """Normalises ``x`` over its valid entries (all of them, batch-wide).

    y = (x - mean) / sqrt(var + eps)          (shift_mean=True)
    y = (x - mean) / sqrt(var + eps) + mean   (shift_mean=False: scale only)

  mean and the population variance are taken over entries where the mask is
  set; the output is zero outside the mask. Batch-wide statistics: a stream
  pipeline that sees samples one by one cannot compute these until the batch
  is complete.
  """
  x_bt = as_float(x_bt)
  m = as_mask(mask_bt, x_bt)
  mean = masked_mean(x_bt, m)
  var = masked_var(x_bt, m)
  y = (x_bt - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    y = y + mean
  return y * m


def _check_groups(rewards_b: Array, group_size: int) -> int:
  """Validates the [G * K] layout; returns K as a Python int."""
  try:
    k = operator.index(group_size)  # accepts numpy ints, rejects floats/tracers
  except TypeError:
    k = 0
  if k < 1:
    raise ValueError(
        f"group_size must be a positive integer known at trace time, got "
        f"{group_size!r}; pass the number of samples per prompt "
        "(config: rl.group_size) as a static argument."
    )
  group_size = k
  if rewards_b.ndim != 1 or rewards_b.shape[0] % group_size:
    raise ValueError(
        f"rewards_b has shape {rewards_b.shape}, which is not a flat batch of "
        f"whole groups of {group_size}; lay the batch out as [G * K] with the "
        "K samples of each prompt next to each other."
    )
  return k


def grpo_advantages(
    rewards_b: Array,
    group_size: int,
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
    std_ddof: int = 1,
) -> Array:
  """Group-relative advantages (GRPO, Shao et al. 2024).

  The batch is G contiguous groups of K = group_size samples of one prompt:

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     (normalize_std=True)
    A_i =  r_i - mean_g(r)                          (normalize_std=False,
                                                     Dr. GRPO, Liu et al. 2025)

  std_g uses ``std_ddof`` (1 = unbiased, as torch.std in TRL/verl); for
  K = 1 the denominator is clamped so the advantage is simply 0. Groups whose
  rewards are all identical get exactly 0 (not a rounding residue divided by
  eps).

  Args:
    rewards_b: [B] sequence rewards, B = G * K.
    group_size: K (static).
  Returns:
    advantages_b: [B].
  """
  rewards_b = as_float(rewards_b)
  group_size = _check_groups(rewards_b, group_size)
  r_gk = rewards_b.reshape(-1, group_size)
  centered_gk = r_gk - jnp.mean(r_gk, axis=-1, keepdims=True)
  same_g1 = (jnp.max(r_gk, -1) == jnp.min(r_gk, -1))[:, None]
  centered_gk = jnp.where(same_g1, 0.0, centered_gk)
  if normalize_std:
    denom = max(group_size - std_ddof, 1)
    std_g1 = jnp.sqrt(jnp.sum(jnp.square(centered_gk), -1, keepdims=True) / denom)
    centered_gk = centered_gk / (std_g1 + eps)
  return centered_gk.reshape(-1)


def rloo_advantages(rewards_b: Array, group_size: int) -> Array:
  """REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024).

    A_i = r_i - (1 / (K - 1)) · sum_{j != i in group} r_j
        = K / (K - 1) · (r_i - mean_g(r))

  Args:
    rewards_b: [B] sequence rewards as G contiguous groups of K = group_size
      (K >= 2; the baseline needs another sample of the same prompt). Fold a
      sequence-level KL penalty into the reward before calling if wanted.
  Returns:
    advantages_b: [B].
  """
  rewards_b = as_float(rewards_b)
  group_size = _check_groups(rewards_b, group_size)
  if group_size < 2:
    raise ValueError(
        "RLOO needs at least 2 samples per prompt for its leave-one-out "
        f"baseline, got group_size={group_size}; raise rl.group_size."
    )
  r_gk = rewards_b.reshape(-1, group_size)
  baseline_gk = (jnp.sum(r_gk, -1, keepdims=True) - r_gk) / (group_size - 1)
  adv_gk = r_gk - baseline_gk
  same_g1 = (jnp.max(r_gk, -1) == jnp.min(r_gk, -1))[:, None]
  return jnp.where(same_g1, 0.0, adv_gk).reshape(-1)


def reinforce_pp_advantages(
    rewards_bt: Array, mask_bt: Array, gamma: float | Array = 1.0
) -> tuple[Array, Array]:
  """REINFORCE++ advantages (Hu 2025).

    G_t = sum_{s>=t} gamma^{s-t} r_s      r_s = score·[s last] - β·KL_s
    A   = whiten(G) over all valid tokens of the batch

  The per-token KL penalty must already be in ``rewards_bt`` (build it with
  `token_level_rewards`); no critic and no group structure is needed.

  Args:
    rewards_bt: [B, T] token rewards incl. the KL penalty.
    mask_bt: [B, T] valid response tokens.
    gamma: discount.
  Returns:
    (advantages_bt, returns_bt): whitened advantages and the raw return-to-go,
    both [B, T], zero outside the mask.
  """
  returns_bt = discounted_returns(rewards_bt, mask_bt, gamma)
  return whiten(returns_bt, mask_bt), returns_bt


# ----------------------------------------------------------------------------
# Registry: one signature for all estimators
# ----------------------------------------------------------------------------


class AdvantageEstimator(Protocol):
  """Uniform signature of the entries of `ADVANTAGE_ESTIMATORS`.

  Args:
    rewards_bt: [B, T] token rewards (`token_level_rewards`). Outcome
      estimators (grpo, rloo) use the per-sequence sum over valid tokens,
      i.e. the score minus β·(sequence KL) when a KL penalty is folded in.
    mask_bt: [B, T] valid response tokens.
    values_bt: [B, T] critic values; required by "gae", ignored otherwise.
    group_size: samples per prompt, contiguous in the batch (grpo, rloo).
    gamma, lam: discount and GAE λ (gae; reinforce_pp uses gamma).
    eps, normalize_std: GRPO's std normalisation.
  Returns:
    (advantages_bt, returns_bt), [B, T], zero outside the mask. returns_bt is
    the critic target for "gae", the raw return-to-go for "reinforce_pp" and
    the sequence reward broadcast to tokens for "grpo"/"rloo".
  """

  def __call__(
      self,
      rewards_bt: Array,
      mask_bt: Array,
      *,
      values_bt: Array | None = None,
      group_size: int = 1,
      gamma: float | Array = 1.0,
      lam: float | Array = 1.0,
      eps: float = 1e-6,
      normalize_std: bool = True,
  ) -> tuple[Array, Array]:
    ...


def _gae_estimator(
    rewards_bt,
    mask_bt,
    *,
    values_bt=None,
    group_size=1,
    gamma=1.0,
    lam=1.0,
    eps=1e-6,
    normalize_std=True,
):
  del group_size, eps, normalize_std
  if values_bt is None:
    raise ValueError(
        "The 'gae' advantage estimator needs critic values "
        "(values_bt); enable the critic or pick 'grpo', 'rloo' "
        "or 'reinforce_pp'."
    )
  return gae(rewards_bt, values_bt, mask_bt, gamma, lam)


def _outcome(fn, rewards_bt, mask_bt):
  """Sums token rewards per sequence, applies ``fn`` [B] -> [B], broadcasts."""
  rewards_bt = as_float(rewards_bt)
  rewards_b = jnp.sum(rewards_bt * as_mask(mask_bt, rewards_bt), axis=-1)
  adv_b = fn(rewards_b)
  return (sequence_to_tokens(adv_b, mask_bt), sequence_to_tokens(rewards_b, mask_bt))


def _grpo_estimator(
    rewards_bt,
    mask_bt,
    *,
    values_bt=None,
    group_size=1,
    gamma=1.0,
    lam=1.0,
    eps=1e-6,
    normalize_std=True,
):
  del values_bt, gamma, lam
  return _outcome(
      lambda r: grpo_advantages(r, group_size, eps=eps, normalize_std=normalize_std),
      rewards_bt,
      mask_bt,
  )


def _rloo_estimator(
    rewards_bt,
    mask_bt,
    *,
    values_bt=None,
    group_size=1,
    gamma=1.0,
    lam=1.0,
    eps=1e-6,
    normalize_std=True,
):
  del values_bt, gamma, lam, eps, normalize_std
  return _outcome(lambda r: rloo_advantages(r, group_size), rewards_bt, mask_bt)


def _reinforce_pp_estimator(
    rewards_bt,
    mask_bt,
    *,
    values_bt=None,
    group_size=1,
    gamma=1.0,
    lam=1.0,
    eps=1e-6,
    normalize_std=True,
):
  del values_bt, group_size, lam, eps, normalize_std
  return reinforce_pp_advantages(rewards_bt, mask_bt, gamma)


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": _gae_estimator,
    "grpo": _grpo_estimator,
    "rloo": _rloo_estimator,
    "reinforce_pp": _reinforce_pp_estimator,
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
  """Looks up an estimator of `ADVANTAGE_ESTIMATORS` by name."""
  try:
    return ADVANTAGE_ESTIMATORS[name]
  except KeyError:
    raise ValueError(
        f"Unknown advantage estimator {name!r}; set it to one of "
        f"{sorted(ADVANTAGE_ESTIMATORS)}."
    ) from None
