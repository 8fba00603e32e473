"""The RL algorithm's settings: the advantage estimator (`advantage.*`), the
KL to the reference (`kl.*`) and the policy loss (`loss.*`)."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import need, one_of, positive

# The names of the estimators in streamrl/rl/ (whose modules import JAX, and
# reading the settings must not).
ADVANTAGES = ("gae", "grpo", "rloo", "reinforce_pp")
KLS = ("k1", "k2", "k3")
LOSS_AGGS = ("token_mean", "token_sum_norm", "seq_mean_token_mean", "seq_mean_token_sum")
ROLLOUT_CORRECTIONS = ("auto", "none", "tis", "mis")
IS_LEVELS = ("token", "sequence")


@dataclasses.dataclass(frozen=True)
class Advantage:
  """Advantage estimator; `group_size` samples per prompt."""

  estimator: str = "gae"
  gamma: float = 1.0
  lam: float = 0.95
  group_size: int = 1
  whiten: bool = True
  use_critic: bool = True
  # grpo: divide each group's centred scores by their std (False: Dr. GRPO's
  # unscaled advantages).
  normalize_std: bool = True
  # Dynamic sampling (DAPO): a prompt group whose rewards are all equal has zero
  # advantages, so it is dropped before training and samples of more prompts
  # take its place, from at most `filter_max_rounds` extra generation rounds per
  # iteration (streamrl/pipeline/dynamic_sampling.py).
  filter_groups: bool = False
  filter_max_rounds: int = 2

  def check(self) -> None:
    one_of("advantage.estimator", self.estimator, ADVANTAGES)
    need(self.group_size >= 1, f"advantage.group_size={self.group_size} must be >= 1.")
    need(
        self.estimator != "gae" or self.use_critic,
        "advantage.estimator='gae' needs a critic; set advantage.use_critic=True or use "
        "'grpo' / 'rloo' / 'reinforce_pp'.",
    )
    need(
        self.estimator not in ("grpo", "rloo") or self.group_size >= 2,
        f"advantage.estimator={self.estimator!r} compares samples of one prompt; set "
        "advantage.group_size >= 2.",
    )
    need(
        0 <= self.gamma <= 1 and 0 <= self.lam <= 1,
        "advantage.gamma and advantage.lam must be in [0, 1].",
    )
    need(
        not self.filter_groups or self.group_size >= 2,
        "advantage.filter_groups=True drops prompt groups whose samples all got the same "
        "reward, which needs several samples per prompt; set advantage.group_size >= 2 or "
        "advantage.filter_groups=False.",
    )
    need(
        self.filter_max_rounds >= 0,
        f"advantage.filter_max_rounds={self.filter_max_rounds} must be >= 0 (extra "
        "generation rounds per iteration); fix --config.advantage.filter_max_rounds.",
    )


@dataclasses.dataclass(frozen=True)
class Kl:
  """KL to a frozen reference: a reward penalty (PPO) or a loss term (GRPO)."""

  coef: float = 0.01
  estimator: str = "k1"
  in_reward: bool = True
  use_reference: bool = True

  @property
  def reward_coef(self) -> float:
    """The penalty's weight in the reward (0 without a reference or when it is a loss term)."""
    return self.coef if self.use_reference and self.in_reward else 0.0

  @property
  def loss_coef(self) -> float:
    """The KL term's weight in the policy loss (GRPO style; 0 otherwise)."""
    return self.coef if self.use_reference and not self.in_reward else 0.0

  def check(self) -> None:
    one_of("kl.estimator", self.estimator, KLS)
    positive("kl.coef", self.coef, zero_ok=True)
    need(
        not self.coef or self.use_reference,
        f"kl.coef={self.coef} needs the reference model; set kl.use_reference=True or "
        "kl.coef=0.",
    )


@dataclasses.dataclass(frozen=True)
class Loss:
  """The clipped policy loss, value loss and rollout correction.

  rollout_correction: none | tis (token-level truncated importance weights
  trainer/generator, capped at is_cap) | mis (drop samples whose per-token
  geometric-mean ratio leaves [1/mis_threshold, mis_threshold]) | auto (tis
  in async mode, where samples come from older weights; none otherwise).

  DAPO's overlong shaping: `overlong_buffer` > 0 adds a penalty to the reward
  of a response longer than sampling.max_tokens - overlong_buffer, growing
  linearly to -overlong_penalty at max_tokens (`rl.overlong_penalty`);
  `mask_truncated` leaves responses cut at max_tokens out of the loss.
  """

  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0
  agg: str = "token_mean"
  entropy_coef: float = 0.0
  vf_clip: float = 0.2
  rollout_correction: str = "auto"
  is_cap: float = 2.0
  # tis weights per token, or one per sequence (the product of its ratios, capped).
  is_level: str = "token"
  mis_threshold: float = 2.0
  overlong_buffer: int = 0  # tokens; 0: no overlong penalty
  overlong_penalty: float = 1.0
  mask_truncated: bool = False

  def resolved(self, mode: str) -> "Loss":
    """This loss with `rollout_correction="auto"` decided by the pipeline
    mode: tis in async mode (samples come from older weights), none otherwise."""
    if self.rollout_correction != "auto":
      return self
    return dataclasses.replace(self, rollout_correction="tis" if mode == "async" else "none")

  def check(self) -> None:
    positive("loss.clip_low", self.clip_low)
    positive("loss.clip_high", self.clip_high)
    need(
        self.dual_clip == 0 or self.dual_clip > 1,
        f"loss.dual_clip={self.dual_clip} must be 0 (off) or > 1.",
    )
    one_of("loss.agg", self.agg, LOSS_AGGS)
    positive("loss.entropy_coef", self.entropy_coef, zero_ok=True)
    positive("loss.vf_clip", self.vf_clip, zero_ok=True)
    one_of("loss.rollout_correction", self.rollout_correction, ROLLOUT_CORRECTIONS)
    need(self.is_cap >= 1, f"loss.is_cap={self.is_cap} must be >= 1.")
    one_of("loss.is_level", self.is_level, IS_LEVELS)
    need(self.mis_threshold > 1, f"loss.mis_threshold={self.mis_threshold} must be > 1.")
    positive("loss.overlong_buffer", self.overlong_buffer, zero_ok=True)
    positive("loss.overlong_penalty", self.overlong_penalty, zero_ok=True)
