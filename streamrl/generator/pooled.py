"""One generate call over a shared work pool (`scheduler.pool="shared"`).

`PooledRound` is the bookkeeping, with no Ray in it: which requests each
instance holds (running or queued on it), what it gets next from the
`scheduling.pool.WorkPool`, which idle instance takes a straggler from
whom, and how a moved response is joined to its rest. `run` is the
service's loop around it: every instance streams from a `Feed` on its actor
that this process tops up as its samples come back
(streamrl/generator/service.py). The benchmark's lockstep engines
(experiments/bench_skew.py) drive the same `PooledRound` in one process.

Guarantees, as with fixed lists: every request is answered exactly once; a
dead instance's requests go back to the pool; a stopped call answers what
is unfinished with PARTIAL samples (a moved response's tokens joined). A
moved response resumes from its tokens so far on another instance (prompt
plus those tokens, the rest of its budget), sampled afresh from there; its
sample carries per-token weight versions when the two instances' differ.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from streamrl.generator.rollout import MOVED, PARTIAL, Sample
from streamrl.scheduling.pool import WorkPool, donor
from streamrl.scheduling.request import Request

log = logging.getLogger(__name__)


def join(prefix: Sample | None, rest: Sample, prompt: tuple[int, ...]) -> Sample:
  """`rest` (the continuation of a moved response) after `prefix` (its tokens
  before the move), as one sample of `prompt`."""
  if prefix is None:
    return dataclasses.replace(rest, prompt_token_ids=prompt)
  versions = (prefix.token_versions or (prefix.weight_version,) * len(prefix.token_ids)) + (
      rest.token_versions or (rest.weight_version,) * len(rest.token_ids)
  )
  return dataclasses.replace(
      rest,
      prompt_token_ids=prompt,
      token_ids=prefix.token_ids + rest.token_ids,
      logprobs=prefix.logprobs + rest.logprobs,
      token_versions=None if set(versions) <= {rest.weight_version} else versions,
  )


class PooledRound:
  """A round's requests over the instances of a shared pool.

  Args:
    pool: the round's `WorkPool`.
    caps: instance id -> its most requests in flight.
    max_tokens: the sampling's budget (a request without its own).
    migrate: idle instances take stragglers once the pool is empty.
    lookahead: requests an instance holds beyond its cap, so that it never
      waits for the next one while a top-up travels (0 in one process).
  """

  def __init__(
      self,
      pool: WorkPool,
      caps: dict[int, int],
      *,
      max_tokens: int,
      migrate: bool,
      lookahead: int = 0,
      straggler_tokens: int = 0,
      straggler=None,
      long_instances: tuple[int, ...] = (),
      long_share: int = 0,
  ):
    self.pool = pool
    self.caps = dict(caps)
    self.max_tokens = int(max_tokens)
    self.migrate = bool(migrate)
    self.lookahead = int(lookahead)
    # Straggler isolation: a request that runs past `straggler_tokens` on a
    # regular instance moves to a long-tail instance, which holds at most
    # `long_share` regular requests meanwhile.
    self.straggler_tokens = int(straggler_tokens)
    # Or any rule: straggler(request id, tokens so far) -> bool (in one process).
    self.straggler = straggler if straggler is not None else (self.straggler_tokens or None)
    self.long_instances = frozenset(long_instances or pool.long_instances)
    pool.long_instances = self.long_instances
    self.long_share = int(long_share)
    self.held: dict[int, dict[int, Request]] = collections.defaultdict(dict)
    self.prefix: dict[int, Sample] = {}  # request id -> its tokens before it moved
    self.moving: set[int] = set()  # donors asked to release, not heard from since
    self.answered: set[int] = set()
    self.total = len(pool)
    self.moves = 0
    self._closed: set[int] = set()
    self._settled = False  # stragglers no longer move to the long-tail instances
    self._thief: dict[int, int] = {}  # donor -> the idle instance its straggler goes to
    self._handoff: dict[int, list[Request]] = collections.defaultdict(list)

  @property
  def done(self) -> bool:
    return len(self.answered) >= self.total

  def straggler_limit(self, i: int):
    """Instance `i`'s `Feed.straggler` rule (None: it gives up nothing)."""
    if self.straggler is not None and i not in self.long_instances and not self._settled:
      return self.straggler
    return None

  def idle(self, i: int) -> bool:
    return not self.held[i]

  def fill(self, i: int) -> list[Request]:
    """Requests to send instance `i` now (its cap plus the lookahead)."""
    out = []
    while len(self.held[i]) < self.caps[i] + self.lookahead:
      if self.straggler is not None and i in self.long_instances and self.pool.has_regular():
        if not self.pool.has_long() and len(self.held[i]) >= self.long_share:
          break
      r = self.pool.take(i)
      if r is None:
        break
      self.held[i][r.id] = r
      out.append(r)
    return out

  def steal_from(self, i: int) -> int | None:
    """The donor idle instance `i` takes a straggler from (it is then asked to
    release one), or None."""
    if not self.migrate or self.pool or self.held[i] or self.moving:
      return None
    d = donor({j: len(h) for j, h in self.held.items() if j != i}, i)
    if d is not None:
      self.moving.add(d)
      self._thief[d] = i
    return d

  def orders(self, instances) -> list[tuple[int, dict]]:
    """What to tell the streaming `instances` now, as (instance, `Feed.order`
    arguments): new work to those with free slots; for an idle one, once
    the pool is empty, a release order to its donor; the close to all once
    every request is answered."""
    out = []
    if self.straggler is not None and not self._settled and not self.pool.has_regular():
      # The regular work is all out: stragglers stay where they are from now on.
      self._settled = True
      out += [(j, {"stragglers_stay": True}) for j in instances if j not in self.long_instances]
    for j in instances:
      if self.done:
        if j not in self._closed:
          self._closed.add(j)
          out.append((j, {"close": True}))
        continue
      reqs = self._handoff.pop(j, []) + self.fill(j)
      if reqs:
        out.append((j, {"requests": reqs}))
      elif self.idle(j):
        d = self.steal_from(j)
        if d is not None:
          out.append((d, {"release": 1}))
    return out

  def on_sample(self, i: int, s: Sample) -> Sample | None:
    """Records instance `i`'s sample; returns the sample to yield (joined to
    what it had before it moved), or None for a response given up to move."""
    self.moving.discard(i)
    thief = self._thief.pop(i, None)
    self.held[i].pop(s.prompt_id, None)
    rid = s.prompt_id
    original = self.pool.requests[rid]
    if s.finish_reason == MOVED:
      before = self.prefix.get(rid)
      moved = join(before, s, original.prompt)
      self.prefix[rid] = moved
      budget = (original.max_tokens or self.max_tokens) - len(moved.token_ids)
      rest = Request(rid, original.prompt + moved.token_ids, max_tokens=budget)
      self.pool.put(
          rest,
          done_tokens=len(s.token_ids),
          # Given up by the straggler rule (not to an idle thief): a long-tail request now.
          long=self.straggler is not None and thief is None and i not in self.long_instances,
      )
      self.moves += 1
      if thief is not None and thief in self.held and self.idle(thief):
        # Straight to the instance that asked (the donor's freed slot must not take it back).
        self.held[thief][rid] = self.pool.take_id(rid)
        self._handoff[thief].append(self.held[thief][rid])
      return None
    if rid in self.answered:
      log.warning("Dropped a second sample for request %d (from instance %d).", rid, i)
      return None
    self.answered.add(rid)
    out = join(self.prefix.pop(rid, None), s, original.prompt)
    if s.finish_reason != PARTIAL:
      self.pool.finished(rid, len(out.token_ids))
    return out

  def on_dead(self, i: int) -> int:
    """Instance `i` died: what it held goes back to the pool; returns how many."""
    held = self.held.pop(i, {})
    self.moving.discard(i)
    self._thief.pop(i, None)
    self._handoff.pop(i, None)
    for r in held.values():
      self.pool.put(r)
    return len(held)

  def unstarted(self) -> list[Sample]:
    """After a stop: a PARTIAL sample for every request still in the pool
    (with the tokens it had, if it moved)."""
    out = []
    for r in list(self.pool):
      if r.id in self.answered:
        continue
      self.answered.add(r.id)
      before = self.prefix.pop(r.id, None)
      original = self.pool.requests[r.id]
      if before is not None:
        out.append(dataclasses.replace(before, finish_reason=PARTIAL))
      else:
        out.append(
            Sample(
                prompt_id=r.id,
                prompt_token_ids=original.prompt,
                token_ids=(),
                logprobs=(),
                finish_reason=PARTIAL,
                weight_version=-1,
                instance_id=-1,
                trajectory=original.trajectory,
            )
        )
    return out


