"""The fan-in loop: one generate call's streams, one per instance, merged into one.

Every instance runs its share as one streaming call on its actor
(`GeneratorActor.generate`); `FanIn.run` yields each finished Sample the
moment any instance sends it, whatever round decides the work. Two rounds
plug into it (`Round`): fixed per-instance lists (fixed.py) and a shared
work pool (pooled.py). The loop itself owns what both share:

  * waiting on all streams at once (`ray.wait`), and the stall timeout: an
    instance that holds work but sends nothing for `stall_timeout_s` fails
    the call with a TimeoutError that names it;
  * an instance that dies: the round takes its work back, the instance is
    marked dead (`Instances.mark_dead`), and the round hands the work to
    the survivors; with none left the call fails with one sentence;
  * the instances' busy intervals and the objects received (`Traffic`);
  * closing: whatever still streams is cancelled, on completion, on error and
    when the consumer closes the stream.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import ray

from streamrl.generator.instances import Instances, last_line
from streamrl.generator.rollout import Sample


@dataclasses.dataclass
class Stream:
  """One streaming generate call running on one instance."""

  instance_id: int
  requests: list
  started: float
  last_sample: float | None = None
  num_samples: int = 0


@dataclasses.dataclass
class Traffic:
  """What the calls of one service sent, over all calls.

  Attributes:
    busy_intervals: (instance_id, start, end, num_samples) per finished stream
      segment, in time.perf_counter() seconds of this process.
    num_objects: sample batches received (one Ray object each).
    moves: responses moved between instances (shared pool).
  """

  busy_intervals: list[tuple[int, float, float, int]] = dataclasses.field(default_factory=list)
  num_objects: int = 0
  moves: int = 0


class Round(Protocol):
  """One generate call's bookkeeping, driven by `FanIn.run`: which instance
  runs what, what a sample answers, and where a dead instance's work goes."""

  def begin(self, fan: FanIn) -> None:
    """Starts the first streams (`fan.launch`)."""

  def quiet(self, instance_id: int) -> bool:
    """Whether a stream that sent nothing for the stall timeout only waits
    for work (not stalled)."""

  def stall_detail(self, stalled: Sequence[int]) -> str:
    """Said after the stall error's instance list (may be empty)."""

  def on_samples(self, instance_id: int, batch: list[Sample]) -> Iterator[Sample]:
    """The samples of one batch to yield (and what follows from them)."""

  def on_end(self, instance_id: int) -> None:
    """The instance's stream ended on its own."""

  def on_dead(self, instance_id: int) -> int:
    """The instance died: takes back its unfinished work; returns how many requests."""

  def after_dead(self, instance_id: int) -> None:
    """Hands the dead instance's work to the live ones (it is marked dead now)."""

  def leftovers(self) -> Iterator[Sample]:
    """After every stream ended: what is still to yield (a stopped call's PARTIAL samples)."""

  def close(self) -> None:
    """The call is over (completed, failed or closed)."""


def stall_error(stalled, stall_timeout_s: float, counts: str = "") -> TimeoutError:
  """The error of instances that produced nothing for the stall timeout while holding work."""
  return TimeoutError(
      f"Generator instance{'s' if len(stalled) > 1 else ''} "
      f"{', '.join(map(str, stalled))} produced no sample for {stall_timeout_s:.0f} s "
      f"while still having work{counts}; raise pipeline.stall_timeout_s if samples are just "
      "slow, or check the instance's log."
  )


class FanIn:
  """The streams of one generate call over `instances`.

  Args:
    instances: the service's instances (actors, liveness, deaths).
    traffic: where busy intervals and object counts are recorded.
    stall_timeout_s: longest wait for the next batch of a stream that holds work.
  """

  def __init__(self, instances: Instances, traffic: Traffic, stall_timeout_s: float):
    self.instances = instances
    self.traffic = traffic
    self.stall_timeout_s = float(stall_timeout_s)
    self._active: dict = {}  # ObjectRefGenerator -> Stream

  def launch(self, instance_id: int, requests: list, *args, **kwargs) -> None:
    """Starts a stream on the instance: its actor's `generate(requests, *args, **kwargs)`."""
    gen = (
        self.instances.actor(instance_id)
        .generate.options(num_returns="streaming")
        .remote(requests, *args, **kwargs)
    )
    self._active[gen] = Stream(instance_id, requests, time.perf_counter())

  def streaming(self) -> list[int]:
    """The instances with a stream running now."""
    return sorted({s.instance_id for s in self._active.values()})

  def _end(self, gen) -> None:
    st = self._active.pop(gen)
    if st.num_samples:
      self.traffic.busy_intervals.append(
          (st.instance_id, st.started, st.last_sample, st.num_samples)
      )

  def _wait(self, rnd: Round) -> list:
    """The streams with a batch (or an end) ready, waiting at most until the
    earliest stall deadline; raises the stall error past it."""
    active, timeout_s = self._active, self.stall_timeout_s
    while True:
      now = time.perf_counter()
      deadline = {g: (s.last_sample or s.started) + timeout_s for g, s in active.items()}
      ready, _ = ray.wait(
          list(active), num_returns=1, timeout=max(0.0, min(deadline.values()) - now)
      )
      if ready:
        return ready
      now = time.perf_counter()
      late = [g for g, d in deadline.items() if d <= now]
      stalled = sorted(
          {active[g].instance_id for g in late if not rnd.quiet(active[g].instance_id)}
      )
      if stalled:
        raise stall_error(stalled, timeout_s, rnd.stall_detail(stalled))
      for g in late:  # idle, waiting for work: not stalled
        active[g].last_sample = now

  def run(self, rnd: Round) -> Iterator[Sample]:
    """Yields the call's samples as they arrive (see the module docstring)."""
    active = self._active
    try:
      rnd.begin(self)
      while active:
        for gen in self._wait(rnd):
          st = active[gen]
          i = st.instance_id
          try:
            batch = ray.get(next(gen))
          except StopIteration:
            self._end(gen)
            rnd.on_end(i)
            continue
          except ray.exceptions.RayActorError as e:
            for g in [g for g, s in active.items() if s.instance_id == i]:
              self._end(g)
            requeued = rnd.on_dead(i)
            self.instances.mark_dead(i, last_line(e.error_msg), requeued, error_text=e.error_msg)
            if not self.instances.live_instances:
              raise self.instances.all_dead_error(unfinished=requeued) from None
            rnd.after_dead(i)
            continue
          except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
          st.num_samples += len(batch)
          self.traffic.num_objects += 1
          st.last_sample = time.perf_counter()
          yield from rnd.on_samples(i, batch)
      yield from rnd.leftovers()
    finally:
      rnd.close()
      for gen in list(active):
        try:
          ray.cancel(gen)
        except Exception:  # pylint: disable=broad-except
          pass  # Already finished or its actor is gone.
        self._end(gen)
