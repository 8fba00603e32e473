"""Discrete-event simulator of RL iterations: generation rounds, the trainer,
weight transfer (`simulate`).

Generation runs in generation.py (one `GenerationPhase` per round, planned by
plans.py); this loop starts the rounds, feeds the trainer and applies the mode.

Training. The trainer does per-sample forward-only work (reference/old
logprobs, values) and per-mini-batch updates; mini-batches are filled in
arrival order. Work time comes from costs.TrainCostModel.

Modes (all iterations draw fresh lengths from one seeded stream):
  colocated / verl: generation on all GPUs, then training on all GPUs, then
    the weights are resharded (`transfer_s`); nothing overlaps.
  sync:   disaggregated; trainer starts when the whole batch is generated;
          next generation after training + weight transfer.
  stream: disaggregated; trainer consumes samples as they finish; next
          generation after training + weight transfer.
  async:  like stream, but generation of iteration j runs with the weights of
          iteration j - 1 - max_staleness (one-step off-policy by default), so
          it overlaps training of the previous iteration.
  async with partial rollouts (`SimConfig.partial_oversample` > 0, as
          `pipeline.partial=on`): each round runs samples_per_iteration /
          group_size prompt groups plus that fraction more; once as many groups have
          finished as an iteration trains, the round stops, the trainer gets
          the oldest finished groups whole, and every response still running
          keeps its tokens and resumes next round (prefilling prompt + tokens
          so far, first in the plan). A response whose oldest token would be
          more than `max_token_version_gap` versions old starts again.

Controllers (elastic scaling). `simulate(config, controller=c)` calls
c(j, finished) when generation round j starts and runs the round on the count
it returns; `finished` holds every iteration whose training ended before that
moment. In sync, stream and colocated modes round j starts after iteration
j - 1 finished training (and the weight transfer), so a decision after j - 1
applies to round j. In async mode round j starts once round j - 1 is
generated and iteration j - 1 - max_staleness is trained, usually before
iteration j - 1 finishes training: a decision after iteration `it` then
applies to the first round that starts after it, round it + 1 + max_staleness
at the latest. A controller may also have a method `iteration_finished(stats)`:
the engine calls it the moment each iteration finishes training (before it
schedules the next round), which is when a real run decides, so decisions
after the last rounds have started are seen too.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import time
from typing import Callable, Sequence

import numpy as np

from streamrl.sim.config import SimConfig
from streamrl.sim.generation import GenerationPhase
from streamrl.sim.lengths import LengthDistribution
from streamrl.sim.partial import PartialBuffer
from streamrl.sim.plans import plan_round, plan_stoppable_round

_EV_INSTANCE, _EV_TRAIN, _EV_GEN_START = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class IterationStats:
  """What one finished iteration looked like (given to controllers)."""

  index: int
  num_instances: int
  gen_start: float
  gen_end: float
  train_start: float
  train_end: float
  train_busy: float
  output_lens: np.ndarray
  prompt_lens: np.ndarray

  @property
  def gen_time(self) -> float:
    return self.gen_end - self.gen_start

  @property
  def stage_gap(self) -> float:
    """Delta = generation time - training work time (> 0: generation-bound)."""
    return self.gen_time - self.train_busy


@dataclasses.dataclass(frozen=True)
class SimResult:
  """Outcome of `simulate`.

  samples_per_s: steady-state throughput (iterations after warmup).
  iteration_times: [iterations] time between consecutive training ends.
  gen_util / train_util: busy fraction of generator-instance time and of
    trainer time over the measured span; bubbles are 1 - util.
  skew_bubble: mean fraction of instance-time idle inside generation phases
    (instances that finished early while others still decode).
  instances: [iterations] generator instances each generation round ran on.
  decisions: the controller's `decisions` attribute after the run (e.g. the
    ElasticPolicy changes of planner.elastic.PolicyController); () without.
  resumed: partial rollouts: responses each round resumed (() without).
  wasted_tokens: partial rollouts: tokens dropped by the version-gap bound.
  moves: requests migrated between instances (SimConfig.migrate).
  """

  config: SimConfig
  samples_per_s: float
  iterations: tuple[IterationStats, ...]
  iteration_times: np.ndarray
  gen_util: float
  train_util: float
  skew_bubble: float
  preemptions: int
  events: int
  wall_s: float
  instances: tuple[int, ...] = ()
  decisions: tuple = ()
  resumed: tuple[int, ...] = ()
  wasted_tokens: int = 0
  moves: int = 0

  @property
  def gen_bubble(self) -> float:
    return 1.0 - self.gen_util

  @property
  def train_bubble(self) -> float:
    return 1.0 - self.train_util

  @property
  def mean_iteration_s(self) -> float:
    return float(self.config.samples_per_iteration / self.samples_per_s)

  def summary(self) -> dict:
    return {
        "mode": self.config.mode,
        "scheduler": self.config.scheduler,
        "samples_per_s": self.samples_per_s,
        "iteration_s": self.mean_iteration_s,
        "gen_bubble": self.gen_bubble,
        "train_bubble": self.train_bubble,
        "skew_bubble": self.skew_bubble,
        "preemptions": self.preemptions,
        "events": self.events,
    }


# controller(j, finished_iterations) -> generator instances for round j; see the
# module doc for when it is called, and for the optional `iteration_finished`.
Controller = Callable[[int, Sequence[IterationStats]], int]


class _Simulation:

  def __init__(self, config: SimConfig, controller: Controller | None):
    self.c = config
    self.controller = controller
    self.on_iteration = getattr(controller, "iteration_finished", None)
    self.heap: list = []
    self.seq = 0
    self.events = 0
    self.gen = GenerationPhase(
        config.gen,
        self._push_instance,
        self._on_sample,
        self._on_gen_done,
        config.gen_cores,
        config.tools,
        config.share_cost,
        config.migrate,
    )
    k = config.num_iterations
    self.gen_start = [math.nan] * k
    self.gen_end = [math.nan] * k
    self.refresh_end = 0.0  # when the ranker's refresh after the last round ends
    self.train_start = [math.nan] * k
    self.train_end = [math.nan] * k
    self.train_busy = [0.0] * k
    self.n_inst = [0] * k
    self.gen_busy = [0.0] * k
    self.samples: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self.fwd_s: dict[int, list] = {}
    self.upd_s: dict[int, list] = {}
    self.arrivals: dict[int, list] = collections.defaultdict(list)
    self.next_gen = 0
    self.gen_running = False
    self.gen_scheduled = False
    self.stats: list[IterationStats] = []
    # Trainer state.
    self.tj = 0
    self.t_busy = False
    self.fwd_done = 0
    self.upd_done = 0
    self.train_gpus = config.trainer_gpus
    self.partial = PartialBuffer(config) if config.partial else None
    self.resumed: list[int] = []

  def _push(self, t: float, kind: int, a, b) -> None:
    self.seq += 1
    heapq.heappush(self.heap, (t, self.seq, kind, a, b))

  def _push_instance(self, t: float, instance: int, payload) -> None:
    self._push(t, _EV_INSTANCE, instance, payload)

  def run(self) -> None:
    self._try_start_gen(0.0)
    heap = self.heap
    while heap:
      t, _, kind, a, b = heapq.heappop(heap)
      self.events += 1
      if kind == _EV_INSTANCE:
        self.gen.handle(t, a, b)
      elif kind == _EV_TRAIN:
        self._on_chunk_done(t, b)
      else:
        self._start_gen(t, a)

  # -- generation ---------------------------------------------------------

  def _weights_needed(self, g: int) -> int:
    """Training iteration whose weights generation g must use (-1: initial)."""
    lag = 1 + (self.c.max_staleness if self.c.mode == "async" else 0)
    return g - lag

  def _try_start_gen(self, now: float) -> None:
    g = self.next_gen
    if g >= self.c.num_iterations or self.gen_running or self.gen_scheduled:
      return
    ready = now if g == 0 else self.gen_end[g - 1]
    v = self._weights_needed(g)
    if v >= 0:
      if math.isnan(self.train_end[v]):
        return
      ready = max(ready, self.train_end[v] + self.c.transfer_s)
    self.gen_scheduled = True
    self._push(max(ready, now), _EV_GEN_START, g, None)

  def _start_gen(self, t: float, g: int) -> None:
    c = self.c
    self.gen_scheduled = False
    self.gen_running = True
    self.next_gen = g + 1
    n_inst = (
        c.num_instances if self.controller is None else int(self.controller(g, tuple(self.stats)))
    )
    if n_inst < 1:
      raise ValueError(f"the controller asked for {n_inst} generator instances; it must be >= 1.")
    self.n_inst[g] = n_inst
    dist = c.lengths_at(g)
    if self.partial is not None:
      self._start_partial(t, g, n_inst, dist)
      return
    prompt, out = dist.sample(np.random.default_rng([c.seed, g, 0]), c.samples_per_iteration)
    self.samples[g] = (prompt, out)
    tokens = (prompt + out).astype(np.float64)
    if c.tools is not None:  # the trainer scores the observations too (masked from the loss)
      tokens += c.tools.calls(out) * c.tools.observation_tokens
    self.fwd_s[g] = c.train.forward_seconds(tokens).tolist()
    self.upd_s[g] = c.train.update_seconds(tokens).tolist()
    if g > 0:
      recent = self.samples[g - 1][1]
    else:
      # No history yet: pretend the run has been going (a previous draw).
      recent = dist.sample(np.random.default_rng([c.seed, g, 3]), c.samples_per_iteration)[1]
    queues, caps = plan_round(
        c.gen,
        g,
        n_inst,
        prompt,
        out,
        recent,
        scheduler=c.scheduler,
        ranker_sigma=c.ranker_sigma,
        long_tail_alpha=c.long_tail_alpha,
        objective=c.objective,
        latency_model=c.latency_model,
        seed=c.seed,
    )
    self.gen_start[g] = t
    self.gen_phase_iter = g
    self.gen.start(self._begins(t, g), prompt, out, queues, caps, shared=c.pool == "shared")

  def _begins(self, t: float, g: int) -> float:
    """When round g, started at t, starts generating: after what is left of the
    ranker's refresh (`SimConfig.ranker_refresh_s`) on the generators' core,
    and later by `SimConfig.added_round_s` per instance added since round g-1."""
    added = self.n_inst[g] - self.n_inst[g - 1] if g > 0 else 0
    return max(t, self.refresh_end) + self.c.added_round_s * max(0, added)

  def _start_partial(self, t: float, g: int, n_inst: int, dist: LengthDistribution) -> None:
    """Round g with partial rollouts: the buffer's requests, resumed first;
    the trained samples are known when it stops (`_finish_partial`)."""
    c = self.c
    ctx, left, full = self.partial.start(g, dist)
    queues, caps = plan_stoppable_round(
        c.gen,
        g,
        n_inst,
        ctx,
        full,
        self.partial.resumed_requests(),
        scheduler=c.scheduler,
        ranker_sigma=c.ranker_sigma,
        seed=c.seed,
    )
    self.resumed.append(self.partial.resumed)
    self.gen_start[g] = t
    self.gen_phase_iter = g
    self.gen.start(
        self._begins(t, g),
        ctx,
        left,
        queues,
        caps,
        shared=c.pool == "shared",
    )

  def _finish_partial(self, g: int) -> None:
    """Round g stopped: its trained samples, all arriving at once (the
    trainer gets the round's batch when it ends, as PartialAsyncMode does)."""
    prompt, out = self.partial.stop(self.gen.carried)
    self.samples[g] = (prompt, out)
    tokens = (prompt + out).astype(np.float64)
    self.fwd_s[g] = self.c.train.forward_seconds(tokens).tolist()
    self.upd_s[g] = self.c.train.update_seconds(tokens).tolist()
    self.arrivals[g] = list(range(len(out)))

  def _on_sample(self, t: float, sid: int, inst: int) -> None:
    if self.partial is not None:
      if self.partial.finish(sid):
        self.gen.stop_requested = True
      return
    g = self.gen_phase_iter
    self.arrivals[g].append(sid)
    if self.c.mode in ("stream", "async") and g == self.tj:
      self._train_try(t)

  def _on_gen_done(self, t: float) -> None:
    g = self.gen_phase_iter
    if self.partial is not None:
      self._finish_partial(g)
    self.gen_end[g] = t
    self.gen_busy[g] = self.gen.busy_time()
    self.gen_running = False
    self.refresh_end = t + self.c.ranker_refresh_s  # the ranker refreshes on the round's lengths
    if g == self.tj:
      self._train_try(t)
    self._try_start_gen(t)

  # -- training -----------------------------------------------------------

  def _train_try(self, t: float) -> None:
    j = self.tj
    if self.t_busy or j >= self.c.num_iterations:
      return
    arrived = self.arrivals.get(j, ())
    streaming = self.c.mode in ("stream", "async")
    generated = not math.isnan(self.gen_end[j])
    if not streaming and not generated:
      return
    p = self.c.samples_per_iteration
    mb = self.c.mini_batch_size
    u = self.upd_done
    mb_end = min((u + 1) * mb, p)
    # stream runs each mini-batch's first epoch during generation, the other epochs
    # after it (pipeline/stream.py); the other modes' update chunks hold every epoch.
    # (The loop also waits for a full mini-batch before its forward work; modelling
    # that too moved the paper reproduction's stream cells away from the paper.)
    epochs = self.c.ppo_epochs if self.c.mode == "stream" else 1
    ready = len(arrived)
    if u * mb >= p:  # stream's later epochs, over every mini-batch
      work = sum(self.upd_s[j]) * (epochs - 1) / epochs
      work += (epochs - 1) * self.c.num_minibatches * self.c.train.update_overhead_s
      kind = ("epochs", p)
    elif self.fwd_done >= mb_end:
      ids = arrived[u * mb : mb_end]
      work = sum(self.upd_s[j][s] for s in ids) / epochs
      kind = ("upd", mb_end)
    elif ready > self.fwd_done:
      ids = arrived[self.fwd_done : ready]
      work = sum(self.fwd_s[j][s] for s in ids)
      kind = ("fwd", ready)
    else:
      return
    if math.isnan(self.train_start[j]):
      self.train_start[j] = t
    tr = self.c.train
    overhead = {"upd": tr.update_overhead_s, "fwd": tr.fwd_overhead_s}.get(kind[0], 0.0)
    dur = work / self.train_gpus + overhead
    self.train_busy[j] += dur
    self.t_busy = True
    self._push(t + dur, _EV_TRAIN, None, kind)

  def _on_chunk_done(self, t: float, kind) -> None:
    self.t_busy = False
    what, upto = kind
    if what == "fwd":
      self.fwd_done = upto
    else:
      self.upd_done += what == "upd"
      stream_epochs = self.c.mode == "stream" and self.c.ppo_epochs > 1
      if upto >= self.c.samples_per_iteration and (what == "epochs" or not stream_epochs):
        j = self.tj
        self.train_end[j] = t
        prompt, out = self.samples[j]
        self.stats.append(
            IterationStats(
                index=j,
                num_instances=self.n_inst[j],
                gen_start=self.gen_start[j],
                gen_end=self.gen_end[j],
                train_start=self.train_start[j],
                train_end=t,
                train_busy=self.train_busy[j],
                output_lens=out,
                prompt_lens=prompt,
            )
        )
        if self.on_iteration is not None:
          self.on_iteration(self.stats[-1])
        # Free per-iteration buffers that are no longer needed.
        self.fwd_s.pop(j, None)
        self.upd_s.pop(j, None)
        self.arrivals.pop(j, None)
        if j >= 1:
          self.samples.pop(j - 1, None)
        self.tj += 1
        self.fwd_done = 0
        self.upd_done = 0
        self._try_start_gen(t)
    self._train_try(t)


def simulate(config: SimConfig, controller: Controller | None = None) -> SimResult:
  """Runs `config.num_iterations` iterations and returns throughput and stage statistics.

  controller(j, finished_iterations) -> number of generator instances for
  iteration j (elastic scaling); None keeps config.num_instances. See the
  module doc for when it is called in each mode.
  """
  t0 = time.perf_counter()
  sim = _Simulation(config, controller)
  sim.run()
  wall = time.perf_counter() - t0
  c = config
  ends = np.asarray(sim.train_end)
  if np.any(np.isnan(ends)):
    raise RuntimeError("simulation ended before every iteration finished training.")
  w = min(max(c.warmup, 1 if c.num_iterations > 1 else 0), c.num_iterations - 1)
  t_from = ends[w - 1] if w > 0 else 0.0
  span = ends[-1] - t_from
  thr = c.samples_per_iteration * (c.num_iterations - w) / span
  iter_times = np.diff(np.concatenate([[0.0], ends]))
  # Utilisation over the measured span.
  colocated = c.mode in ("colocated", "verl")
  gpus_gen = sum(sim.n_inst[w:]) / max(1, c.num_iterations - w)
  gen_busy = sum(sim.gen_busy[w:])
  gen_util = gen_busy / (gpus_gen * span) if span > 0 else 0.0
  train_util = sum(sim.train_busy[w:]) / span if span > 0 else 0.0
  if colocated:
    # Same GPUs do both: utilisation is the share of time doing either.
    gen_util = gen_util + train_util
    train_util = gen_util
  phase = [(sim.gen_end[j] - sim.gen_start[j]) * sim.n_inst[j] for j in range(w, c.num_iterations)]
  skew = 1.0 - gen_busy / sum(phase) if sum(phase) > 0 else 0.0
  return SimResult(
      config=c,
      samples_per_s=float(thr),
      iterations=tuple(sim.stats),
      iteration_times=iter_times,
      gen_util=float(gen_util),
      train_util=float(train_util),
      skew_bubble=float(skew),
      preemptions=sim.gen.preemptions,
      events=sim.events,
      wall_s=wall,
      instances=tuple(int(n) for n in sim.n_inst),
      decisions=tuple(getattr(controller, "decisions", ())),
      resumed=tuple(sim.resumed),
      wasted_tokens=sim.partial.wasted if sim.partial is not None else 0,
      moves=sim.gen.moves,
  )
