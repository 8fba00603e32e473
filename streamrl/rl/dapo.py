"""DAPO's reward-side pieces (Yu et al. 2025): dynamic sampling's group filter
and the soft overlong penalty.

`group_keep_mask` decides which prompt groups are worth training: a group
whose samples all got the same reward has zero advantage under the group
estimators (`grpo_advantages`, `rloo_advantages` give exactly 0 there), so it
only dilutes the loss. It runs on the host, between generation and training,
and steers what is generated next, so it is plain numpy (Python control flow
reads its result), unlike the jitted math of this package.

`overlong_penalty` is the reward shaping for responses near the length limit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def group_keep_mask(rewards_b, group_ids_b) -> tuple[np.ndarray, np.ndarray]:
  """Which groups have rewards that differ (dynamic sampling's filter).

    keep_g = max_{b in g} r_b != min_{b in g} r_b

  the same exact test by which `grpo_advantages` / `rloo_advantages` give a
  group all-zero advantages, so a kept group always has a nonzero one.

  Args:
    rewards_b: [B] the rewards the advantages will be computed from (shaped
      ones included).
    group_ids_b: [B] the group (prompt) of each sample, any integers, in any
      order.
  Returns:
    (groups_g, keep_g): the distinct group ids, sorted, and a bool [G] mask
    that is True where the group's rewards are not all equal. A group of one
    sample is never kept.
  """
  rewards_b = np.asarray(rewards_b, np.float64).reshape(-1)
  group_ids_b = np.asarray(group_ids_b).reshape(-1)
  if rewards_b.shape != group_ids_b.shape:
    raise ValueError(
        f"rewards_b has {rewards_b.size} entries and group_ids_b {group_ids_b.size}; "
        "pass one group id per reward."
    )
  groups_g, index_b = np.unique(group_ids_b, return_inverse=True)
  hi_g = np.full(groups_g.shape, -np.inf)
  lo_g = np.full(groups_g.shape, np.inf)
  np.maximum.at(hi_g, index_b, rewards_b)
  np.minimum.at(lo_g, index_b, rewards_b)
  return groups_g, hi_g != lo_g


def groups_to_train(num_kept: int, target: int, unit: int) -> tuple[int, int]:
  """How many groups an iteration trains when dynamic sampling may fall short.

  With at least `target` kept groups, the first `target`. Short of it (the
  bound on extra generation was hit), the kept groups rounded down to a
  multiple of `unit` (the fewest groups that fill whole mini-batches); with
  fewer than `unit` kept, all of them plus `unit - num_kept` dropped groups,
  so the iteration still trains one mini-batch.

  Returns:
    (kept groups to train, dropped groups to pad with).
  """
  if num_kept >= target:
    return target, 0
  whole = num_kept // unit * unit
  if whole:
    return whole, 0
  return num_kept, unit - num_kept


def overlong_penalty(
    lengths_b: jax.typing.ArrayLike, max_tokens: int, buffer: int, penalty: float
) -> jax.Array:
  """DAPO's soft overlong punishment, added to a response's reward.

  With L the response length, L_max = max_tokens, B = buffer, p = penalty:

    0                           L <= L_max - B
    -p · (L - (L_max - B)) / B  L_max - B < L < L_max
    -p                          L >= L_max

  Args:
    lengths_b: [B] response lengths in tokens.
    max_tokens: L_max (the sampling's `max_tokens`).
    buffer: B > 0 tokens before L_max where the penalty ramps up; 0 turns it off.
    penalty: p >= 0, the penalty at and beyond L_max.
  Returns:
    [B] float32 penalties, each in [-p, 0].
  """
  lengths_b = jnp.asarray(lengths_b, jnp.float32)
  if buffer <= 0:
    return jnp.zeros_like(lengths_b)
  over_b = (lengths_b - (max_tokens - buffer)) / buffer
  return -penalty * jnp.clip(over_b, 0.0, 1.0)
