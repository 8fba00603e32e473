"""The generation phase: generator instances running continuous batching
(`GenerationPhase`; `simulate_generation` runs one phase alone).

Generation. Each instance runs continuous batching: at most `cap` sequences in
flight (and no more KV tokens than the instance holds); whenever a sequence
finishes, the next one in the instance's queue is admitted (prefill cost is
added to the instance's clock). Between two events the batch is constant, so
the time of n decode steps is closed-form (costs.GenCostModel.decode_time):
events are admissions, finishes and KV-cache overflows (the newest sequence
is preempted and recomputed later, like vLLM), never single tokens.

Which instance runs which prompt comes from plans.py (the project's
scheduler, fed a simulated ranker's scores).

Shared cores (`SimConfig.gen_cores`). None: every instance has hardware of its
own. An int: the instances share that many cores (one machine's generation
pool); while m > gen_cores instances are decoding, each runs m / gen_cores
times slower (its prefill and decode costs scale by that factor). m counts the
instances of the current round that still have work, so an instance that has
emptied its queue hands its share to the others (their pending events are
moved to the new speed). Generation throughput then saturates at gen_cores
instances instead of growing with every instance added. Time-sharing is not
free (context switches, caches and memory bandwidth split between engines):
`SimConfig.share_cost` multiplies a shared instance's costs once more, the
slowdown measured over perfect sharing (experiments/bench/bench_elastic.py measures
it for two instances on one core).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Callable, Sequence

import numpy as np

from streamrl.scheduling.config import Scheduler
from streamrl.scheduling.pool import POOLS, donor
from streamrl.sim.config import ToolModel
from streamrl.sim.costs import GenCostModel
from streamrl.sim.plans import plan_round

# Admission keeps this fraction of the KV cache free (vLLM's watermark), so a
# newly admitted sequence does not force an immediate preemption.
_KV_WATERMARK = 0.01

_FINISH, _KV_FULL = 0, 1
_TOOL_RETURN = "tool"  # an event payload: (this, sample id)


class _Instance:
  __slots__ = (
      "idx",
      "t",
      "k",
      "S",
      "B",
      "R",
      "heap",
      "stack",
      "queue",
      "cap",
      "version",
      "active",
      "start_t",
      "done_t",
      "ev_t",
      "ev_kind",
      "ev_k",
      "out",
  )

  def __init__(self, idx: int):
    self.idx = idx
    self.version = 0
    self.active = False


class GenerationPhase:
  """All generator instances during one round's generation.

  The owner runs the event loop: `push(t, instance, payload)` asks it to call
  `handle(t, instance, payload)` at time t. `on_finish(t, sample, instance)`
  is told each finished sample, `on_done(t)` the end of the round; `start`
  begins a round. `cores`, `tools`, `share_cost`, `migrate`: as
  SimConfig.gen_cores, .tools, .share_cost, .migrate.
  """

  def __init__(
      self,
      gen: GenCostModel,
      push: Callable,
      on_finish: Callable,
      on_done: Callable,
      cores: int | None = None,
      tools: ToolModel | None = None,
      share_cost: float = 1.0,
      migrate: bool = False,
  ):
    self.gen = gen
    self.migrate = bool(migrate)
    self.moves = 0
    self.cores = cores
    self.share_cost = float(share_cost)
    self.tools = tools
    self.scale = 1.0  # cost factor of time-sharing `cores` (1: no sharing)
    self.push = push
    self.on_finish = on_finish
    self.on_done = on_done
    self.instances: list[_Instance] = []
    self.preemptions = 0
    self.kv_limit = gen.kv_capacity_tokens * (1.0 - _KV_WATERMARK)
    self.reserve = float(gen.reserve_output_tokens)
    # Partial rollouts: on_finish sets stop_requested to end the round; then
    # `carried` holds every unfinished sample's tokens generated this round
    # (both reset by `start`).
    self.stop_requested = False
    self.carried: dict[int, int] = {}

  def start(
      self,
      t: float,
      prompt_lens: Sequence[int],
      output_lens: Sequence[int],
      queues: Sequence[Sequence[int]],
      caps: Sequence[int],
      shared: bool = False,
  ) -> None:
    n = len(queues)
    if shared:  # one queue for all: the lists interleaved, each instance takes from it
      one = collections.deque(
          q[k] for k in range(max(map(len, queues), default=0)) for q in queues if k < len(q)
      )
      queues = [one if one else ()] * n
    while len(self.instances) < n:
      self.instances.append(_Instance(len(self.instances)))
    # Per-sample state of this iteration.
    self.ctx0 = [int(p) for p in prompt_lens]  # context to prefill on (re)admission
    self.ctx_start = list(self.ctx0)
    self.finished = [False] * len(self.ctx0)
    self.stop_requested = False
    self.carried = {}
    self.remaining = [int(o) for o in output_lens]  # tokens still to generate in this turn
    self.later = [0] * len(self.ctx0)  # tokens of the turns after this one
    # Context still in the engine's prefix cache on (re)admission: a trajectory back from a
    # tool prefills only its observation; a preempted sample recomputes everything.
    self.cached = [0] * len(self.ctx0)
    if self.tools is not None:
      turn = self.tools.turn_tokens
      self.later = [max(r - turn, 0) for r in self.remaining]
      self.remaining = [min(r, turn) for r in self.remaining]
    self.admit_k = [0] * len(self.ctx0)
    self.finish_k = [-1] * len(self.ctx0)
    self.running = [-1] * len(self.ctx0)  # the instance each sample runs on (-1: none)
    self.n_active = 0
    self.scale = self._scale(sum(1 for q in queues if len(q)))
    for inst, q, cap in zip(self.instances[:n], queues, caps):
      inst.t, inst.k, inst.S, inst.B, inst.R = t, 0, 0.0, 0, 0.0
      inst.heap, inst.stack = [], []
      inst.queue = q if shared and len(q) else collections.deque(q)
      inst.out = 0  # its samples waiting on a tool
      inst.cap = max(1, min(int(cap), self.gen.max_num_seqs))
      inst.start_t, inst.done_t = t, t
      inst.version += 1
      inst.active = bool(q)
      if inst.active:
        self._admit(inst)
        if inst.B == 0 and not inst.queue:  # a shared pool the others emptied
          inst.active = False
          continue
        self.n_active += 1
        self._schedule(inst)
    for inst in self.instances[n:]:
      inst.active = False
      inst.version += 1
    self.num_used = n
    if self.n_active == 0:
      self.on_done(t)

  def _scale(self, active: int) -> float:
    if self.cores is None or active <= self.cores:
      return 1.0
    return active / self.cores * self.share_cost

  def _reshare(self, t: float) -> None:
    """The number of decoding instances changed at t: move pending events to the new speed."""
    scale = self._scale(self.n_active)
    if scale == self.scale:
      return
    ratio = scale / self.scale
    self.scale = scale
    for inst in self.instances[: self.num_used]:
      if inst.active and inst.B > 0:
        inst.ev_t = t + (inst.ev_t - t) * ratio
        inst.version += 1
        self.push(inst.ev_t, inst.idx, (inst.version, inst.ev_kind, inst.ev_k))

  def _admit(self, inst: _Instance) -> None:
    prefill = 0
    ctx0, rem = self.ctx0, self.remaining
    while inst.queue and inst.B < inst.cap:
      sid = inst.queue[0]
      need = ctx0[sid] + 1
      if inst.B > 0 and inst.S + need > self.kv_limit:
        break  # Wait for a finish to free KV blocks (head-of-line, like vLLM).
      if (
          self.reserve > 0
          and inst.B > 0
          and inst.R + need + self.reserve > self.gen.kv_capacity_tokens
      ):
        break  # Reserving engine: wait until a finish releases a reservation.
      if need + rem[sid] > self.gen.kv_capacity_tokens:
        raise ValueError(
            f"a sequence of {need + rem[sid]} tokens does not fit in the KV cache of "
            f"{self.gen.name or 'an instance'} ({self.gen.kv_capacity_tokens:.0f} tokens); "
            "use a larger tensor-parallel degree or shorter outputs."
        )
      inst.queue.popleft()
      self.admit_k[sid] = inst.k
      self.running[sid] = inst.idx
      self.finish_k[sid] = inst.k + rem[sid]
      heapq.heappush(inst.heap, (inst.k + rem[sid], sid))
      inst.stack.append(sid)
      inst.S += ctx0[sid]
      inst.R += need + self.reserve
      inst.B += 1
      prefill += ctx0[sid] - self.cached[sid]
    if self.scale == 1.0:
      inst.t += prefill * self.gen.prefill_s_per_token
    else:
      inst.t += prefill * self.gen.prefill_s_per_token * self.scale

  def _schedule(self, inst: _Instance) -> None:
    if inst.B == 0:
      return
    heap, running, finish_k = inst.heap, self.running, self.finish_k
    # Lazily drop entries of preempted sequences (a re-admitted one has a new entry).
    while not (running[heap[0][1]] == inst.idx and heap[0][0] == finish_k[heap[0][1]]):
      heapq.heappop(heap)
    n_fin = heap[0][0] - inst.k
    room = self.gen.kv_capacity_tokens - inst.S
    if room >= n_fin * inst.B:  # also covers an unbounded cache
      n_kv = n_fin
    else:
      n_kv = math.floor(room / inst.B) if room > 0 else 0
    if n_kv >= n_fin:
      kind, n = _FINISH, n_fin
    else:
      kind, n = _KV_FULL, n_kv
    if self.scale == 1.0:
      t_ev = inst.t + self.gen.decode_time(inst.B, inst.S, n)
    else:
      t_ev = inst.t + self.gen.decode_time(inst.B, inst.S, n) * self.scale
    inst.version += 1
    inst.ev_t, inst.ev_kind, inst.ev_k = t_ev, kind, inst.k + n
    self.push(t_ev, inst.idx, (inst.version, kind, inst.k + n))

  def _tool_return(self, t: float, inst: _Instance, sid: int) -> None:
    """`sid`'s tool call answered: its next turn queues ahead of new prompts."""
    inst.out -= 1
    inst.queue.appendleft(sid)
    if inst.B == 0:  # idle, waiting on tools: admit now
      inst.t = max(inst.t, t)
      self._admit(inst)
      self._schedule(inst)

  def _call_tool(self, t: float, inst: _Instance, sid: int, generated: int) -> None:
    """`sid` finished a turn with tokens left: out of the batch for the tool's latency."""
    tools = self.tools
    self.cached[sid] = self.ctx0[sid] + generated
    self.ctx0[sid] += generated + tools.observation_tokens
    self.remaining[sid] = min(self.later[sid], tools.turn_tokens)
    self.later[sid] -= self.remaining[sid]
    inst.out += 1
    self.push(t + tools.latency_s, inst.idx, (_TOOL_RETURN, sid))

  def handle(self, t: float, idx: int, payload) -> None:
    inst = self.instances[idx]
    if payload[0] == _TOOL_RETURN:
      if inst.active:
        self._tool_return(t, inst, payload[1])
      return
    version, kind, k_target = payload
    if version != inst.version or not inst.active:
      return
    n = k_target - inst.k
    inst.S += inst.B * n
    inst.k = k_target
    inst.t = t
    finished = []
    if kind == _FINISH:
      heap = inst.heap
      while heap and heap[0][0] <= inst.k:
        f, sid = heapq.heappop(heap)
        if self.running[sid] != inst.idx or f != self.finish_k[sid]:
          continue
        self.running[sid] = -1
        inst.B -= 1
        generated = inst.k - self.admit_k[sid]
        inst.S -= self.ctx0[sid] + generated
        inst.R -= self.ctx0[sid] + 1 + self.reserve
        if self.later[sid] > 0:
          self._call_tool(t, inst, sid, generated)
        else:
          if self.finished[sid]:
            raise RuntimeError(f"sample {sid} finished twice; this is a bug of the simulator.")
          finished.append(sid)
          self.finished[sid] = True
    else:
      # KV cache full: preempt the newest sequence; it recomputes its context later.
      while True:
        sid = inst.stack.pop()
        if self.running[sid] == inst.idx:
          break
      self._evict(inst, sid)
      inst.queue.appendleft(sid)
      self.preemptions += 1
      if inst.B == 0:
        raise ValueError(
            f"one sequence alone overflows the KV cache of {self.gen.name or 'an instance'}; "
            "use a larger tensor-parallel degree or shorter outputs."
        )
    if finished:
      # Compact the admission stack now and then so preemption stays O(1) amortised.
      if len(inst.stack) > 4 * inst.B + 64:
        inst.stack = [s for s in inst.stack if self.running[s] == inst.idx]
      for sid in finished:
        self.on_finish(t, sid, idx)
      if self.stop_requested:
        self._stop(t)
        return
    if kind == _FINISH:
      self._admit(inst)
    if inst.B == 0 and not inst.queue and inst.out:
      return  # idle until a tool answers (`_tool_return`)
    if inst.B == 0 and not inst.queue and self.migrate and self._steal(t, inst):
      self._schedule(inst)
      return
    if inst.B == 0 and not inst.queue:
      inst.active = False
      inst.done_t = t
      self.n_active -= 1
      if self.n_active == 0:
        self.on_done(t)
      elif self.cores is not None:
        self._reshare(t)
      return
    if inst.B == 0:
      self._admit(inst)
    self._schedule(inst)

  def _running_on(self, inst: _Instance) -> set[int]:
    """The samples `inst` is decoding (its heap's valid entries)."""
    return {
        sid for f, sid in inst.heap if self.running[sid] == inst.idx and f == self.finish_k[sid]
    }

  def _evict(self, inst: _Instance, sid: int) -> None:
    """Takes running `sid` out of `inst`'s batch (preempted or migrated): its
    tokens so far join the context it prefills again when next admitted."""
    generated = inst.k - self.admit_k[sid]
    self.running[sid] = -1
    inst.B -= 1
    inst.S -= self.ctx0[sid] + generated
    inst.R -= self.ctx0[sid] + 1 + self.reserve
    self.ctx0[sid] += generated
    self.remaining[sid] -= generated
    self.cached[sid] = 0

  def _advance(self, t: float, inst: _Instance) -> None:
    """Brings a decoding instance's state to t, part of the way to its next
    event (whole steps; it never reaches the event itself)."""
    if inst.B == 0 or not (inst.ev_t > inst.t and t > inst.t):
      return
    n = int((inst.ev_k - inst.k) * min(1.0, (t - inst.t) / (inst.ev_t - inst.t)))
    n = min(n, inst.ev_k - inst.k - 1)
    if n > 0:
      inst.S += inst.B * n
      inst.k += n
      inst.t = t

  def _steal(self, t: float, thief: _Instance) -> bool:
    """Migration (shared pool, pool empty): idle `thief` takes the running
    request with the most tokens from the instance with the most in flight
    (`pool.donor`, at least 2), which resumes here from its tokens so far;
    False when no instance has one to give."""
    loads = {i.idx: i.B for i in self.instances[: self.num_used] if i.active and i is not thief}
    d = donor(loads, thief.idx)
    if d is None:
      return False
    inst = self.instances[d]
    self._advance(t, inst)
    sid = min(self._running_on(inst), key=lambda x: (self.admit_k[x], x))  # most tokens so far
    self._evict(inst, sid)
    self.moves += 1
    self._schedule(inst)
    thief.queue.appendleft(sid)
    thief.t = max(thief.t, t)
    self._admit(thief)
    return True

  def _stop(self, t: float) -> None:
    """The round ends at t (partial rollouts): every sequence still running
    keeps the tokens it has by then, `carried` maps each unfinished sample
    to its tokens of this round, and the phase is done."""
    # Tokens a preempted sample generated before it went back to its queue.
    carried = {
        sid: self.ctx0[sid] - self.ctx_start[sid]
        for sid, done in enumerate(self.finished)
        if not done
    }
    for inst in self.instances[: self.num_used]:
      if not inst.active:
        continue
      self._advance(t, inst)
      for sid in self._running_on(inst):
        self.running[sid] = -1
        carried[sid] = self.ctx0[sid] - self.ctx_start[sid] + inst.k - self.admit_k[sid]
      inst.active = False
      inst.done_t = t
      inst.version += 1
    self.carried = carried
    self.n_active = 0
    self.on_done(t)

  def busy_time(self) -> float:
    return sum(inst.done_t - inst.start_t for inst in self.instances[: self.num_used])


