"""Rollout correction: importance weights between the sampler and the trainer.

The tokens of a rollout were sampled by a generator whose distribution μ is
not exactly the trainer's π_old:

* numerics: the generator runs in bf16 with other kernels (vLLM on GPU), so
  even with identical weights log μ(x) ≠ log π_old(x) token by token;
* staleness: in async / stream pipelines a sample may come from weights that
  are k versions older than the ones the trainer computes π_old with.

PPO's ratio π_θ / π_old then no longer corrects for the sampling
distribution. `rollout_correction_weights` gives each token's loss a weight
without gradient:

* "tis", truncated importance sampling (Espeholt et al. 2018's truncation, as
  used for rollout/trainer mismatch by Yao et al. 2025):
  w = min(π_old(x) / μ(x), cap) per token (`truncated_is_weights`;
  ``level="sequence"`` uses w_b = min(prod_t π_old / μ, cap) instead);
* "mis", masked importance sampling: a sequence whose geometric-mean ratio
  falls outside [1 / threshold, threshold] gets weight 0, the others 1.

`mismatch_metrics` measures the gap for logging.

Shapes: [B, T] with ``mask_bt`` 1 on valid response tokens. All functions are
jit-safe; ``mode`` and ``level`` are static, ``cap`` and the threshold may be
traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl.rl.kl import kl_k3
from streamrl.rl.losses import MAX_LOG_RATIO
from streamrl.rl.masked import as_float, as_mask, masked_mean

Array = jax.Array

IS_LEVELS = ("token", "sequence")


def _log_ratio(trainer_logp_bt, generator_logp_bt, mask_bt):
  trainer = as_float(trainer_logp_bt)
  generator = as_float(generator_logp_bt).astype(trainer.dtype)
  m = as_mask(mask_bt, trainer)
  # where, not multiply: padding may hold -inf logprobs and inf * 0 = NaN.
  return jnp.where(m > 0, trainer - generator, 0.0), m


def truncated_is_weights(
    trainer_logp_bt: Array,
    generator_logp_bt: Array,
    mask_bt: Array,
    cap: float | Array = 2.0,
    level: str = "token",
) -> Array:
  """Truncated importance weights π_trainer / π_generator, capped at ``cap``.

    token:    w_bt = min(exp(trainer_logp_bt - generator_logp_bt), cap)
    sequence: w_b  = min(exp(sum_t mask · (trainer - generator)), cap),
              broadcast to the sequence's valid tokens

  The exponent is clamped at log(cap) before exp, so huge log-ratios give
  ``cap`` rather than inf. Weights are 0 outside the mask and carry no
  gradient (they are constants in the loss; pass them as ``is_weights_bt`` to
  `streamrl.rl.losses.ppo_policy_loss`).

  Args:
    trainer_logp_bt: [B, T] trainer logprobs of the sampled tokens (π_old,
      computed by the trainer before the update).
    generator_logp_bt: [B, T] logprobs the generator reported when sampling
      (vLLM's processed logprobs).
    mask_bt: [B, T] valid response tokens.
    cap: truncation level C > 0.
    level: "token" or "sequence" (static).
  Returns:
    weights_bt: [B, T].
  """
  if level not in IS_LEVELS:
    raise ValueError(
        f"Unknown importance-weight level {level!r}; set it to " f"one of {list(IS_LEVELS)}."
    )
  log_ratio_bt, m = _log_ratio(trainer_logp_bt, generator_logp_bt, mask_bt)
  log_cap = jnp.log(jnp.asarray(cap, log_ratio_bt.dtype))
  if level == "token":
    w_bt = jnp.exp(jnp.minimum(log_ratio_bt, log_cap))
  else:
    log_ratio_b = jnp.sum(log_ratio_bt, axis=-1, keepdims=True)
    w_bt = jnp.broadcast_to(jnp.exp(jnp.minimum(log_ratio_b, log_cap)), log_ratio_bt.shape)
  return jax.lax.stop_gradient(w_bt * m)


ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def rollout_correction_weights(
    old_logp_bt: Array,
    gen_logp_bt: Array,
    mask_bt: Array,
    mode: str = "none",
    *,
    is_cap: float | Array = 2.0,
    mis_threshold: float | Array = 2.0,
    level: str = "token",
) -> Array:
  """Per-token loss weights that correct for the trainer/generator mismatch.

  With d_bt = old_logp_bt - gen_logp_bt on valid tokens:

    none  1
    tis   min(exp(d_bt), is_cap): `truncated_is_weights` (``level`` applies)
    mis   1 if exp(mean_t d_bt) of the sequence lies in
          [1 / mis_threshold, mis_threshold], else 0 for the whole sequence

  MIS drops a sequence whose geometric-mean ratio says it was sampled from a
  visibly different distribution, instead of reweighting its tokens. Every
  mode gives 0 on padding and no gradient.

  Args:
    old_logp_bt: [B, T] trainer logprobs of the sampled tokens (π_old).
    gen_logp_bt: [B, T] logprobs the generator reported.
    mask_bt: [B, T] valid response tokens.
    mode: one of ROLLOUT_CORRECTIONS (static).
    is_cap: truncation level of "tis".
    mis_threshold: ratio bound of "mis", >= 1.
    level: "token" or "sequence", for "tis" only (static).
  Returns:
    weights_bt: [B, T].
  """
  if mode not in ROLLOUT_CORRECTIONS:
    raise ValueError(
        f"Unknown rollout correction {mode!r}; set it to one of " f"{list(ROLLOUT_CORRECTIONS)}."
    )
  if mode == "tis":
    return truncated_is_weights(old_logp_bt, gen_logp_bt, mask_bt, is_cap, level)
  log_ratio_bt, m = _log_ratio(old_logp_bt, gen_logp_bt, mask_bt)
  if mode == "none":
    return m
  if isinstance(mis_threshold, (int, float)) and mis_threshold < 1:
    raise ValueError(f"mis_threshold must be >= 1, got {mis_threshold}.")
  mean_b = masked_mean(log_ratio_bt, m, axis=-1)
  log_threshold = jnp.log(jnp.asarray(mis_threshold, log_ratio_bt.dtype))
  keep_b = (jnp.abs(mean_b) <= log_threshold).astype(m.dtype)
  return jax.lax.stop_gradient(m * keep_b[:, None])


def mismatch_metrics(
    trainer_logp_bt: Array, gen_logp_bt: Array, mask_bt: Array
) -> dict[str, Array]:
  """How far the generator's logprobs are from the trainer's, for logging.

  With r = exp(trainer - gen) on valid tokens:

    k3_kl                 mean of r - 1 - log r (k3 estimate of
                          KL(generator || trainer), tokens from the generator)
    max_abs_logprob_diff  max |trainer - gen|
    is_weight_max         max r

  The log-ratio is clamped at ±MAX_LOG_RATIO for k3_kl and is_weight_max, so
  a single absurd token can't make them inf. All are 0 for an empty mask.
  Accepts numpy or jax arrays; returns scalars without gradient.
  """
  log_ratio_bt, m = _log_ratio(trainer_logp_bt, gen_logp_bt, mask_bt)
  clamped_bt = jnp.clip(log_ratio_bt, -MAX_LOG_RATIO, MAX_LOG_RATIO)
  valid = m > 0
  metrics = {
      "k3_kl": masked_mean(kl_k3(jnp.zeros_like(clamped_bt), clamped_bt), m),
      "max_abs_logprob_diff": jnp.max(jnp.abs(log_ratio_bt)),
      "is_weight_max": jnp.max(jnp.where(valid, jnp.exp(clamped_bt), 0.0)),
  }
  return jax.lax.stop_gradient(metrics)
