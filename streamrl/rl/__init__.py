"""RL math as small pure jax.numpy functions: advantages, losses, KL, rollout correction,
DAPO's group filter and overlong penalty."""

from streamrl.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    discounted_returns,
    gae,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_to_tokens,
    token_level_rewards,
    whiten,
)
from streamrl.rl.dapo import group_keep_mask, groups_to_train, overlong_penalty
from streamrl.rl.importance import (
    ROLLOUT_CORRECTIONS,
    mismatch_metrics,
    rollout_correction_weights,
    truncated_is_weights,
)
from streamrl.rl.kl import KL_ESTIMATORS, get_kl_estimator, kl_k1, kl_k2, kl_k3
from streamrl.rl.losses import (
    AGG_MODES,
    aggregate,
    explained_variance,
    kl_loss,
    ppo_policy_loss,
    value_loss,
)
from streamrl.rl.masked import masked_mean, masked_var
