"""RL math as small pure jax.numpy functions: advantages, losses, KL, rollout correction,
DAPO's group filter and overlong penalty.

`from streamrl import rl; rl.grpo_advantages(...)`: each name below is imported
from its submodule when first used. The package is imported whenever the
settings are read (`streamrl.rl.config`), the launcher's process included,
which only plans and starts actors and never loads JAX.
"""

import importlib

_EXPORTS = {
    "advantages": """ADVANTAGE_ESTIMATORS discounted_returns gae get_advantage_estimator
        grpo_advantages reinforce_pp_advantages rloo_advantages sequence_to_tokens
        token_level_rewards whiten""",
    "dapo": "group_keep_mask groups_to_train overlong_penalty",
    "importance": """ROLLOUT_CORRECTIONS mismatch_metrics rollout_correction_weights
        truncated_is_weights""",
    "kl": "KL_ESTIMATORS get_kl_estimator kl_k1 kl_k2 kl_k3",
    "losses": "AGG_MODES aggregate explained_variance kl_loss ppo_policy_loss value_loss",
    "masked": "masked_mean masked_var",
}
_SUBMODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names.split()}

__all__ = sorted(_SUBMODULE_OF)


def __getattr__(name: str):
  if name not in _SUBMODULE_OF:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  value = getattr(importlib.import_module(f"{__name__}.{_SUBMODULE_OF[name]}"), name)
  globals()[name] = value  # Found here once; later uses skip __getattr__.
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
