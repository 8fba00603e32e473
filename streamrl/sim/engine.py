"""Discrete-event simulator of RL iterations: generators, trainer, weight transfer.

Generation. Each instance runs continuous batching: at most `cap` sequences in
flight (and no more KV tokens than the instance holds); whenever a sequence
finishes, the next one in the instance's queue is admitted (prefill cost is
added to the instance's clock). Between two events the batch is constant, so
the time of n decode steps is closed-form (costs.GenCostModel.decode_time):
events are admissions, finishes and KV-cache overflows (the newest sequence
is preempted and recomputed later, like vLLM), never single tokens.

Scheduling. Prompts go to instances through the project's real scheduler
(`streamrl.scheduling`): `fifo_plan` (random FIFO, round-robin) or `dispatch`
(Algorithm 2: long-tail prompts on instances running small batches, LPT order
inside each instance), fed with a simulated ranker's scores
(`ranker_model.noisy_scores`).

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
          `pipeline.partial=on`): each round runs `batch_size / group_size`
          prompt groups plus that fraction more; once as many groups have
          finished as an iteration trains, the round stops, the trainer gets
          the oldest finished groups whole, and every response still running
          keeps its tokens and resumes next round (prefilling prompt + tokens
          so far, first in the plan). A response whose oldest token would be
          more than `max_token_version_gap` versions old starts again.

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
slowdown measured over perfect sharing (experiments/bench_elastic.py measures
it for two instances on one core).

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

from streamrl.scheduling import dispatch, fifo_plan
from streamrl.scheduling.dispatch import first_k_plan, rank_quantiles
from streamrl.scheduling.pool import POOLS, donor
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.lengths import LengthDistribution
from streamrl.sim.ranker_model import noisy_scores

MODES = ("colocated", "verl", "sync", "stream", "async")
SCHEDULERS = ("fifo", "skew")

# Admission keeps this fraction of the KV cache free (vLLM's watermark), so a
# newly admitted sequence does not force an immediate preemption.
_KV_WATERMARK = 0.01

_EV_INSTANCE, _EV_TRAIN, _EV_GEN_START = 0, 1, 2
_FINISH, _KV_FULL = 0, 1
_TOOL_RETURN = "tool"  # an _EV_INSTANCE payload: (this, sample id)


@dataclasses.dataclass(frozen=True)
class ToolModel:
  """Multi-turn trajectories (streamrl/envs): a sample's output is written in
  turns of `turn_tokens` policy tokens (the last one shorter), and between two
  turns it calls a tool: it leaves its instance's batch for `latency_s` (the
  engine decodes the others meanwhile), then comes back with
  `observation_tokens` more context, of which only the observation is
  prefilled (the rest is in the prefix cache), ahead of the instance's
  pending prompts, at the instance's next admission (or at once when its
  batch is empty). A sample of L output tokens makes ceil(L / turn_tokens) - 1
  calls, so long trajectories are the many-turn ones, as in an agentic run.
  Admission inside a running batch waits for the next finish, as every
  admission in this engine does."""

  latency_s: float
  turn_tokens: int
  observation_tokens: int = 0

  def __post_init__(self):
    if self.latency_s < 0 or self.turn_tokens < 1 or self.observation_tokens < 0:
      raise ValueError(
          "tool latency_s and observation_tokens must be >= 0 and turn_tokens >= 1, got "
          f"{self.latency_s}, {self.observation_tokens} and {self.turn_tokens}."
      )

  def calls(self, output_tokens) -> np.ndarray:
    """Tool calls of samples of these output lengths."""
    out = np.asarray(output_tokens, np.int64)
    return np.maximum(-(-out // self.turn_tokens) - 1, 0)


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated run.

  Attributes:
    mode: one of MODES.
    gen: cost of one generator instance.
    num_instances: generator instances (each gen.gpus GPUs).
    train: trainer cost model.
    num_train_gpus: GPUs the trainer runs on (all GPUs when colocated).
    lengths: length distribution, or one per iteration (len >= iterations).
    batch_size: samples per iteration.
    num_minibatches: PPO mini-batches per iteration (updates are sequential).
    iterations: iterations simulated.
    warmup: iterations excluded from the steady-state throughput (>= 1 when
      iterations > 1: the first async iteration has no overlap).
    scheduler: "fifo" (random FIFO) or "skew" (Algorithm 2 + LPT).
    ranker_sigma: log-space noise of the simulated ranker (0 = oracle).
    alpha: long-tail fraction for Algorithm 2.
    dispatch_objective: "sum" (the paper) or "makespan".
    dispatch_latency_model: Algorithm 2's latency estimate, "paper"
      (PTL(BS) * L_avg * ceil(M / BS)) or "simulate" (continuous batching
      replayed per instance); see streamrl.scheduling.dispatch.
    transfer_s: weight transfer (or colocated reshard) seconds per update.
    max_staleness: async only; generation j uses weights of j-1-max_staleness.
    seed: all randomness derives from it.
    gen_cores: cores the generator instances share (one machine's generation
      pool), in units of what one instance uses alone (pool cores / threads
      per instance); None = each instance has its own hardware. With more
      instances decoding than that, each one's costs scale by
      instances / gen_cores.
    share_cost: the extra cost factor (>= 1) of an instance while more
      instances decode than there are `gen_cores`, over perfect time-sharing;
      1.0 = sharing costs nothing.
    tools: multi-turn trajectories with tool calls (`ToolModel`); None:
      single-turn samples.
    partial_oversample: async only; > 0 turns partial rollouts on (see the
      module doc): each round starts max(1, ceil(groups * this)) extra groups.
    group_size: samples per prompt group (batch_size / group_size groups per
      iteration); partial rollouts train whole groups.
    max_token_version_gap: partial rollouts: the oldest token a response may
      carry into training, in weight versions.
    pool: "fixed" (each instance admits from its own list) or "shared" (every
      instance admits from one queue, the plan's lists interleaved: the
      shared work pool of streamrl/scheduling/pool.py).
    ppo_epochs: passes over the batch per iteration; TrainCostModel's update
      cost covers them all. Stream trains each mini-batch's first epoch as it
      fills and the others after generation (the other modes: all epochs
      after their forward work, so only stream's timing depends on it).
    migrate: with pool="shared", stragglers move as `scheduler.migrate`
      moves them: once the pool is empty, an idle instance takes the running
      request with the most tokens from the instance with the most in flight
      (`pool.donor`), which resumes there (prefilling prompt + tokens so far).
    ranker_refresh_s: seconds of the generation side's core that the length
      ranker's refresh takes after each round (`scheduler.kind="skew"` with
      `ranker_side="generators"`: the refresh runs beside the generators,
      at a lower priority, from the round's end). What of it is left when
      the next round starts is taken from that round's generation (one core:
      the refresh's leftover seconds add to the round); 0: no refresh.
    added_round_s: seconds by which a round run on more instances than the
      round before starts generating later, per added instance: an added
      engine's first round is slow (its first steps, caches filling), which
      the latency profile of a warm engine does not hold. Measured on the
      generator alone (experiments/bench_elastic.py: the first two-instance
      round after the addition against the later ones); 0: not modelled.
  """

  mode: str
  gen: GenCostModel
  num_instances: int
  train: TrainCostModel
  num_train_gpus: int
  lengths: LengthDistribution | tuple
  batch_size: int = 1024
  num_minibatches: int = 4
  iterations: int = 4
  warmup: int = 1
  scheduler: str = "fifo"
  ranker_sigma: float = 0.0
  alpha: float = 0.2
  dispatch_objective: str = "sum"
  dispatch_latency_model: str = "paper"
  transfer_s: float = 0.0
  max_staleness: int = 1
  seed: int = 0
  gen_cores: int | None = None
  share_cost: float = 1.0
  tools: ToolModel | None = None
  pool: str = "fixed"
  partial_oversample: float = 0.0
  group_size: int = 1
  max_token_version_gap: int = 2
  migrate: bool = False
  ppo_epochs: int = 1
  ranker_refresh_s: float = 0.0
  added_round_s: float = 0.0

  @property
  def partial(self) -> bool:
    return self.partial_oversample > 0

  def __post_init__(self):
    if self.ppo_epochs < 1:
      raise ValueError(f"ppo_epochs must be >= 1, got {self.ppo_epochs}.")
    if self.group_size < 1 or self.batch_size % self.group_size:
      raise ValueError(
          f"batch_size={self.batch_size} must be a multiple of group_size={self.group_size}."
      )
    if self.partial:
      if self.mode != "async" or self.tools is not None:
        raise ValueError(
            "partial rollouts (partial_oversample > 0) are simulated in async mode without "
            f"tools; got mode={self.mode!r}, tools={self.tools!r}."
        )
      if self.max_token_version_gap < self.max_staleness:
        raise ValueError(
            f"max_token_version_gap={self.max_token_version_gap} must be >= "
            f"max_staleness={self.max_staleness}."
        )
    if self.pool not in POOLS:
      raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}.")
    if self.migrate and self.pool != "shared":
      raise ValueError(
          "migrate moves requests between the instances of a shared pool; set pool='shared'."
      )
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}.")
    if self.scheduler not in SCHEDULERS:
      raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}.")
    if self.num_instances < 1 or self.num_train_gpus < 1:
      raise ValueError("need at least one generator instance and one trainer GPU.")
    if self.batch_size < 1 or self.iterations < 1 or self.num_minibatches < 1:
      raise ValueError("batch_size, iterations and num_minibatches must be >= 1.")
    if self.gen_cores is not None and not (
        isinstance(self.gen_cores, (int, np.integer)) and self.gen_cores >= 1
    ):
      raise ValueError(f"gen_cores must be None or an int >= 1, got {self.gen_cores!r}.")
    if not (math.isfinite(self.share_cost) and self.share_cost >= 1.0):
      raise ValueError(f"share_cost must be a finite factor >= 1, got {self.share_cost!r}.")
    if not (math.isfinite(self.ranker_refresh_s) and self.ranker_refresh_s >= 0):
      raise ValueError(
          f"ranker_refresh_s must be finite seconds >= 0, got {self.ranker_refresh_s!r}."
      )
    if not (math.isfinite(self.added_round_s) and self.added_round_s >= 0):
      raise ValueError(f"added_round_s must be finite seconds >= 0, got {self.added_round_s!r}.")
    if isinstance(self.lengths, (tuple, list)) and len(self.lengths) < self.iterations:
      raise ValueError(
          f"got {len(self.lengths)} length distributions for {self.iterations} iterations; "
          "give one per iteration."
      )

  def lengths_at(self, j: int) -> LengthDistribution:
    return self.lengths[j] if isinstance(self.lengths, (tuple, list)) else self.lengths


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
    return float(self.config.batch_size / self.samples_per_s)

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


