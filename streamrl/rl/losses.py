"""Policy, value and KL losses and loss aggregation (pure jax.numpy).

Shapes: ``B`` sequences, ``T`` response tokens, ``V`` vocabulary;
``mask_bt`` is 1 on valid response tokens. Every loss returns
``(scalar_loss, metrics)`` where ``metrics`` is a flat dict of scalars under
``stop_gradient``, so it can be returned as ``aux`` from
``jax.value_and_grad(..., has_aux=True)`` inside a jitted step. String and
``None``-valued options (``agg``, ``dual_clip``, ``clip``) are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl.rl.kl import get_kl_estimator, kl_k3
from streamrl.rl.masked import as_float, as_mask, masked_mean, safe_count

Array = jax.Array

# exp() of a log-ratio beyond this is treated as this: the token is far outside
# any clip range, and an inf ratio would turn a zero gradient into 0 * inf = NaN.
MAX_LOG_RATIO = 20.0

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")


def aggregate(
    x_bt: Array, mask_bt: Array, mode: str = "token_mean", norm_constant: float | None = None
) -> Array:
  """Reduces a per-token quantity to a scalar.

  Modes (n_b = valid tokens of sequence b, S = sequences with n_b > 0):

    token_mean            sum_{b,t} m·x / sum_{b,t} m          (every token
                          weighs the same; long answers dominate)
    seq_mean_token_mean   (1/|S|) sum_{b in S} (sum_t m·x / n_b)  (every
                          sequence weighs the same; GRPO paper)
    seq_mean_token_sum    (1/|S|) sum_{b in S} sum_t m·x
    token_sum_norm        sum_{b,t} m·x / (B · norm_constant)  (Dr. GRPO:
                          a constant normaliser, no length bias;
                          norm_constant defaults to T)

  ``norm_constant`` may also be a traced scalar: with gradient accumulation,
  token_sum_norm with norm_constant = (valid tokens of the whole batch) / B
  reproduces the whole batch's token_mean exactly when the micro-batch losses
  are summed.

  Counts are clamped to >= 1, so an all-padding input gives 0. Fully padded
  rows do not count as sequences in the seq_* modes (a jitted step may pad
  the batch with empty rows).

  Args:
    x_bt: [B, T] per-token values. mask_bt: [B, T]. mode: one of AGG_MODES
      (static). norm_constant: float or traced scalar for token_sum_norm.
  Returns:
    scalar.
  """
  x_bt = as_float(x_bt)
  m = as_mask(mask_bt, x_bt)
  if mode == "token_mean":
    return masked_mean(x_bt, m)
  if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
    n_b = jnp.sum(m, axis=-1)
    seq_b = jnp.sum(x_bt * m, axis=-1)
    if mode == "seq_mean_token_mean":
      seq_b = seq_b / safe_count(n_b)
    has_tokens_b = (n_b > 0).astype(x_bt.dtype)
    return jnp.sum(seq_b * has_tokens_b) / safe_count(jnp.sum(has_tokens_b))
  if mode == "token_sum_norm":
    b, t = x_bt.shape
    const = t if norm_constant is None else norm_constant
    if isinstance(const, (int, float)) and const <= 0:
      raise ValueError(
          f"norm_constant must be > 0, got {const}; set it to the " "maximum response length."
      )
    return jnp.sum(x_bt * m) / (b * const)
  raise ValueError(f"Unknown loss aggregation {mode!r}; set it to one of " f"{list(AGG_MODES)}.")


def ppo_policy_loss(
    logp_bt: Array,
    old_logp_bt: Array,
    advantages_bt: Array,
    mask_bt: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    is_weights_bt: Array | None = None,
    norm_constant: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  """PPO clipped surrogate (Schulman et al. 2017) with optional dual clip.

  Per valid token, with ρ = exp(logp - old_logp) and advantage A:

    L     = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))
    L     = min(L, c·|A|)  if A < 0 and dual_clip = c > 1   (Ye et al. 2020)
    L     = w · L          with truncated IS weights w (stop-gradient), if any

  and the loss is `aggregate(L, mask, agg)`. clip_high > clip_low gives
  DAPO's "clip-higher". The old logprobs, advantages and weights are
  constants; gradients reach only ``logp_bt``. Tokens in the clipped branch
  get zero gradient. Log-ratios are clamped to ±MAX_LOG_RATIO (see there).

  Args:
    logp_bt: [B, T] log π_θ(token) under the current parameters.
    old_logp_bt: [B, T] log π_old(token) (trainer, before this update).
    advantages_bt: [B, T].
    mask_bt: [B, T] valid response tokens.
    is_weights_bt: optional [B, T] weights, e.g. `truncated_is_weights`.
  Returns:
    (loss, metrics) with metrics policy_loss, clip_frac (token share where the
    clipped branch is active), approx_kl (k3 estimate of KL(π_old || π_θ)),
    ratio_mean, ratio_max, and dual_clip_frac when dual_clip is set.
  """
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(
        f"dual_clip must be > 1 (Ye et al. use 3), got "
        f"{dual_clip}; or set it to None to disable it."
    )
  logp = as_float(logp_bt)
  old = jax.lax.stop_gradient(as_float(old_logp_bt)).astype(logp.dtype)
  adv = jax.lax.stop_gradient(as_float(advantages_bt)).astype(logp.dtype)
  m = as_mask(mask_bt, logp)
  valid = m > 0

  # Padding positions get log-ratio 0 so garbage logprobs there can't make
  # inf/NaN that would leak into gradients through the 0 mask.
  log_ratio = jnp.where(valid, logp - old, 0.0)
  ratio = jnp.exp(jnp.clip(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
  loss_unclipped = -adv * ratio
  loss_clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
  loss_bt = jnp.maximum(loss_unclipped, loss_clipped)
  metrics = {}
  if dual_clip is not None:
    cap = -adv * dual_clip  # = c·|A| where A < 0
    dual_active = (adv < 0) & (cap < loss_bt)
    loss_bt = jnp.where(adv < 0, jnp.minimum(loss_bt, cap), loss_bt)
    metrics["dual_clip_frac"] = masked_mean(dual_active, m)
  if is_weights_bt is not None:
    loss_bt = loss_bt * jax.lax.stop_gradient(as_float(is_weights_bt))
  loss = aggregate(loss_bt, m, agg, norm_constant)

  metrics["policy_loss"] = loss
  metrics["clip_frac"] = masked_mean(loss_clipped > loss_unclipped, m)
  metrics["approx_kl"] = masked_mean(kl_k3(old, logp), m)
  metrics["ratio_mean"] = masked_mean(ratio, m)
  metrics["ratio_max"] = jnp.max(jnp.where(valid, ratio, 0.0))
  return loss, jax.lax.stop_gradient(metrics)


def explained_variance(values_bt: Array, returns_bt: Array, mask_bt: Array) -> Array:
  """1 - Var[returns - values] / Var[returns] over valid tokens (0 if Var[returns] = 0).

  1 means the critic predicts the returns perfectly, 0 no better than a
  constant, negative worse than a constant.
  """
  v = as_float(values_bt)
  r = as_float(returns_bt).astype(v.dtype)
  m = as_mask(mask_bt, v)

  def var(x):
    mean = masked_mean(x, m)
    return masked_mean(jnp.square(x - mean), m)

  var_r = var(r)
  ev = 1.0 - var(r - v) / jnp.where(var_r > 0, var_r, 1.0)
  return jnp.where(var_r > 0, ev, 0.0)


def value_loss(
    values_bt: Array,
    old_values_bt: Array,
    returns_bt: Array,
    mask_bt: Array,
    clip: float | None = 0.2,
    agg: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  """Clipped critic loss (PPO2 style).

    V_clip = V_old + clip(V - V_old, -clip, clip)
    L      = 0.5 · max((V - R)^2, (V_clip - R)^2)      (clip=None: 0.5 (V-R)^2)

  aggregated with `aggregate(L, mask, agg)`. Gradients reach only
  ``values_bt``.

  Args:
    values_bt: [B, T] current critic values. old_values_bt: [B, T] values at
      rollout time. returns_bt: [B, T] targets (e.g. from `gae`).
  Returns:
    (loss, metrics) with value_loss, vf_clip_frac, value_mean, returns_mean,
    explained_variance.
  """
  v = as_float(values_bt)
  old = jax.lax.stop_gradient(as_float(old_values_bt)).astype(v.dtype)
  ret = jax.lax.stop_gradient(as_float(returns_bt)).astype(v.dtype)
  m = as_mask(mask_bt, v)
  err_unclipped = jnp.square(v - ret)
  metrics = {}
  if clip is None:
    err = err_unclipped
    metrics["vf_clip_frac"] = jnp.zeros((), v.dtype)
  else:
    v_clipped = old + jnp.clip(v - old, -clip, clip)
    err_clipped = jnp.square(v_clipped - ret)
    err = jnp.maximum(err_unclipped, err_clipped)
    metrics["vf_clip_frac"] = masked_mean(err_clipped > err_unclipped, m)
  loss = 0.5 * aggregate(err, m, agg, norm_constant)
  metrics["value_loss"] = loss
  metrics["value_mean"] = masked_mean(v, m)
  metrics["returns_mean"] = masked_mean(ret, m)
  metrics["explained_variance"] = explained_variance(v, ret, m)
  return loss, jax.lax.stop_gradient(metrics)


def kl_loss(
    logp_bt: Array,
    ref_logp_bt: Array,
    mask_bt: Array,
    *,
    estimator: str = "k3",
    agg: str = "token_mean",
    norm_constant: float | None = None,
) -> tuple[Array, dict[str, Array]]:
  """KL(π_θ || π_ref) as a loss term (GRPO style): aggregate(k(logp, ref)).

  Gradients reach ``logp_bt`` only. Multiply by the KL coefficient outside.
  Returns (loss, {"kl_loss": loss}).
  """
  ref = jax.lax.stop_gradient(as_float(ref_logp_bt))
  kl_bt = get_kl_estimator(estimator)(logp_bt, ref)
  loss = aggregate(kl_bt, mask_bt, agg, norm_constant)
  return loss, {"kl_loss": jax.lax.stop_gradient(loss)}
