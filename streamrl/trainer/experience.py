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

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from streamrl import rl
from streamrl.rl.config import Advantage, Kl

_ADVANTAGE, _KL = Advantage(), Kl()


def bucket_length(n: int, multiple: int = 32) -> int:
  """Rounds up so few distinct shapes reach the jitted step (fewer compiles)."""
  return max(multiple, -(-n // multiple) * multiple)


def pad_samples(samples: Sequence, seq_len: int | None = None, pad_id: int = 0) -> dict:
  """Samples (prompt_token_ids, token_ids, logprobs) -> numpy [b, t] arrays."""
  total = [len(s.prompt_token_ids) + len(s.token_ids) for s in samples]
  seq_len = seq_len or bucket_length(max(total))
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
    mask[i, p - 1 : p + r - 1] = 1.0
    gen_logp[i, p - 1 : p + r - 1] = s.logprobs
  return {"tokens_bt": tokens, "mask_bt": mask, "gen_logp_bt": gen_logp}


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
  """The advantage step's options; defaults from `advantage.*` and `kl.*`
  (streamrl/rl/config.py). kl_coef is the reward penalty's (0: none)."""

  estimator: str = _ADVANTAGE.estimator
  gamma: float = _ADVANTAGE.gamma
  lam: float = _ADVANTAGE.lam
  group_size: int = _ADVANTAGE.group_size
  kl_coef: float = 0.0
  kl_estimator: str = _KL.estimator
  kl_in_reward: bool = _KL.in_reward
  whiten: bool = _ADVANTAGE.whiten
  normalize_std: bool = True


@functools.partial(jax.jit, static_argnames=("cfg",))
def compute_advantages(batch: dict, scores_b: jax.Array, *, cfg: AdvantageConfig) -> dict:
  """Token rewards (score at the last token, minus a KL penalty) -> advantages.

  Whitening uses the statistics of the whole batch passed in, so the stream
  pipeline calls this once per complete mini-batch (or group, for GRPO).
  """
  mask = batch["mask_bt"]
  kl = None
  if cfg.kl_in_reward and cfg.kl_coef:
    kl = rl.get_kl_estimator(cfg.kl_estimator)(batch["old_logp_bt"], batch["ref_logp_bt"]) * mask
  rewards = rl.token_level_rewards(scores_b, mask, kl, cfg.kl_coef)
  estimator = rl.get_advantage_estimator(cfg.estimator)
  adv, returns = estimator(
      rewards,
      mask,
      values_bt=batch.get("old_values_bt"),
      group_size=cfg.group_size,
      gamma=cfg.gamma,
      lam=cfg.lam,
      normalize_std=cfg.normalize_std,
  )
  if cfg.whiten and cfg.estimator in ("gae",):
    adv = rl.whiten(adv, mask)
  out = {"advantages_bt": adv * mask, "returns_bt": returns * mask}
  if kl is not None:
    out["kl_bt"] = kl
  return out