class _GenPhase:
  """All generator instances during one iteration's generation."""

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
        self.push(inst.ev_t, _EV_INSTANCE, inst.idx, (inst.version, inst.ev_kind, inst.ev_k))

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
    self.push(t_ev, _EV_INSTANCE, inst.idx, (inst.version, kind, inst.k + n))

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
    self.push(t + tools.latency_s, _EV_INSTANCE, inst.idx, (_TOOL_RETURN, sid))

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


def dispatch_inputs(
    gen: GenCostModel, prompt: np.ndarray, recent: np.ndarray, latency_model: str = "paper"
):
  """(max_batch_size, PTL profile) the simulator hands to Algorithm 2.

  max_batch_size: the most sequences an instance runs at once (engine cap and
  KV reservations, at the batch's mean prompt). The profile is PTL(BS) at a
  per-sequence context of the mean prompt plus half the mean recent output;
  for the "simulate" model, whose replay adds each request's context as it
  grows, PTL(BS) at the mean prompt plus the cost per context token.
  """
  max_bs = gen.max_concurrent(float(np.mean(prompt)))
  if latency_model == "simulate":
    return max_bs, gen.latency_profile(float(np.mean(prompt)), growing_context=True)
  ctx = float(np.mean(prompt)) + 0.5 * float(np.mean(recent))
  return max_bs, gen.latency_profile(ctx)


