"""Generator instances run concurrently in one process, on a CPU-time clock.

For benchmarks of generation scheduling on a machine with fewer cores than
instances (experiments/bench/bench_skew.py). Each `GeneratorInstance` runs in its
own thread, but only one thread runs at a time: before every engine step
the instance hands the turn to whichever instance with work has the
smallest clock, and its own clock advances by the CPU time its thread used
(`time.thread_time`: the engine step, admissions and the pool's
bookkeeping; each engine computes on one thread). So every instance runs
as if on a core of its own, and the instances interact as they would in
parallel: a shared pool hands out work and moves stragglers at the times
the clocks say. An instance waiting for work is parked; when work reaches
it, its clock jumps to that moment.

`run_fixed` runs fixed per-instance lists (`scheduler.pool="fixed"`),
`run_pooled` a `pooled.PooledRound` (`scheduler.pool="shared"`), with real
engines either way.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from streamrl.generator.pooled import PooledRound
from streamrl.generator.rollout import Sample
from streamrl.scheduling.pool import Feed
from streamrl.scheduling.request import as_requests


@dataclasses.dataclass
class Result:
  """A lockstep run: its makespan, per instance the clock when it ended, per
  request its sample and the clock when it was answered, and the moves."""

  makespan_s: float
  clocks: list[float]
  samples: dict[int, Sample]
  finished_at: dict[int, float]
  moves: int = 0


class _Turnstile:
  """One thread at a time, the one with work and the smallest clock."""

  def __init__(self, feeds: Sequence[Feed], quantum_s: float):
    self.feeds = feeds
    self.quantum_s = quantum_s
    n = len(feeds)
    self.cond = threading.Condition()
    self.clock = [0.0] * n
    self.state = ["run"] * n  # run | parked (waiting for work) | done
    self.turn: int | None = 0
    self._since = [0.0] * n  # thread_time when the thread took its turn

  def _charge(self, i: int) -> None:
    now = time.thread_time()
    self.clock[i] += now - self._since[i]
    self._since[i] = now

  def _pick(self, now: float) -> None:
    for j, st in enumerate(self.state):
      if st == "parked" and self.feeds[j].ready:
        self.state[j] = "run"
        self.clock[j] = max(self.clock[j], now)
    runnable = [j for j, st in enumerate(self.state) if st == "run"]
    self.turn = min(runnable, key=lambda j: (self.clock[j], j)) if runnable else None
    self.cond.notify_all()

  def enter(self, i: int) -> None:
    with self.cond:
      while self.turn != i:
        self.cond.wait()
      self._since[i] = time.thread_time()

  def step(self, i: int, in_flight: int) -> None:
    """Instance i is about to step with `in_flight` requests (0: it has none
    and parks until work reaches it)."""
    with self.cond:
      self._charge(i)
      if in_flight:
        others = [
            self.clock[j]
            for j, st in enumerate(self.state)
            if j != i and (st == "run" or (st == "parked" and self.feeds[j].ready))
        ]
        if not others or self.clock[i] < min(others) + self.quantum_s:
          return  # still within its quantum: no switch
      self.state[i] = "run" if in_flight else "parked"
      self._pick(self.clock[i])
      while self.turn != i:
        self.cond.wait()
      self._since[i] = time.thread_time()

  def now(self, i: int) -> float:
    """Instance i's clock now (while it holds the turn)."""
    self._charge(i)
    return self.clock[i]

  def leave(self, i: int) -> None:
    with self.cond:
      self._charge(i)
      self.state[i] = "done"
      self._pick(self.clock[i])


# How far (CPU seconds) an instance may run ahead of the others before it
# hands over the turn: switching engines at every step costs each step its
# caches (weights, KV blocks), which instances on cores of their own never pay;
# at 10 ms that cost is small and work moves between instances at most 10 ms late.
QUANTUM_S = 0.01


def _run(gens, feeds, caps, sampling, seed, on_sample) -> Result:
  gate = _Turnstile(feeds, QUANTUM_S)
  samples: dict[int, Sample] = {}
  finished_at: dict[int, float] = {}
  errors: list[BaseException] = []

  def worker(i: int) -> None:
    gens[i].set_step_callback(lambda n: gate.step(i, n))
    gate.enter(i)
    try:
      for s in gens[i].generate(feeds[i], sampling, seed=seed, max_in_flight=caps[i]):
        out = on_sample(i, s)
        if out is not None:
          samples[out.prompt_id] = out
          finished_at[out.prompt_id] = gate.now(i)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
      for f in feeds:
        f.close()
    finally:
      gens[i].set_step_callback(None)
      gate.leave(i)

  threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(gens))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return Result(
      makespan_s=max(finished_at.values(), default=0.0),
      clocks=list(gate.clock),
      samples=samples,
      finished_at=finished_at,
  )


def run_fixed(gens, assignments, caps, sampling, *, seed: int | None = None) -> Result:
  """Instance i generates `assignments[i]` in order, at most `caps[i]` at once."""
  feeds = [Feed(as_requests(a)) for a in assignments]
  for f in feeds:
    f.close()
  return _run(gens, feeds, caps, sampling, seed, lambda i, s: s)


def run_pooled(gens, rnd: PooledRound, sampling, *, seed: int | None = None) -> Result:
  """The instances take their work from `rnd`'s shared pool (instance i of
  `gens` is instance i of the round)."""
  feeds = [Feed(straggler=rnd.straggler_limit(i)) for i in range(len(gens))]
  for i, f in enumerate(feeds):
    f.add(rnd.fill(i))
  lock = threading.Lock()

  def on_sample(i: int, s: Sample):
    with lock:
      out = rnd.on_sample(i, s)
      for j, order in rnd.orders(range(len(gens))):
        feeds[j].order(**order)
      return out

  with lock:
    for j, order in rnd.orders(range(len(gens))):
      feeds[j].order(**order)
  res = _run(gens, feeds, [rnd.caps[i] for i in range(len(gens))], sampling, seed, on_sample)
  res.moves = rnd.moves
  return res
