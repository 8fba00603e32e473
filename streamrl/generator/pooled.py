"""One generate call over a shared work pool (`scheduler.pool="shared"`).

`PooledRound` is the bookkeeping, with no Ray in it: which requests each
instance holds (running or queued on it), what it gets next from the
`scheduling.pool.WorkPool`, which idle instance takes a straggler from
whom, and how a moved response is joined to its rest. `PooledCall` plugs it
into the service's fan-in loop (fanin.py): every instance streams from a
`Feed` on its actor that this process tops up as its samples come back.
The benchmark's lockstep engines (lockstep.py) drive the same `PooledRound`
in one process.

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


class PooledCall:
  """A `fanin.Round` over `rnd`: every instance streams from a `Feed` on its
  actor (`GeneratorActor.generate(feed_key=...)`) that this process tops up
  as its samples come back (`PooledRound.orders`).

  Args:
    rnd: the call's `PooledRound`.
    traffic: the service's `fanin.Traffic` (the round's moves are added to it).
    sampling, seed, stop_key: what each instance's stream runs with.
    feed_key: names the call's feeds on the actors.
    stopped: whether the call was asked to stop.
  """

  def __init__(
      self,
      rnd: PooledRound,
      traffic,
      *,
      sampling,
      seed: int | None,
      stop_key: int | None,
      feed_key: int,
      stopped,
  ):
    self.rnd = rnd
    self.traffic = traffic
    self._sampling, self._seed, self._stop_key, self._key = sampling, seed, stop_key, feed_key
    self._stopped = stopped
    self._fan = None

  def _start(self, i: int) -> None:
    rnd = self.rnd
    self._fan.launch(
        i,
        rnd.fill(i),
        self._sampling,
        rnd.caps[i],
        # Each finish goes back at once: it frees a slot to top up, and a
        # feed's stream never ends to flush what a window holds.
        0.0,
        self._stop_key,
        seed=self._seed,
        feed_key=self._key,
        straggler_tokens=rnd.straggler_limit(i),
    )

  def _top_up(self) -> None:
    if not self._stopped():
      for j, order in self.rnd.orders(self._fan.streaming()):
        self._fan.instances.actor(j).feed.remote(self._key, **order)

  def begin(self, fan) -> None:
    self._fan = fan
    for i in fan.instances.live_instances:
      self._start(i)
    self._top_up()  # an empty round closes at once

  def quiet(self, instance_id: int) -> bool:
    return not self.rnd.held[instance_id]  # idle, waiting on its feed

  def stall_detail(self, stalled) -> str:
    return ""

  def on_samples(self, instance_id: int, batch: list[Sample]):
    for sample in batch:
      out = self.rnd.on_sample(instance_id, sample)
      if out is not None:
        yield out
    self._top_up()

  def on_end(self, instance_id: int) -> None:
    for r in self.rnd.held.pop(instance_id, {}).values():  # never lose a request
      log.warning("Instance %d ended its stream holding request %d; re-queued.", instance_id, r.id)
      self.rnd.pool.put(r)
    self._top_up()

  def on_dead(self, instance_id: int) -> int:
    return self.rnd.on_dead(instance_id)

  def after_dead(self, instance_id: int) -> None:
    self._top_up()

  def leftovers(self):
    if self._stopped():
      yield from self.rnd.unstarted()

  def close(self) -> None:
    self.traffic.moves += self.rnd.moves
