"""A generation round's shared work pool (`scheduler.pool="shared"`).

With fixed lists (`scheduler.pool="fixed"`) each instance gets its share of
a round up front and runs it in order; when lengths are random per sample
the instance that happens to draw the few responses running to max_tokens
sets the makespan, and no plan made before generation can know which it
will be. With a shared pool the instances take their next request from one
`WorkPool` as their slots free up, mid-round:

- hand-out order: the longest estimated remaining length first (LPT over
  the whole round); the estimate starts from the scheduler's prediction and
  improves while the round runs: a request's group (the samples of one
  prompt) blends the prediction with its finished siblings' lengths and is
  raised to its longest running sibling's tokens so far
  (`siblings.group_estimate`);
- the long-tail split of Algorithm 2 says to whom: requests the plan put on
  its long-tail instances go to those instances first (each at its plan's
  batch cap), and either side takes the other's work once its own is gone;
- stragglers move (`scheduler.migrate`): once the pool is empty, an idle
  instance takes a running request from the instance with the most work in
  flight (`donor`); the donor stops it and the idle instance resumes it from
  its tokens so far, as a partial rollout resumes a response.

`Feed` is the instance's side: the requests handed to it and not started
yet, the release orders of migration, and whether more may come. The
engine's generate loop takes from it as from any pending queue
(streamrl/generator/vllm_engine.py). Both classes are plain Python; the
service (streamrl/generator/pooled.py) and the benchmark's lockstep engines
(experiments/bench_skew.py) drive them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Iterator, Mapping, Sequence

from streamrl.scheduling.request import Request
from streamrl.scheduling.siblings import group_estimate

POOLS = ("fixed", "shared")


class WorkPool:
  """The requests of one round not handed to an instance yet.

  Args:
    requests: the round's requests; their order breaks ties (and is the
      hand-out order without estimates: FIFO).
    estimates: per request, the predicted response length (tokens), or None.
    groups: per request, its group (samples of one prompt); None: none share.
    long_ids: ids of requests the plan gave the long-tail instances.
    long_instances: the plan's long-tail instances.
    prior_weight: weight of the prediction against each finished sibling.
  """

  def __init__(
      self,
      requests: Sequence[Request],
      estimates: Sequence[float] | None = None,
      *,
      groups: Sequence[Hashable] | None = None,
      long_ids: Sequence[int] = (),
      long_instances: Sequence[int] = (),
      prior_weight: float = 1.0,
  ):
    requests = list(requests)
    if estimates is not None and len(estimates) != len(requests):
      raise ValueError(f"{len(requests)} requests but {len(estimates)} estimates; give one each.")
    if groups is not None and len(groups) != len(requests):
      raise ValueError(f"{len(requests)} requests but {len(groups)} groups; give one each.")
    self._pending: dict[int, Request] = {}
    self._order: dict[int, int] = {}
    for r in requests:
      if r.id in self._pending:
        raise ValueError(f"Request id {r.id} appears more than once; request ids must be unique.")
      self._pending[r.id] = r
      self._order[r.id] = len(self._order)
    self._prior = {r.id: float(e) for r, e in zip(requests, estimates)} if estimates else {}
    self._group = {
        r.id: (g if groups is not None else r.id)
        for r, g in zip(requests, groups or [None] * len(requests))
    }
    self._long = set(int(i) for i in long_ids)
    self.long_instances = frozenset(int(i) for i in long_instances)
    self._prior_weight = float(prior_weight)
    self._finished: dict[Hashable, list[float]] = collections.defaultdict(list)
    self._running: dict[Hashable, float] = {}
    self._done_tokens: dict[int, int] = {}  # a moved remainder's tokens so far
    self.requests = {r.id: r for r in requests}  # every request of the round, by id

  def __len__(self) -> int:
    return len(self._pending)

  def __bool__(self) -> bool:
    return bool(self._pending)

  def __iter__(self) -> Iterator[Request]:
    """The requests not handed out, in the round's order."""
    return iter(sorted(self._pending.values(), key=lambda r: self._order[r.id]))

  def has_long(self) -> bool:
    return any(i in self._long for i in self._pending)

  def has_regular(self) -> bool:
    return any(i not in self._long for i in self._pending)

  def estimate(self, request_id: int) -> float:
    """The request's estimated remaining length (tokens); 0 without estimates."""
    if not self._prior:
      return 0.0
    g = self._group[request_id]
    total = group_estimate(
        self._prior.get(request_id, 0.0),
        self._finished.get(g, ()),
        self._running.get(g, 0.0),
        self._prior_weight,
    )
    return total - self._done_tokens.get(request_id, 0)

  def take(self, instance: int) -> Request | None:
    """The next request for `instance` (None when the pool is empty): from
    its side of the long-tail split first, the longest estimate first
    (moved remainders before anything else), ties in the round's order."""
    if not self._pending:
      return None
    own_long = instance in self.long_instances
    ids = [i for i in self._pending if (i in self._long) == own_long] or list(self._pending)
    moved = [i for i in ids if i in self._done_tokens]
    best = min(moved or ids, key=lambda i: (-self.estimate(i), self._order[i]))
    return self._pending.pop(best)

  def take_id(self, request_id: int) -> Request:
    """Takes the pending request `request_id` out of the pool."""
    return self._pending.pop(request_id)

  def put(self, request: Request, done_tokens: int = 0, long: bool = False) -> None:
    """Returns `request` to the pool: a dead instance's, or the rest of a
    moved one (`done_tokens`: the tokens it already has), which goes first;
    `long`: it goes to the long-tail instances from now on."""
    if long:
      self._long.add(request.id)
    if request.id not in self._order:
      self._order[request.id] = len(self._order)
      self._group.setdefault(request.id, request.id)
    if done_tokens:
      self._done_tokens[request.id] = self._done_tokens.get(request.id, 0) + int(done_tokens)
    self._pending[request.id] = request

  def progress(self, request_id: int, tokens: int) -> None:
    """A running request has `tokens` tokens so far (this round)."""
    g = self._group.get(request_id)
    if g is None:
      return
    total = float(tokens + self._done_tokens.get(request_id, 0))
    if total > self._running.get(g, 0.0):
      self._running[g] = total

  def finished(self, request_id: int, tokens: int) -> None:
    """A request finished with `tokens` tokens (this round, moves included)."""
    g = self._group.get(request_id)
    if g is not None:
      self._finished[g].append(float(tokens))


