"""One generate call over fixed per-instance lists (`scheduler.pool="fixed"`).

`plan` splits the call's requests over the live instances (round-robin, or
the caller's `assignments`, e.g. LPT order from the skew scheduler);
`FixedRound` is the call's bookkeeping for the fan-in loop (fanin.py): each
instance runs its list as one stream, a dead instance's undelivered requests
are spread over the survivors (run after what they already have), and a
stopped call answers the requests no instance started with PARTIAL samples.
Every request is answered exactly once.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Sequence

from streamrl.generator.config import Sampling
from streamrl.generator.instances import Instances
from streamrl.generator.rollout import PARTIAL, Request, Sample, as_requests

log = logging.getLogger(__name__)


def spread(reqs: Sequence[Request], plan: dict[int, list], live: Sequence[int]) -> None:
  """Adds `reqs` to `plan` round-robin over the `live` instances, keeping the
  given order (LPT order stays descending inside each instance)."""
  for k, req in enumerate(reqs):
    plan.setdefault(live[k % len(live)], []).append(req)


def plan(
    requests: Sequence[Request] | None,
    assignments: Sequence[Sequence[Request]] | None,
    num_instances: int,
    live: Sequence[int],
) -> dict[int, list[Request]]:
  """{instance id: its requests, in order}: `requests` round-robin over the
  `live` instances, or `assignments` (one list per instance id
  0..num_instances-1; `requests`, if given too, must hold the same ids).
  Work planned for an instance that is not live goes to the live ones."""
  if assignments is None:
    if requests is None:
      raise ValueError("generate needs requests or assignments.")
    reqs = as_requests(requests)
    out = {i: [] for i in range(num_instances)}
    for k, req in enumerate(reqs):
      out[live[k % len(live)]].append(req)
  else:
    if len(assignments) != num_instances:
      raise ValueError(
          f"assignments has {len(assignments)} lists for "
          f"{num_instances} instances; give one (maybe empty) per instance."
      )
    out = {i: as_requests(a) for i, a in enumerate(assignments)}
    reqs = [r for i in range(num_instances) for r in out[i]]
  ids = [r.id for r in reqs]
  if len(set(ids)) != len(ids):
    dup = next(r for r, c in collections.Counter(ids).items() if c > 1)
    raise ValueError(f"Request id {dup} appears more than once; request ids must be unique.")
  if assignments is not None and requests is not None:
    if sorted(r.id for r in as_requests(requests)) != sorted(ids):
      raise ValueError("assignments must hold exactly the given requests, each once.")
  live_set, orphans = set(live), []
  for i in [i for i in out if i not in live_set]:
    orphans.extend(out.pop(i))
  spread(orphans, out, live)
  return out


def unstarted(r: Request) -> Sample:
  """The PARTIAL sample of a request stopped before any instance ran it."""
  return Sample(
      r.id, r.prompt, (), (), PARTIAL, weight_version=-1, instance_id=-1, trajectory=r.trajectory
  )


class FixedRound:
  """A `fanin.Round` over fixed lists.

  Args:
    plan: {instance id: its requests} (`plan`).
    instances: the service's `Instances` (which are live or being removed).
    sampling, seed, caps, coalesce_s, stop_key: what each instance's stream
      runs with (`GeneratorActor.generate`); caps by instance id.
    stopped: whether the call was asked to stop.
  """

  def __init__(
      self,
      plan: dict[int, list[Request]],
      instances: Instances,
      *,
      sampling: Sampling,
      seed: int | None,
      caps: Sequence[int | None],
      coalesce_s: float,
      stop_key: int | None,
      stopped: Callable[[], bool],
  ):
    self.instances = instances
    self._args = (sampling, caps, coalesce_s, stop_key, seed)
    self._stopped = stopped
    self._fan = None
    # Per instance: batches not started yet (a survivor that already runs a
    # stream gets a dead peer's requests as its next batch).
    self.queued: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    self.undelivered: dict[int, dict[int, Request]] = collections.defaultdict(dict)
    for i, reqs in plan.items():
      if reqs:
        self.queued[i].append(reqs)
      self.undelivered[i].update((r.id, r) for r in reqs)
    self.delivered: set[int] = set()
    self._leftover: list[Request] = []  # a dead instance's, for `after_dead`

  def _start(self, i: int) -> None:
    if self._stopped():
      return  # What is still queued comes back as PARTIAL at the end.
    if self.instances.is_live(i) and self.queued[i] and i not in self._fan.streaming():
      sampling, caps, coalesce_s, stop_key, seed = self._args
      reqs = self.queued[i].popleft()
      self._fan.launch(i, reqs, sampling, caps[i], coalesce_s, stop_key, seed=seed)

  def begin(self, fan) -> None:
    self._fan = fan
    for i in list(self.queued):
      self._start(i)

  def quiet(self, instance_id: int) -> bool:
    return False  # A fixed list's stream always has work until it ends.

  def stall_detail(self, stalled: Sequence[int]) -> str:
    counts = ", ".join(f"instance {i}: {len(self.undelivered[i])} unfinished" for i in stalled)
    return f" ({counts})"

  def on_samples(self, instance_id: int, batch: list[Sample]) -> Iterator[Sample]:
    for sample in batch:
      rid = sample.prompt_id
      self.undelivered[instance_id].pop(rid, None)
      if rid in self.delivered:
        log.warning("Dropped a second sample for request %d (from instance %d).", rid, instance_id)
        continue
      self.delivered.add(rid)
      yield sample

  def on_end(self, instance_id: int) -> None:
    i = instance_id
    if not self.queued[i] and self.undelivered.get(i) and not self._stopped():
      # Can't happen with a healthy engine; never lose a request.
      log.warning(
          "Instance %d ended its stream with %d requests undelivered; running them again.",
          i,
          len(self.undelivered[i]),
      )
      self.queued[i].append(list(self.undelivered[i].values()))
    self._start(i)
    # A removed instance whose work is all delivered stops now.
    if not self.queued.get(i) and not self.undelivered.get(i) and i not in self._fan.streaming():
      self.instances.retire_if_draining(i)

  def on_dead(self, instance_id: int) -> int:
    self._leftover = list(self.undelivered.pop(instance_id, {}).values())
    self.queued.pop(instance_id, None)
    return len(self._leftover)

  def after_dead(self, instance_id: int) -> None:
    moved: dict[int, list] = {}
    spread(self._leftover, moved, self.instances.live_instances)
    self._leftover = []
    for j, reqs in moved.items():
      self.queued[j].append(reqs)
      self.undelivered[j].update((r.id, r) for r in reqs)
      self._start(j)

  def leftovers(self) -> Iterator[Sample]:
    if self._stopped():
      # Stopped before they started (queued, or on an instance that died):
      # PARTIAL with no tokens, so every request is still answered once.
      for i in list(self.undelivered):
        for rid, r in sorted(self.undelivered.pop(i).items()):
          if rid not in self.delivered:
            self.delivered.add(rid)
            yield unstarted(r)

  def close(self) -> None:
    pass
