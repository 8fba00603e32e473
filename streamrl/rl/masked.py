"""Masked reductions shared by the RL math.

Conventions for the whole `streamrl.rl` package:

* ``B`` is the number of sequences, ``T`` the number of response tokens
  (right-padded), ``V`` the vocabulary size.
* ``mask_bt`` is 1 (or True) on valid response tokens and 0 elsewhere. Bool,
  int and float masks are all accepted.
* Every division by a token or sequence count is guarded with ``max(count, 1)``
  so an all-padding batch (possible when a jitted step is fed a padded
  micro-batch) yields 0 instead of NaN.
* Math runs in at least float32: bf16 logprobs from a generator are upcast
  first, because the differences of logprobs are where bf16 loses everything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def as_float(x: jax.typing.ArrayLike) -> Array:
  """Returns ``x`` as a float array of at least float32 precision."""
  x = jnp.asarray(x)
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def as_mask(mask: jax.typing.ArrayLike, like: Array) -> Array:
  """Returns ``mask`` as 0/1 floats in the dtype of ``like``."""
  return (jnp.asarray(mask) != 0).astype(like.dtype)


def safe_count(count: Array) -> Array:
  """max(count, 1): the denominator used for every masked mean."""
  return jnp.maximum(count, 1.0)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """sum(x * mask) / max(sum(mask), 1) over ``axis``; 0 when mask is empty."""
  x = as_float(x)
  m = as_mask(mask, x)
  return jnp.sum(x * m, axis=axis) / safe_count(jnp.sum(m, axis=axis))


def masked_var(x: Array, mask: Array) -> Array:
  """Population variance of the valid entries of ``x`` (over all axes).

  var = sum(mask * (x - mean)^2) / max(sum(mask), 1). Population (ddof=0)
  rather than unbiased so that a single valid entry gives 0, not a division
  by zero.
  """
  x = as_float(x)
  m = as_mask(mask, x)
  mean = masked_mean(x, m)
  return jnp.sum(m * jnp.square(x - mean)) / safe_count(jnp.sum(m))
