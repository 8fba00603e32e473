"""Elastic generation in a real run: the policy applied to the live service.

After every iteration `train.run` calls `ElasticGeneration.after_iteration`
with the iteration's measured stage times. It first replaces instances that
died since the last look (`elastic.replace_dead`), then asks
`streamrl.elastic.policy.ElasticPolicy` (the same rule the simulator
replays) whether to add or release one, and applies the answer:

  add      `StreamGenerationService.add_instance`: a new Ray actor on a free
           slot of the generation pool, caught up to the current weight
           version through the transfer service and verified before it
           takes work from the next round on;
  release  `remove_instance`: the newest instance takes no new work, drains
           what it has (nothing lost or re-run), then stops.

Every change is logged with its reason and appended to
<workdir>/elastic.jsonl; `generators/instances` and the `elastic/*` counters
go to TensorBoard. No torch or vLLM here.
"""

from __future__ import annotations

import json
import logging
import os
import time

from streamrl.elastic.policy import ElasticPolicy, StageTimes

log = logging.getLogger(__name__)


class ElasticGeneration:
  """Drives a `StreamGenerationService`'s instance count during a run.

  Args:
    el: a `streamrl.config.settings.Elastic`.
    rollout: the service.
    pool: the Ray resource one instance takes (cluster.generation_pool).
    workdir: where elastic.jsonl goes (None: nowhere).
  """

  def __init__(self, el, rollout, *, pool: str, workdir: str | None):
    self.rollout = rollout
    self.pool = pool
    self.replace_dead = el.replace_dead
    self.max_instances = el.max_instances
    self.policy = ElasticPolicy.from_settings(el, len(rollout.live_instances))
    self.path = os.path.join(workdir, "elastic.jsonl") if workdir else None
    self._dead_seen = len(rollout.dead_instances)
    self.added = self.removed = self.replaced = self.failed = 0
    self.events: list[dict] = []

  def free_slots(self) -> int:
    """Free units of the generation pool on the cluster now."""
    import ray  # pylint: disable=g-import-not-at-top

    return int(ray.available_resources().get(self.pool, 0))

  def _event(self, it: int, action: str, instance: int | None, reason: str) -> None:
    e = {
        "iteration": it,
        "action": action,
        "instance": instance,
        "instances": len(self.rollout.live_instances),
        "reason": reason,
        "time": time.time(),
    }
    self.events.append(e)
    log.info("Elastic generation after iteration %d: %s %s (%s).", it, action, instance, reason)
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps(e) + "\n")

  def _add(self, it: int, reason: str) -> bool:
    try:
      i = self.rollout.add_instance(reason)
    except RuntimeError as e:
      self.failed += 1
      self._event(it, "add_failed", None, f"{reason}; {e}")
      return False
    self._event(it, "added", i, reason)
    return True

  def after_iteration(
      self, it: int, generation_s: float, training_s: float, served_by: int | None = None
  ) -> dict:
    """Applies replacements and the policy's decision; returns scalars.

    served_by: the instances iteration `it`'s round was planned for.
    """
    dead = self.rollout.dead_instances
    if self.replace_dead:
      for d in dead[self._dead_seen :]:
        if len(self.rollout.live_instances) < self.max_instances:
          self.replaced += self._add(
              it, f"replaces instance {d.instance_id}, which died: {d.reason}"
          )
    self._dead_seen = len(dead)
    self.policy.set_instances(len(self.rollout.live_instances))
    decision = self.policy.decide(
        StageTimes(
            it,
            self.policy.instances if served_by is None else served_by,
            generation_s,
            training_s,
        ),
        self.free_slots(),
    )
    if decision.delta > 0:
      for _ in range(decision.delta):
        self.added += self._add(it, decision.reason)
    elif decision.delta < 0:
      for _ in range(-decision.delta):
        i = self.rollout.remove_instance(reason=decision.reason)
        self.removed += 1
        self._event(it, "removed", i, decision.reason)
    self.policy.set_instances(len(self.rollout.live_instances))
    return {
        "elastic/added_total": self.added,
        "elastic/removed_total": self.removed,
        "elastic/replaced_total": self.replaced,
        "elastic/add_failed_total": self.failed,
    }