@dataclasses.dataclass(frozen=True)
class GenResult:
  """One generation phase alone."""

  makespan: float
  finish_times: np.ndarray  # [P] seconds from start, per prompt
  instance_done: np.ndarray  # [N]
  preemptions: int
  events: int
  moves: int = 0  # running requests migrated (pool="shared", migrate=True)


def simulate_generation(
    gen: GenCostModel,
    num_instances: int,
    prompt_lens: Sequence[int],
    output_lens: Sequence[int],
    *,
    scheduler: str = "fifo",
    ranker_sigma: float = 0.0,
    recent_lengths: Sequence[int] | None = None,
    long_tail_alpha: float = Scheduler.long_tail_alpha,
    objective: str = "sum",
    seed: int = 0,
    latency_model: str = "paper",
    queues: Sequence[Sequence[int]] | None = None,
    caps: Sequence[int] | None = None,
    cores: int | None = None,
    tools: ToolModel | None = None,
    pool: str = "fixed",
    share_cost: float = 1.0,
    migrate: bool = False,
) -> GenResult:
  """Generation of one batch on `num_instances` instances (no trainer).

  `queues`/`caps` bypass the scheduler (explicit per-instance admission order
  and batch caps); otherwise the scheduler is "fifo" or "skew" as in SimConfig.
  `cores`, `share_cost`: as SimConfig.gen_cores (the instances share that
  many cores) and SimConfig.share_cost;
  `tools`: as SimConfig.tools (multi-turn trajectories); `pool`, `migrate`:
  as SimConfig.pool and SimConfig.migrate.
  """
  prompt = np.asarray(prompt_lens, dtype=np.int64)
  out = np.asarray(output_lens, dtype=np.int64)
  if prompt.shape != out.shape or out.size == 0:
    raise ValueError("give one prompt length per output length, and at least one sample.")
  if np.any(out <= 0) or np.any(prompt <= 0):
    raise ValueError("prompt and output lengths must be positive.")
  if cores is not None and cores < 1:
    raise ValueError(f"cores must be None or >= 1, got {cores}.")
  if queues is None:
    recent = out if recent_lengths is None else np.asarray(recent_lengths)
    queues, caps = plan_round(
        gen,
        0,
        num_instances,
        prompt,
        out,
        recent,
        scheduler=scheduler,
        ranker_sigma=ranker_sigma,
        long_tail_alpha=long_tail_alpha,
        objective=objective,
        latency_model=latency_model,
        seed=seed,
    )
  elif caps is None:
    caps = [gen.max_num_seqs] * len(queues)
  heap: list = []
  counter = [0]
  finish = np.full(out.size, np.nan)
  done = [math.nan]

  def push(t, a, b):
    counter[0] += 1
    heapq.heappush(heap, (t, counter[0], a, b))

  def on_finish(t, sid, inst):
    finish[sid] = t

  def on_done(t):
    done[0] = t

  if not (math.isfinite(share_cost) and share_cost >= 1.0):
    raise ValueError(f"share_cost must be a finite factor >= 1, got {share_cost!r}.")
  if pool not in POOLS or (migrate and pool != "shared"):
    raise ValueError(f'pool must be one of {POOLS} ("shared" to migrate), got {pool!r}.')
  phase = GenerationPhase(gen, push, on_finish, on_done, cores, tools, share_cost, migrate)
  phase.start(0.0, prompt, out, queues, caps, shared=pool == "shared")
  events = 0
  while heap:
    t, _, a, b = heapq.heappop(heap)
    events += 1
    phase.handle(t, a, b)
  inst_done = np.asarray([i.done_t for i in phase.instances[: phase.num_used]])
  return GenResult(
      makespan=float(done[0]),
      finish_times=finish,
      instance_done=inst_done,
      preemptions=phase.preemptions,
      events=events,
      moves=phase.moves,
  )
