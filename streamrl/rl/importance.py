"""Truncated importance weights between the sampler and the trainer.

The tokens of a rollout were sampled by a generator whose distribution μ is
not exactly the trainer's π_old:

* numerics: the generator runs in bf16 with other kernels (vLLM on GPU), so
  even with identical weights log μ(x) ≠ log π_old(x) token by token;
* staleness: in async / stream pipelines a sample may come from weights that
  are k versions older than the ones the trainer computes π_old with.

PPO's ratio π_θ / π_old then no longer corrects for the sampling
distribution. Truncated importance sampling (TIS; Espeholt et al. 2018's
truncation, as used for rollout/trainer mismatch by Yao et al. 2025) multiplies
each token's loss by

    w = min(π_old(x) / μ(x), cap)

with no gradient through w. ``level="sequence"`` uses one weight per
sequence, w_b = min(prod_t π_old / μ, cap) (unbiased for sequence-level
objectives but high variance — hence the cap).

Shapes: [B, T] with ``mask_bt`` 1 on valid response tokens. All functions are
jit-safe; ``level`` is static, ``cap`` may be traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from streamrl.rl.kl import kl_k3
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
    raise ValueError(f"Unknown importance-weight level {level!r}; set it to "
                     f"one of {list(IS_LEVELS)}.")
  log_ratio_bt, m = _log_ratio(trainer_logp_bt, generator_logp_bt, mask_bt)
  log_cap = jnp.log(jnp.asarray(cap, log_ratio_bt.dtype))
  if level == "token":
    w_bt = jnp.exp(jnp.minimum(log_ratio_bt, log_cap))
  else:
    log_ratio_b = jnp.sum(log_ratio_bt, axis=-1, keepdims=True)
    w_bt = jnp.broadcast_to(jnp.exp(jnp.minimum(log_ratio_b, log_cap)),
                            log_ratio_bt.shape)
  return jax.lax.stop_gradient(w_bt * m)


def staleness_is_weights(
    current_logp_bt: Array,
    behaviour_logp_bt: Array,
    mask_bt: Array,
    cap: float | Array = 2.0,
    level: str = "token",
) -> Array:
  """Off-policy correction for samples generated with older weights.

  In an async pipeline, a sample generated under weight version v - k
  reaches a trainer at version v. ``behaviour_logp_bt`` are the logprobs the
  generator recorded at sampling time (version v - k), ``current_logp_bt`` the
  trainer's logprobs of the same tokens at version v (π_old for this update).
  The correction is exactly `truncated_is_weights`: one weight covers both
  the staleness and the bf16/kernel mismatch, since the generator's
  recorded logprobs are the true sampling distribution. Returns [B, T].
  """
  return truncated_is_weights(current_logp_bt, behaviour_logp_bt, mask_bt,
                              cap, level)


def staleness_mask_b(weight_version_b: Array, current_version: int | Array,
                     max_staleness: int) -> Array:
  """1.0 for samples at most ``max_staleness`` versions behind, else 0.0: [B].

  Samples older than the bound are dropped (masked) rather than reweighted,
  since their importance weights would be mostly truncated anyway.
  """
  lag_b = jnp.asarray(current_version) - jnp.asarray(weight_version_b)
  return (lag_b <= max_staleness).astype(jnp.float32)


def importance_metrics(
    trainer_logp_bt: Array,
    generator_logp_bt: Array,
    mask_bt: Array,
    cap: float | Array = 2.0,
) -> dict[str, Array]:
  """Diagnostics of the generator/trainer mismatch (token level), for logging.

  Returns is_weight_mean (of the untruncated token ratio), is_capped_frac
  (share of valid tokens whose ratio exceeds cap), mismatch_kl (k3 estimate
  of KL(μ || π_trainer), tokens sampled from the generator μ) and
  log_ratio_abs_max.
  """
  log_ratio_bt, m = _log_ratio(trainer_logp_bt, generator_logp_bt, mask_bt)
  # Clamped only so one absurd token can't make the logged means inf.
  clamped_bt = jnp.minimum(log_ratio_bt, 20.0)
  ratio_bt = jnp.exp(clamped_bt)
  metrics = {
      "is_weight_mean": masked_mean(ratio_bt, m),
      "is_capped_frac": masked_mean(ratio_bt > cap, m),
      # k3 with q = μ (sampler), p = π_trainer: log(p/q) = log_ratio.
      "mismatch_kl": masked_mean(
          kl_k3(jnp.zeros_like(clamped_bt), clamped_bt), m),
      "log_ratio_abs_max": jnp.max(jnp.abs(log_ratio_bt)),
  }
  return jax.lax.stop_gradient(metrics)