def _plan_queues(
    config: SimConfig, j: int, n_inst: int, prompt: np.ndarray, out: np.ndarray, recent: np.ndarray
) -> tuple[tuple, tuple]:
  """Prompt queues per instance via the project's scheduler."""
  max_bs, profile = dispatch_inputs(config.gen, prompt, recent, config.dispatch_latency_model)
  if config.scheduler == "fifo":
    plan = fifo_plan(len(out), n_inst, max_bs, seed=_mix(config.seed, j, 2))
  else:
    rng = np.random.default_rng([config.seed, j, 1])
    scores = noisy_scores(out, config.ranker_sigma, rng)
    history = None
    if config.dispatch_latency_model == "simulate":
      # The ranker's error as a run records it: the previous round's lengths
      # at the ranks a ranker of the same noise gave them.
      seen = noisy_scores(recent, config.ranker_sigma, np.random.default_rng([config.seed, j, 4]))
      history = list(zip(rank_quantiles(seen), recent))
    plan = dispatch(
        np.exp(scores),
        n_inst,
        profile,
        recent,
        alpha=config.alpha,
        objective=config.dispatch_objective,
        max_batch_size=max_bs,
        latency_model=config.dispatch_latency_model,
        rank_history=history,
        seed=_mix(config.seed, j, 5),
    )
  return plan.assignments, plan.batch_sizes


def _mix(seed: int, *xs: int) -> int:
  return int(np.random.default_rng([seed, *xs]).integers(0, 2**31 - 1))


