"""Losses for the output-length ranker (pure functions of scores and lengths)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOSSES = ("mse", "pairwise", "both")


def log_mse_loss(score_b: jax.Array, length_b: jax.Array, weight_b: jax.Array) -> jax.Array:
  """Weighted mean of (score - log1p(length))^2.

  Log space because lengths are long-tailed: an error of 10 tokens matters on
  a 20-token answer, not on a 2000-token one.

  Args:
    score_b: [B] model outputs; length_b: [B] true lengths; weight_b: [B] 0/1
      (0 on padding rows).
  Returns:
    scalar.
  """
  err_b = score_b - jnp.log1p(length_b.astype(score_b.dtype))
  return jnp.sum(weight_b * err_b**2) / jnp.maximum(jnp.sum(weight_b), 1.0)


def pairwise_logistic_loss(
    score_b: jax.Array, length_b: jax.Array, weight_b: jax.Array
) -> jax.Array:
  """RankNet loss over all ordered pairs in the batch with different lengths.

  mean over {(i, j): len_i > len_j} of log(1 + exp(-(s_i - s_j))). Pairs of
  equal length carry no ordering information and are skipped.

  Args:
    score_b, length_b, weight_b: [B] as in `log_mse_loss`.
  Returns:
    scalar.
  """
  diff_bb = score_b[:, None] - score_b[None, :]
  valid_bb = (
      (length_b[:, None] > length_b[None, :]) & (weight_b[:, None] > 0) & (weight_b[None, :] > 0)
  )
  valid_bb = valid_bb.astype(score_b.dtype)
  return jnp.sum(valid_bb * jax.nn.softplus(-diff_bb)) / jnp.maximum(jnp.sum(valid_bb), 1.0)


def ranker_loss(
    score_b: jax.Array,
    length_b: jax.Array,
    weight_b: jax.Array,
    kind: str,
    pair_weight: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The configured loss: "mse", "pairwise" or "both" (mse + pair_weight * pairwise).

  Returns (loss, {"mse": ..., "pairwise": ...}) — both terms are always
  reported so runs with different losses can be compared on the same axes.
  """
  if kind not in LOSSES:
    raise ValueError(f"ranker loss must be one of {LOSSES}, got {kind!r}; set config.loss.")
  mse = log_mse_loss(score_b, length_b, weight_b)
  pair = pairwise_logistic_loss(score_b, length_b, weight_b)
  loss = {"mse": mse, "pairwise": pair, "both": mse + pair_weight * pair}[kind]
  return loss, {"mse": mse, "pairwise": pair}