@dataclasses.dataclass
class Stream:
  """One generate call running on one instance."""

  instance_id: int
  requests: list
  started: float
  last_sample: float | None = None
  num_samples: int = 0


def last_line(msg: str | None) -> str:
  lines = [ln.strip() for ln in (msg or "").splitlines() if ln.strip()]
  return lines[-1] if lines else "unknown cause"


def stall_error(stalled, stall_timeout_s: float, counts: str = "") -> TimeoutError:
  """The error of instances that produced nothing for the stall timeout while holding work."""
  return TimeoutError(
      f"Generator instance{'s' if len(stalled) > 1 else ''} "
      f"{', '.join(map(str, stalled))} produced no sample for {stall_timeout_s:.0f} s "
      f"while still having work{counts}; raise pipeline.stall_timeout_s if samples are just "
      "slow, or check the instance's log."
  )


def run(service, rnd: PooledRound, sampling, seed, stall_timeout_s: float, stop_key):
  """The service's generate loop over `rnd` (see the module docstring)."""
  import ray  # pylint: disable=g-import-not-at-top

  key = stop_key if stop_key is not None else next(service._stop_keys)
  active: dict = {}  # ObjectRefGenerator -> Stream
  actors = service._actors

  def stopped() -> bool:
    return stop_key is not None and service._stopped_key == stop_key

  def start(i: int) -> None:
    reqs = rnd.fill(i)
    gen = (
        actors[i]
        .generate.options(num_returns="streaming")
        .remote(
            reqs,
            sampling,
            rnd.caps[i],
            # Each finish goes back at once: it frees a slot to top up, and a
            # feed's stream never ends to flush what a window holds.
            0.0,
            stop_key,
            seed=seed,
            feed_key=key,
            straggler_tokens=rnd.straggler_limit(i),
        )
    )
    active[gen] = Stream(i, reqs, time.perf_counter())

  def end(gen) -> None:
    st = active.pop(gen)
    if st.num_samples:
      service.busy_intervals.append((st.instance_id, st.started, st.last_sample, st.num_samples))

  def streaming() -> list[int]:
    return sorted({s.instance_id for s in active.values()})

  def top_up() -> None:
    if not stopped():
      for j, order in rnd.orders(streaming()):
        actors[j].feed.remote(key, **order)

  for i in service.live_instances:
    start(i)
  top_up()  # an empty round closes at once
  try:
    while active:
      now = time.perf_counter()
      deadline = {g: (s.last_sample or s.started) + stall_timeout_s for g, s in active.items()}
      ready, _ = ray.wait(
          list(active), num_returns=1, timeout=max(0.0, min(deadline.values()) - now)
      )
      if not ready:
        now = time.perf_counter()
        stalled = sorted(
            {
                active[g].instance_id
                for g, d in deadline.items()
                if d <= now and rnd.held[active[g].instance_id]
            }
        )
        if not stalled:
          for g, d in deadline.items():  # idle, waiting on its feed: not stalled
            if d <= now:
              active[g].last_sample = now
          continue
        raise stall_error(stalled, stall_timeout_s)
      for gen in ready:
        st = active[gen]
        i = st.instance_id
        try:
          batch = ray.get(next(gen))
        except StopIteration:
          end(gen)
          for r in rnd.held.pop(i, {}).values():  # never lose a request
            log.warning("Instance %d ended its stream holding request %d; re-queued.", i, r.id)
            rnd.pool.put(r)
          top_up()
          continue
        except ray.exceptions.RayActorError as e:
          end(gen)
          requeued = rnd.on_dead(i)
          service._mark_dead(i, last_line(e.error_msg), requeued, error_text=e.error_msg)
          if not service.live_instances:
            raise service._all_dead_error(service._all_dead_message(requeued)) from None
          top_up()
          continue
        except ray.exceptions.RayTaskError as e:
          raise e.as_instanceof_cause() from None
        st.num_samples += len(batch)
        service.num_objects += 1
        st.last_sample = time.perf_counter()
        for sample in batch:
          out = rnd.on_sample(i, sample)
          if out is not None:
            yield out
        top_up()
    if stopped():
      yield from rnd.unstarted()
  finally:
    service.moves += rnd.moves
    for gen in list(active):
      try:
        ray.cancel(gen)
      except Exception:  # pylint: disable=broad-except
        pass  # Already finished or its actor is gone.
      end(gen)
