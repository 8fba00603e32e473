"""Config keys renamed in 0.1 → their names today (accepted until StreamRL 0.2.0).

Every config key is `<part>.<field>`, the attribute path that reads it
(`--config.pipeline.partial` is `s.pipeline.partial`). Keys from before that
layout still work everywhere a key is given — the command line, a config's
`get_sweep()`, a plan file, a saved config.json — and each old key prints
one line naming its new name, once per process.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

REMOVED_IN = "0.2.0"

OLD_TO_NEW = {
    "generation.temperature": "sampling.temperature",
    "generation.top_p": "sampling.top_p",
    "generation.max_tokens": "sampling.max_tokens",
    "generation.max_num_seqs": "engine.max_num_seqs",
    "generation.max_model_len": "engine.max_model_len",
    "generation.kv_cache_gib": "engine.kv_cache_gib",
    "generation.num_instances": "engine.num_instances",
    "generation.coalesce_s": "engine.coalesce_s",
    "cluster.engine_in_process": "engine.in_process",
    "generation.gpus_per_instance": "engine.gpus_per_instance",
    "generation.tensor_parallel_size": "engine.tensor_parallel_size",
    "generation.gpu_memory_utilization": "engine.gpu_memory_utilization",
    "generation.enforce_eager": "engine.enforce_eager",
    "generation.scheduler": "scheduler.kind",
    "generation.long_tail_alpha": "scheduler.long_tail_alpha",
    "generation.dispatch_objective": "scheduler.objective",
    "generation.dispatch_latency_model": "scheduler.latency_model",
    "generation.latency_profile": "scheduler.latency_profile",
    "generation.ranker_config": "scheduler.ranker_config",
    "generation.ranker_checkpoint": "scheduler.ranker_checkpoint",
    "generation.length_history": "scheduler.length_history",
    "generation.ranker_side": "scheduler.ranker_side",
    "generation.sibling_lengths": "scheduler.sibling_lengths",
    "algo.advantage": "advantage.estimator",
    "algo.gamma": "advantage.gamma",
    "algo.lam": "advantage.lam",
    "algo.group_size": "advantage.group_size",
    "algo.whiten_advantages": "advantage.whiten",
    "algo.use_critic": "advantage.use_critic",
    "algo.kl_coef": "kl.coef",
    "algo.kl_estimator": "kl.estimator",
    "algo.kl_in_reward": "kl.in_reward",
    "algo.use_reference": "kl.use_reference",
    "algo.clip_low": "loss.clip_low",
    "algo.clip_high": "loss.clip_high",
    "algo.dual_clip": "loss.dual_clip",
    "algo.loss_agg": "loss.agg",
    "algo.entropy_coef": "loss.entropy_coef",
    "algo.vf_clip": "loss.vf_clip",
    "algo.rollout_correction": "loss.rollout_correction",
    "algo.is_cap": "loss.is_cap",
    "algo.mis_threshold": "loss.mis_threshold",
    "trainer.lr": "optimizer.lr",
    "trainer.critic_lr": "optimizer.critic_lr",
    "trainer.warmup_steps": "optimizer.warmup_steps",
    "trainer.weight_decay": "optimizer.weight_decay",
    "trainer.grad_clip": "optimizer.grad_clip",
    "generation.partial": "pipeline.partial",
    "generation.partial_oversample": "pipeline.partial_oversample",
    "generation.max_token_version_gap": "pipeline.max_token_version_gap",
    "task.jsonl_path": "task.train_path",
}
# Values renamed with their key: (key today, old value) -> value today.
OLD_VALUES = {("task.kind", "jsonl"): "file"}
NEW_TO_OLD = {new: old for old, new in OLD_TO_NEW.items()}

_noted: set[str] = set()
_noted_values: set[tuple] = set()


def new_key(key: str, *, note: bool = True) -> str:
  """The key's name today (`key` itself when it was not renamed); an old
  name prints one line naming the new one (once per process)."""
  new = OLD_TO_NEW.get(key)
  if new is None:
    return key
  if note and key not in _noted:
    _noted.add(key)
    sys.stderr.write(
        f"note: config key {key!r} is now {new!r}; the old name works until "
        f"StreamRL {REMOVED_IN}.\n"
    )
  return new


def upgrade_flat(values: Mapping[str, Any], *, where: str = "the config") -> dict[str, Any]:
  """{dotted key: value} with old keys under their new names (order kept).

  Raises ValueError when an old key and its new name are both given.
  """
  out: dict[str, Any] = {}
  for key, value in values.items():
    new = new_key(key)
    if new in out and new != key:
      raise ValueError(f"{where} sets both {key!r} and its new name {new!r}; keep only {new!r}.")
    if new in out and new == key and NEW_TO_OLD.get(key) in values:
      raise ValueError(
          f"{where} sets both {NEW_TO_OLD[key]!r} and its new name {key!r}; keep only {key!r}."
      )
    renamed = OLD_VALUES.get((new, value)) if isinstance(value, str) else None
    if renamed is not None:
      if (new, value) not in _noted_values:
        _noted_values.add((new, value))
        sys.stderr.write(
            f"note: {new}={value!r} is now {new}={renamed!r}; the old value works until "
            f"StreamRL {REMOVED_IN}.\n"
        )
      value = renamed
    out[new] = value
  return out


def legacy_name(values: Mapping[str, Any]) -> dict[str, Any]:
  """The same keys under their old names (for finding directories named before 0.1)."""
  return {NEW_TO_OLD.get(k, k): v for k, v in values.items()}