@dataclasses.dataclass(eq=False)
class _Group:
  """A prompt group of partial rollouts, with its responses' lengths and progress."""

  born: int  # the round it was first requested in
  prompt: int
  out: list  # each response's full length
  gen: list  # tokens each has generated so far
  first_round: list  # the round of each one's oldest token (-1: none yet)
  done_seq: int | None = None  # finishing order, once every response finished

  def done(self, k: int) -> bool:
    return self.gen[k] >= self.out[k]


class _PartialBuffer:
  """Partial rollouts' groups across rounds, as streamrl/pipeline/partial.py
  keeps them: topped up to target + extra, the version-gap reset, the oldest
  finished groups trained first."""

  def __init__(self, c: SimConfig):
    self.c = c
    self.target = c.batch_size // c.group_size
    self.extra = max(1, math.ceil(self.target * c.partial_oversample))
    self.groups: list[_Group] = []
    self.round: list[tuple[_Group, int]] = []  # this round's sample id -> (group, response)
    self.g = 0
    self.seq = 0
    self.num_done = 0
    self.wasted = 0  # tokens dropped by the version-gap bound
    self.resumed = 0  # responses this round resumes

  def start(self, g: int, dist: LengthDistribution) -> tuple[np.ndarray, ...]:
    """Round g's requests: (context to prefill, tokens left, full lengths)."""
    c = self.c
    self.g = g
    for grp in self.groups:
      for k, f in enumerate(grp.first_round):
        # Round r samples with weights version r - max_staleness; a response is trained at
        # iteration g at the earliest, when its oldest token is this many versions old.
        if grp.gen[k] and g - (f - c.max_staleness) > c.max_token_version_gap:
          self.wasted += grp.gen[k]
          grp.gen[k], grp.first_round[k] = 0, -1
          if grp.done_seq is not None:
            grp.done_seq = None
            self.num_done -= 1
    need = self.target + self.extra - len(self.groups)
    if need > 0:
      gs = c.group_size
      prompt, out = dist.sample(np.random.default_rng([c.seed, g, 0]), need * gs)
      for i in range(need):
        full = [max(1, int(o)) for o in out[i * gs : (i + 1) * gs]]
        self.groups.append(_Group(g, int(prompt[i * gs]), full, [0] * gs, [-1] * gs))
    self.round = [(x, k) for x in self.groups for k in range(len(x.out)) if not x.done(k)]
    self.resumed = sum(x.gen[k] > 0 for x, k in self.round)
    ctx = np.array([x.prompt + x.gen[k] for x, k in self.round], np.int64)
    left = np.array([x.out[k] - x.gen[k] for x, k in self.round], np.int64)
    full = np.array([x.out[k] for x, k in self.round], np.int64)
    return ctx, left, full

  def finish(self, sid: int) -> bool:
    """Sample `sid` of this round finished; True once enough groups are done."""
    x, k = self.round[sid]
    x.gen[k] = x.out[k]
    if x.first_round[k] < 0:
      x.first_round[k] = self.g
    if x.done_seq is None and all(x.done(i) for i in range(len(x.out))):
      x.done_seq = self.seq
      self.seq += 1
      self.num_done += 1
    return self.num_done >= self.target

  def stop(self, carried: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The round stopped: the unfinished keep their tokens; takes the oldest
    finished groups out and returns their (prompt, full output) lengths."""
    for sid, n in carried.items():
      x, k = self.round[sid]
      if n > 0:
        if x.gen[k] == 0:
          x.first_round[k] = self.g
        x.gen[k] += n
    done = sorted(
        (x for x in self.groups if x.done_seq is not None), key=lambda x: (x.born, x.done_seq)
    )
    take = done[: self.target]
    if len(take) < self.target:
      raise RuntimeError(f"round {self.g} stopped with {len(take)} of {self.target} groups done.")
    taken = set(map(id, take))
    self.groups = [x for x in self.groups if id(x) not in taken]
    self.num_done -= len(take)
    prompt = np.array([x.prompt for x in take for _ in x.out], np.int64)
    out = np.array([o for x in take for o in x.out], np.int64)
    return prompt, out


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
    self.gen = _GenPhase(
        config.gen,
        self._push,
        self._on_sample,
        self._on_gen_done,
        config.gen_cores,
        config.tools,
        config.share_cost,
        config.migrate,
    )
    k = config.iterations
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
    self.train_gpus = config.num_train_gpus
    self.partial = _PartialBuffer(config) if config.partial else None
    self.resumed: list[int] = []

  def _push(self, t: float, kind: int, a, b) -> None:
    self.seq += 1
    heapq.heappush(self.heap, (t, self.seq, kind, a, b))

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
    if g >= self.c.iterations or self.gen_running or self.gen_scheduled:
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
    prompt, out = dist.sample(np.random.default_rng([c.seed, g, 0]), c.batch_size)
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
      recent = dist.sample(np.random.default_rng([c.seed, g, 3]), c.batch_size)[1]
    queues, caps = _plan_queues(c, g, n_inst, prompt, out, recent)
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
    max_bs = c.gen.max_concurrent(float(np.mean(ctx)))
    if c.scheduler == "fifo":
      plan = fifo_plan(len(ctx), n_inst, max_bs, seed=_mix(c.seed, g, 2))
    else:  # a stoppable round: resumed first, then shortest predicted (the real scheduler's plan)
      resumed = [i for i, (x, k) in enumerate(self.partial.round) if x.gen[k]]
      if len(ctx) <= n_inst * max_bs:  # all start at once: no lengths asked, round-robin
        est = np.zeros(len(ctx))
      else:
        est = np.exp(noisy_scores(full, c.ranker_sigma, np.random.default_rng([c.seed, g, 1])))
      plan = first_k_plan(est, n_inst, max_bs, first=resumed)
    self.resumed.append(self.partial.resumed)
    self.gen_start[g] = t
    self.gen_phase_iter = g
    self.gen.start(
        self._begins(t, g),
        ctx,
        left,
        plan.assignments,
        plan.batch_sizes,
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
    if self.t_busy or j >= self.c.iterations:
      return
    arrived = self.arrivals.get(j, ())
    streaming = self.c.mode in ("stream", "async")
    generated = not math.isnan(self.gen_end[j])
    if not streaming and not generated:
      return
    p = self.c.batch_size
    mb = -(-p // self.c.num_minibatches)
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
      if upto >= self.c.batch_size and (what == "epochs" or not stream_epochs):
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
  """Runs `config.iterations` iterations and returns throughput and stage statistics.

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
  w = min(max(c.warmup, 1 if c.iterations > 1 else 0), c.iterations - 1)
  t_from = ends[w - 1] if w > 0 else 0.0
  span = ends[-1] - t_from
  thr = c.batch_size * (c.iterations - w) / span
  iter_times = np.diff(np.concatenate([[0.0], ends]))
  # Utilisation over the measured span.
  colocated = c.mode in ("colocated", "verl")
  gpus_gen = sum(sim.n_inst[w:]) / max(1, c.iterations - w)
  gen_busy = sum(sim.gen_busy[w:])
  gen_util = gen_busy / (gpus_gen * span) if span > 0 else 0.0
  train_util = sum(sim.train_busy[w:]) / span if span > 0 else 0.0
  if colocated:
    # Same GPUs do both: utilisation is the share of time doing either.
    gen_util = gen_util + train_util
    train_util = gen_util
  phase = [(sim.gen_end[j] - sim.gen_start[j]) * sim.n_inst[j] for j in range(w, c.iterations)]
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
    alpha: float = 0.2,
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
    cfg_like = _GenOnly(
        gen=gen,
        scheduler=scheduler,
        ranker_sigma=ranker_sigma,
        alpha=alpha,
        dispatch_objective=objective,
        seed=seed,
        dispatch_latency_model=latency_model,
    )
    recent = out if recent_lengths is None else np.asarray(recent_lengths)
    queues, caps = _plan_queues(cfg_like, 0, num_instances, prompt, out, recent)
  elif caps is None:
    caps = [gen.max_num_seqs] * len(queues)
  heap: list = []
  counter = [0]
  finish = np.full(out.size, np.nan)
  done = [math.nan]

  def push(t, kind, a, b):
    counter[0] += 1
    heapq.heappush(heap, (t, counter[0], kind, a, b))

  def on_finish(t, sid, inst):
    finish[sid] = t

  def on_done(t):
    done[0] = t

  if not (math.isfinite(share_cost) and share_cost >= 1.0):
    raise ValueError(f"share_cost must be a finite factor >= 1, got {share_cost!r}.")
  if pool not in POOLS or (migrate and pool != "shared"):
    raise ValueError(f'pool must be one of {POOLS} ("shared" to migrate), got {pool!r}.')
  phase = _GenPhase(gen, push, on_finish, on_done, cores, tools, share_cost, migrate)
  phase.start(0.0, prompt, out, queues, caps, shared=pool == "shared")
  events = 0
  while heap:
    t, _, _, a, b = heapq.heappop(heap)
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


@dataclasses.dataclass(frozen=True)
class _GenOnly:
  gen: GenCostModel
  scheduler: str
  ranker_sigma: float
  alpha: float
  dispatch_objective: str
  seed: int
  dispatch_latency_model: str = "paper"
