"""From finished samples to a training batch.

`pad_samples` lays samples out as right-padded [b, t] arrays aligned with the
model's logprobs (column t describes token t + 1), with lengths rounded by
`bucket_length` so few distinct shapes reach the jitted step. Once the
trainer has scored them (`RLTrainer.score`: old / reference logprobs,
values), `compute_advantages` turns rewards into token rewards (minus the KL
penalty when it lives in the reward), advantages and returns. It normalises
with the statistics of the batch it is given, so `RLTrainer.prepare` calls it
once per released chunk of samples (whole groups, for group estimators).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np

from streamrl import rl
from streamrl.rl.config import Advantage, Kl


def bucket_length(n: int, smallest: int = 32) -> int:
  """`n` rounded up to the next of smallest x (1, 1.5, 2, 3, 4, 6, 8, ...):
  lengths up to 512 fall in 9 buckets (32, 48, ..., 384, 512) instead of 16
  multiples of 32, so fewer distinct shapes reach the jitted programs, each
  bucket wasting at most a third of its length on padding."""
  power = smallest
  while True:
    for b in (power, power * 3 // 2):
      if b >= n:
        return b
    power *= 2


def pad_samples(
    samples: Sequence, seq_len: int | None = None, pad_id: int = 0, smallest: int = 32
) -> dict:
  """Samples (prompt_token_ids, token_ids, logprobs, mask) -> numpy [b, t]
  arrays, t = `seq_len` or the `bucket_length` (from `smallest`) of the longest."""
  total = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
  seq_len = seq_len or bucket_length(max(total), smallest)
  if max(total) > seq_len:
    raise ValueError(f"A sample has {max(total)} tokens, more than seq_len={seq_len}.")
  b = len(samples)
  tokens = np.full((b, seq_len), pad_id, np.int32)
  mask = np.zeros((b, seq_len), np.float32)
  gen_logp = np.zeros((b, seq_len), np.float32)
  for i, s in enumerate(samples):
    p, r = len(s.prompt_token_ids), len(s.token_ids)
    tokens[i, :p] = s.prompt_token_ids
    tokens[i, p : p + r] = s.token_ids
    # Column t predicts token t + 1: response tokens p..p+r-1 sit at p-1..p+r-2.
    # A trajectory's observation tokens (Sample.mask 0) are context, not actions.
    mask[i, p - 1 : p + r - 1] = 1.0 if s.mask is None else s.mask
    gen_logp[i, p - 1 : p + r - 1] = s.logprobs
  return {"tokens_bt": tokens, "mask_bt": mask, "gen_logp_bt": gen_logp}


@functools.partial(jax.jit, static_argnames=("advantage", "kl"))
def compute_advantages(batch: dict, scores_b: jax.Array, *, advantage: Advantage, kl: Kl) -> dict:
  """Token rewards (score at the last token, minus the KL penalty when
  `kl.in_reward`) -> advantages (`advantage.*`).

  Whitening uses the statistics of the whole batch passed in, so the stream
  pipeline calls this once per complete mini-batch (or group, for GRPO).
  """
  mask = batch["mask_bt"]
  penalty, coef = None, kl.reward_coef
  if coef:
    penalty = rl.get_kl_estimator(kl.estimator)(batch["old_logp_bt"], batch["ref_logp_bt"]) * mask
  rewards = rl.token_level_rewards(scores_b, mask, penalty, coef)
  estimator = rl.get_advantage_estimator(advantage.estimator)
  adv, returns = estimator(
      rewards,
      mask,
      values_bt=batch.get("old_values_bt"),
      group_size=advantage.group_size,
      gamma=advantage.gamma,
      lam=advantage.lam,
      normalize_std=advantage.normalize_std,
  )
  if advantage.whiten and advantage.estimator in ("gae",):
    adv = rl.whiten(adv, mask)
  out = {"advantages_bt": adv * mask, "returns_bt": returns * mask}
  if penalty is not None:
    out["kl_bt"] = penalty
  return out