def from_parts(
    parts: Sequence[Sequence[Request]],
    instance_ids: Sequence[int],
    *,
    n_long: int = 0,
    estimates: Mapping[int, float] | None = None,
) -> WorkPool:
  """The shared pool of a plan: its per-instance lists `parts` (instance
  `instance_ids[k]` got `parts[k]`; the first `n_long` are Algorithm 2's
  long-tail instances), handed out in the plan's order interleaved over the
  instances (arrival order for a FIFO plan) unless `estimates` (request id
  -> estimated length) say otherwise. Samples of one prompt form a group."""
  if len(parts) != len(instance_ids):
    raise ValueError(f"{len(parts)} request lists for {len(instance_ids)} instances.")
  order = [
      r for k in range(max(map(len, parts), default=0)) for p in parts if k < len(p) for r in [p[k]]
  ]
  groups: dict[tuple, int] = {}
  return WorkPool(
      order,
      [estimates[r.id] for r in order] if estimates else None,
      groups=[groups.setdefault(r.prompt, len(groups)) for r in order],
      long_ids=[r.id for p in parts[:n_long] for r in p],
      long_instances=instance_ids[:n_long],
  )


def donor(loads: dict[int, int], idle: int, min_load: int = 2) -> int | None:
  """The instance an idle one takes a running request from: the one with the
  most requests in flight, if it has at least `min_load` (moving a lone
  request gains nothing); None otherwise."""
  others = {i: n for i, n in loads.items() if i != idle and n >= min_load}
  if not others:
    return None
  return max(others, key=lambda i: (others[i], -i))


class Feed:
  """One instance's side of a shared pool, filled by another thread.

  The engine's generate loop takes requests with `popleft` while it is
  truthy, waits with `wait` while it is `open` and has nothing to do, and
  asks `releases()` after each step how many running requests to give up
  (migration). `add`, `release` and `close` come from the thread that talks
  to the pool (the actor's control method, or the benchmark's driver).
  """

  def __init__(self, requests: Sequence[Request] = (), straggler=None):
    # Which running requests the engine gives up for the pool to hand to a
    # long-tail instance: those with this many tokens (an int), those for
    # which straggler(request id, tokens so far) is true (a callable), or none.
    self.straggler = straggler
    self._queue: collections.deque = collections.deque(requests)
    self._cond = threading.Condition()
    self._closed = False
    self._releases = 0

  def __len__(self) -> int:
    return len(self._queue)

  def __bool__(self) -> bool:
    return bool(self._queue)

  def __iter__(self) -> Iterator[Request]:
    return iter(list(self._queue))

  def is_straggler(self, request_id: int, tokens: int) -> bool:
    """Whether the engine gives up this running request now (see __init__)."""
    if self.straggler is None:
      return False
    if callable(self.straggler):
      return bool(self.straggler(request_id, tokens))
    return tokens >= self.straggler

  @property
  def open(self) -> bool:
    """True while more requests may still come."""
    return not self._closed

  def popleft(self) -> Request:
    with self._cond:
      return self._queue.popleft()

  def clear(self) -> None:
    with self._cond:
      self._queue.clear()

  def add(self, requests: Sequence[Request]) -> None:
    with self._cond:
      self._queue.extend(requests)
      self._cond.notify_all()

  def release(self, n: int = 1) -> None:
    """Asks the engine to give up `n` running requests (the ones with the
    most tokens so far: under a heavy-tailed length distribution, the most
    left to go)."""
    with self._cond:
      self._releases += int(n)
      self._cond.notify_all()

  def releases(self) -> int:
    """How many running requests to give up now (resets the count)."""
    with self._cond:
      n, self._releases = self._releases, 0
      return n

  def order(
      self,
      requests: Sequence[Request] = (),
      release: int = 0,
      close: bool = False,
      stragglers_stay: bool = False,
  ) -> None:
    """One message of the pool's side: `add`, `release` and `close` at once;
    `stragglers_stay`: from now on no running request is given up for its
    length (the regular work is all handed out)."""
    if stragglers_stay:
      self.straggler = None
    if requests:
      self.add(requests)
    if release:
      self.release(release)
    if close:
      self.close()

  @property
  def ready(self) -> bool:
    """Whether the engine has something to act on: a request, a release order
    or the close."""
    with self._cond:
      return bool(self._queue) or bool(self._releases) or self._closed

  def close(self) -> None:
    """No more requests will come: the engine ends once its work is done."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def wait(self, timeout_s: float) -> None:
    """Returns when a request or a release order arrives, when the feed
    closes, or after `timeout_s`."""
    with self._cond:
      if not self._queue and not self._closed and not self._releases:
        self._cond.wait(timeout_s)
