"""Per-token KL estimators.

Tokens are sampled from the current policy q (``logp_bt`` = log q(x_t)) and
we estimate KL(q || p) to a reference p (``ref_logp_bt`` = log p(x_t)) from
the sampled token alone (Schulman, "Approximating KL divergence", 2020).
With r = p(x) / q(x) = exp(ref_logp - logp):

  k1 = -log r = logp - ref_logp          unbiased, high variance, can be < 0
  k2 = 0.5 (log r)^2                     biased, low variance, >= 0
  k3 = (r - 1) - log r                   unbiased, low variance, >= 0

All functions are elementwise on [B, T] (any shape works) and jit-safe.
Gradients flow through ``logp_bt``; wrap with ``jax.lax.stop_gradient`` when
the KL is used as a reward rather than as a loss.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from streamrl.rl.masked import as_float

Array = jax.Array


def kl_k1(logp_bt: Array, ref_logp_bt: Array) -> Array:
  """k1 = logp - ref_logp, [B, T]. Unbiased for KL(q||p); may be negative."""
  return as_float(logp_bt) - as_float(ref_logp_bt)


def kl_k2(logp_bt: Array, ref_logp_bt: Array) -> Array:
  """k2 = 0.5 (logp - ref_logp)^2, [B, T]. Always >= 0; biased (low when q≈p)."""
  return 0.5 * jnp.square(as_float(logp_bt) - as_float(ref_logp_bt))


def kl_k3(logp_bt: Array, ref_logp_bt: Array) -> Array:
  """k3 = exp(ref - logp) - (ref - logp) - 1, [B, T]. Unbiased and >= 0.

  Uses expm1 so the result stays >= 0 and accurate for tiny log-ratios
  (exp(d) - 1 - d computed naively cancels to noise in float32).
  """
  d = as_float(ref_logp_bt) - as_float(logp_bt)
  return jnp.expm1(d) - d


KL_ESTIMATORS: dict[str, Callable[[Array, Array], Array]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def get_kl_estimator(name: str) -> Callable[[Array, Array], Array]:
  """Looks up a per-token KL estimator (k1, k2, k3) by name."""
  try:
    return KL_ESTIMATORS[name]
  except KeyError:
    raise ValueError(
        f"Unknown KL estimator {name!r}; set it to one of " f"{sorted(KL_ESTIMATORS)}."
    ) from None
