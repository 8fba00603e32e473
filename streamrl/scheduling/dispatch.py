"""Skewness-aware dispatching of prompts to generator instances (Algorithm 2).

The top `alpha` fraction of prompts by predicted output length is the long
tail. Long-tail prompts go to a dedicated group of N_l instances; the rest to
N_r = N - N_l instances. Because the long group has few prompts per instance,
it decodes at a small batch size and hence a low per-token latency, so the
long outputs finish sooner; the regular group runs large, efficient batches.

Latency model (paper): an instance holding M prompts of mean length L_avg,
running at most BS at once, takes

    Latency = PTL(BS) * L_avg * ceil(M / BS).

L_avg is not the ranker's prediction: the long group uses the P90 and the
regular group the P50 of the *recently observed* output lengths, since the
ranker is trained to rank, not to be calibrated, and lengths drift during RL.

Batch size choice (ours; the paper leaves it implicit): for each group,
BS = argmin_b PTL(b) * ceil(M / b) over 1 <= b <= min(max_batch_size, M),
evaluated at the smallest b for each number of waves ceil(M / b) (exact when
PTL is non-decreasing in b, as every measured curve is). For any sublinear
PTL curve this is BS = min(max_batch_size, M): the long group, holding few
prompts per instance, therefore runs small batches.

Objective: the paper prints a sum Latency_long + Latency_reg; the generation
makespan is max(Latency_long, Latency_reg). Both are available
(`objective="sum" | "makespan"`).

Latency model: `latency_model="paper"` is the formula above. It models waves
of equal-length requests, but an instance doing continuous batching finishes
when its *longest* request does, and that request decodes at the batch size
of whatever is still running. `latency_model="simulate"` (ours) therefore
replays each instance's queue through `continuous_batching_time` with
estimated per-prompt lengths, each step costing PTL(n) plus the profile's
cost per token of context in flight (an instance holding the long tail holds
long contexts). On the simulator's paper-scale workloads this avoids splits
the formula gets wrong (see the skew report in experiments/). With the
makespan objective it also weighs N_l = 0: no long-tail group, every
instance balanced over all prompts in LPT order.

Lengths: predictions are used only through their order (a pairwise-trained
ranker is not calibrated). Each prompt's length is estimated as the recent
length distribution's quantile at its predicted rank; balancing inside a
group and the "simulate" model use these estimates.

That estimate takes the ranker's order as exact. When lengths vary between
samples of one prompt (reasoning traces), a ranker that sees only the prompt
cannot order single samples well (recall@20 about 0.5), and the "simulate"
model then trusts a plan that puts the predicted-short 80 % on one instance:
the few responses that really run to max_tokens land there too, late, and
the plan loses to FIFO (experiments/bench_skew.py). Given `rank_history`,
pairs (rank quantile at which a prompt was predicted, length it then had)
that the scheduler records out of sample, "simulate" instead estimates each
prompt by the mean length seen at its rank and times every candidate split
over `RANK_DRAWS` draws of lengths from the lengths seen at each rank (the
ranker's real error), minimising the mean makespan over the draws.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import logging
import math
from typing import Sequence

import numpy as np

from streamrl.scheduling.latency import LatencyProfile
from streamrl.scheduling.lpt import lpt_order

_log = logging.getLogger(__name__)

OBJECTIVES = ("makespan", "sum")  # the settings' DISPATCH_OBJECTIVES (a test holds them alike)
LATENCY_MODELS = ("paper", "simulate")
# Rank bins of `rank_history`, the pairs it needs before "simulate" uses it
# (about 20 per bin), and the length draws each candidate split is timed on:
# RANK_DRAWS, fewer (2 at least) where the replays of all candidate splits
# would pass REPLAY_BUDGET (many instances).
RANK_BINS = 10
MIN_RANK_HISTORY = 20 * RANK_BINS
RANK_DRAWS = 16
REPLAY_BUDGET = 4096

# Set after the first "no length history" warning so that the FIFO fallback
# is announced once per process, not once per iteration.
_warned_no_history = False


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
  """Which prompts each instance generates, in which order, at which batch cap.

  Attributes:
    assignments: per instance, prompt indices in admission order (LPT order
      for skew plans, arrival order for FIFO plans).
    batch_sizes: per instance, the cap on requests in flight (>= 1).
    n_long_instances: instances dedicated to the long tail; they are the
      first `n_long_instances` entries of `assignments`. 0 for FIFO plans and
      when one instance serves everything.
    predicted_time: estimated generation makespan in seconds,
      max over groups of PTL(BS) * L_avg * ceil(M / BS); NaN for FIFO plans
      (nothing is known about lengths).
    objective: "makespan" or "sum" (what was minimised), "fifo", or "first_k"
      (`first_k_plan`: a stoppable round).
    objective_value: the minimised quantity (== predicted_time for
      "makespan"); NaN for FIFO plans.
    group_times: (long, regular) estimated latencies in seconds.
  """

  assignments: tuple[tuple[int, ...], ...]
  batch_sizes: tuple[int, ...]
  n_long_instances: int
  predicted_time: float
  objective: str
  objective_value: float = math.nan
  group_times: tuple[float, float] = (math.nan, math.nan)
  # [P] the length estimate of each prompt the plan used (`calibrated_lengths`);
  # empty for FIFO plans.
  lengths: tuple[float, ...] = ()

  @property
  def num_instances(self) -> int:
    return len(self.assignments)

  def instance_of(self) -> dict[int, int]:
    """Prompt index -> instance index."""
    return {p: i for i, ps in enumerate(self.assignments) for p in ps}


@functools.lru_cache(maxsize=4096)  # a plan asks it for the same few loads again and again
def choose_batch_size(profile: LatencyProfile, num_prompts: int, max_batch_size: int) -> int:
  """Batch cap minimising PTL(b) * ceil(M / b) for M = num_prompts (see module doc).

  Returns 1 when num_prompts is 0.
  """
  m = int(num_prompts)
  cap = min(int(max_batch_size), m)
  if cap <= 1:
    return 1
  best_b, best_cost = 1, math.inf
  b = 1
  # Walk the distinct wave counts w = ceil(m / b), O(sqrt(m)) of them, taking
  # the smallest b that achieves each one.
  while b <= cap:
    waves = -(-m // b)
    b_min = -(-m // waves)
    cost = profile.ptl(b_min) * waves
    if cost < best_cost:  # Strict: ties keep the smaller batch.
      best_b, best_cost = b_min, cost
    if waves == 1:
      break
    b = -(-m // (waves - 1))  # Smallest b with fewer waves.
  return best_b


def estimate_latency(
    profile: LatencyProfile, num_prompts: int, avg_len: float, num_instances: int, batch_size: int
) -> float:
  """Per-instance generation time of a group: PTL(BS) * L_avg * ceil(M / BS).

  Args:
    profile: PTL curve of one instance.
    num_prompts: prompts given to the group.
    avg_len: expected output length (tokens) of those prompts.
    num_instances: instances in the group; M = ceil(num_prompts / num_instances).
    batch_size: cap on requests in flight; the effective batch is min(BS, M).
  Returns:
    Seconds; 0 for no prompts, inf for prompts but no instances.
  """
  if num_prompts <= 0:
    return 0.0
  if num_instances <= 0:
    return math.inf
  m = -(-int(num_prompts) // int(num_instances))
  bs = max(1, min(int(batch_size), m))
  return profile.ptl(bs) * max(0.0, float(avg_len)) * (-(-m // bs))


def _group_time(profile, num_prompts, avg_len, num_instances, max_batch_size):
  if num_prompts <= 0:
    return 0.0
  if num_instances <= 0:
    return math.inf
  m = -(-num_prompts // num_instances)
  bs = choose_batch_size(profile, m, max_batch_size)
  return estimate_latency(profile, num_prompts, avg_len, num_instances, bs)


def _units(prompts: Sequence[int], groups: Sequence | None) -> list[list[int]]:
  """`prompts` cut into what is placed together: each alone, or with `groups`
  the prompts of one group (in order of each group's first prompt)."""
  if groups is None:
    return [[p] for p in prompts]
  units: dict = {}
  for p in prompts:
    units.setdefault(groups[p], []).append(p)
  return list(units.values())


def _balance(
    prompts: Sequence[int], lengths: np.ndarray, num_instances: int, groups: Sequence | None = None
) -> list[list[int]]:
  """Greedy LPT: each prompt (longest first) to the least-loaded instance;
  with `groups`, each group's prompts together.

  Load is the total estimated length; ties go to the instance with fewer
  prompts, then the lower index. Each instance's list stays in LPT order
  (of the groups' first prompts, with groups).
  """
  buckets: list[list[int]] = [[] for _ in range(num_instances)]
  heap = [(0.0, 0, i) for i in range(num_instances)]  # (load, count, index)
  lengths = np.maximum(np.asarray(lengths, dtype=np.float64), 0.0).tolist()
  for unit in _units(prompts, groups):  # Already longest first.
    load, count, i = heap[0]
    buckets[i].extend(unit)
    added = lengths[unit[0]] if len(unit) == 1 else sum(lengths[p] for p in unit)
    heapq.heapreplace(heap, (load + added, count + len(unit), i))
  return buckets


def continuous_batching_time(
    lengths: Sequence[float], max_in_flight: int, profile: LatencyProfile
) -> float:
  """Seconds until one instance doing continuous batching finishes `lengths`
  ([M] output lengths in admission order; 0 for none).

  Requests are admitted in the given order, at most `max_in_flight` (>= 1) at
  once, a new one whenever one finishes; while n requests run every decode
  step takes PTL(n), plus `profile.context_s_per_token` for every token the
  running requests have generated so far (their context; prompts are left
  out). Prefill is ignored (small next to decoding long outputs).
  """
  return float(
      continuous_batching_times(np.asarray(lengths, np.float64)[None], max_in_flight, profile)[0]
  )


def continuous_batching_times(
    lengths_dm: np.ndarray, max_in_flight: int, profile: LatencyProfile
) -> np.ndarray:
  """[D] `continuous_batching_time` of each row of `lengths_dm` [D, M] (D
  draws of one instance's queue, each in admission order), all rows at once.

  No step-by-step replay is needed. While requests still wait, exactly
  `cap` run, so every step until the last request starts costs PTL(cap);
  when each request starts is list scheduling (it takes the slot of the
  running request that finishes first), done for all rows together. From the
  last start on, the requests still running finish in order of their finish
  steps, with cap, cap - 1, ..., 1 of them running. The context cost does not
  depend on the schedule at all: a request of l tokens holds 0, 1, ..., l - 1
  tokens of context over its steps, whatever runs beside it, l (l - 1) / 2
  token-steps in all.
  """
  x = np.maximum(np.asarray(lengths_dm, dtype=np.float64), 0.0)
  if x.ndim != 2:
    raise ValueError(f"lengths_dm must be [draws, requests], got shape {x.shape}.")
  d, m = x.shape
  if m == 0:
    return np.zeros(d)
  cap = max(1, int(max_in_flight))
  k = min(cap, m)
  ptl = np.asarray(_ptl_table(profile, k))
  if m > cap:
    finish = x[:, :cap].copy()  # [D, cap] finish steps of the requests running
    rows = np.arange(d)
    for j in range(cap, m):
      slot = finish.argmin(axis=1)
      last_start = finish[rows, slot]
      finish[rows, slot] = last_start + x[:, j]
  else:
    finish, last_start = x, np.zeros(d)
  # Segment i of the drain runs k - i requests: PTL(k), PTL(k - 1), ..., PTL(1).
  drain = np.diff(np.sort(finish, axis=1), axis=1, prepend=last_start[:, None])
  out = last_start * ptl[k] + drain @ ptl[k:0:-1]
  if profile.context_s_per_token:
    out = out + profile.context_s_per_token * np.sum(x * (x - 1.0), axis=1) / 2
  return out


@functools.lru_cache(maxsize=64)
def _ptl_table(profile: LatencyProfile, n: int) -> tuple[float, ...]:
  """PTL(0 .. n) of `profile` (the replay's hot loop reads it per event)."""
  return tuple(profile.ptl(b) for b in range(n + 1))


def calibrated_lengths(
    predicted_lengths: Sequence[float], recent_lengths: Sequence[float]
) -> np.ndarray:
  """[P] length estimates: the recent distribution's quantile at each prompt's predicted rank.

  The prompt predicted longest gets the recent length at quantile
  1 - 0.5 / P, the shortest the one at 0.5 / P. Ties in the predictions keep
  their input order (as `lpt_order`).
  """
  pred = np.asarray(predicted_lengths, dtype=np.float64).reshape(-1)
  p = pred.shape[0]
  out = np.empty(p)
  if p:
    q = 1.0 - (np.arange(p) + 0.5) / p
    out[lpt_order(pred)] = np.quantile(np.asarray(recent_lengths, dtype=np.float64), q)
  return out


def rank_quantiles(predicted_lengths: Sequence[float]) -> np.ndarray:
  """[P] each prompt's predicted rank as a quantile in [0, 1): 0 for the
  predicted shortest, (P - 1) / P for the longest (ties keep input order, as
  `lpt_order`). What the scheduler records with each observed length."""
  pred = np.asarray(predicted_lengths, dtype=np.float64).reshape(-1)
  p = pred.shape[0]
  out = np.empty(p)
  out[lpt_order(pred)] = (p - 1 - np.arange(p)) / max(p, 1)
  return out


def rank_bins(rank_history, num_bins: int = RANK_BINS) -> list[np.ndarray]:
  """The lengths of `rank_history` ((rank quantile, length) pairs) in
  `num_bins` equal quantile bins; an empty bin borrows its nearest non-empty
  neighbour's (lower first)."""
  pairs = np.asarray(rank_history, dtype=np.float64).reshape(-1, 2)
  idx = np.clip((pairs[:, 0] * num_bins).astype(int), 0, num_bins - 1)
  # Bin k's lengths in their order of `rank_history` (a stable sort by bin).
  by_bin = pairs[np.argsort(idx, kind="stable"), 1]
  bins = np.split(by_bin, np.cumsum(np.bincount(idx, minlength=num_bins))[:-1])
  full = [k for k in range(num_bins) if bins[k].size]
  if not full:
    raise ValueError("rank_history is empty; record some (rank quantile, length) pairs first.")
  return [
      bins[k] if bins[k].size else bins[min(full, key=lambda j: (abs(j - k), j))]
      for k in range(num_bins)
  ]


def _rank_draws(pred, bins, draws: int, seed: int):
  """(est [P], lengths [draws, P]): the mean length seen at each prompt's
  rank bin, and draws from the lengths seen there."""
  b = np.minimum((rank_quantiles(pred) * len(bins)).astype(int), len(bins) - 1)
  est = np.asarray([x.mean() for x in bins])[b]
  rng = np.random.default_rng(seed)
  out = np.empty((draws, len(b)))
  for k in np.unique(b):
    where = np.flatnonzero(b == k)
    out[:, where] = rng.choice(bins[k], size=(draws, where.size))
  return est, out


def fifo_plan(
    num_prompts: int, num_instances: int, max_batch_size: int, *, seed: int | None = None
) -> DispatchPlan:
  """Baseline: round-robin in arrival order, no length information.

  Prompt k goes to instance k mod N and each instance admits its prompts in
  arrival order. With `seed`, the arrival order is first shuffled (random
  FIFO, the paper's baseline); without it the given order is kept (prompt
  datasets are usually already shuffled).
  """
  if num_instances < 1:
    raise ValueError(f"num_instances must be >= 1, got {num_instances}.")
  if max_batch_size < 1:
    raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
  order = np.arange(num_prompts)
  if seed is not None:
    order = np.random.default_rng(seed).permutation(num_prompts)
  assignments = tuple(tuple(int(p) for p in order[i::num_instances]) for i in range(num_instances))
  batch_sizes = tuple(max(1, min(int(max_batch_size), len(a))) for a in assignments)
  return DispatchPlan(
      assignments=assignments,
      batch_sizes=batch_sizes,
      n_long_instances=0,
      predicted_time=math.nan,
      objective="fifo",
  )


def first_k_plan(
    lengths: Sequence[float],
    num_instances: int,
    max_batch_size: int,
    *,
    first: Sequence[int] = (),
) -> DispatchPlan:
  """A stoppable round's plan: the prompts of `first` (responses resumed
  from an earlier round) in their given order, then the others shortest
  estimated length first, round-robin over the instances at the full cap.

  With partial rollouts a round ends once enough groups have finished and
  whatever still runs carries over, so what a plan should minimise is the
  time to the first K finished groups, not the time to the last one:
  shortest-first (SPT) admission finishes K soonest, and the long tail that
  LPT and a long-tail instance would start early is exactly the work the
  round will stop and carry. Resumed responses go first: they are partly
  done, and their oldest tokens age with every round they wait. Prompts
  with equal estimates (the samples of one prompt) keep their order.
  """
  if num_instances < 1:
    raise ValueError(f"num_instances must be >= 1, got {num_instances}.")
  if max_batch_size < 1:
    raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
  est = np.asarray(lengths, dtype=np.float64).reshape(-1)
  if not np.all(np.isfinite(est)):
    raise ValueError("length estimates must be finite; check the ranker's output.")
  head = list(dict.fromkeys(int(i) for i in first))
  if any(not 0 <= i < est.size for i in head):
    raise ValueError(f"first names prompts outside 0..{est.size - 1}.")
  taken = set(head)
  rest = [int(i) for i in np.argsort(est, kind="stable") if int(i) not in taken]
  order = head + rest
  assignments = tuple(tuple(order[i::num_instances]) for i in range(num_instances))
  return DispatchPlan(
      assignments=assignments,
      batch_sizes=tuple(max(1, min(int(max_batch_size), len(a))) for a in assignments),
      n_long_instances=0,
      predicted_time=math.nan,
      objective="first_k",
  )


def dispatch(
    predicted_lengths: Sequence[float],
    num_instances: int,
    profile: LatencyProfile,
    recent_lengths: Sequence[float] | None,
    *,
    alpha: float = 0.2,
    objective: str = "makespan",
    max_batch_size: int = 256,
    latency_model: str = "paper",
    groups: Sequence | None = None,
    rank_history: Sequence[tuple[float, float]] | None = None,
    seed: int = 0,
) -> DispatchPlan:
  """Algorithm 2: split instances between long-tail and regular prompts.

  Args:
    predicted_lengths: [P] ranker predictions (only their order matters).
    num_instances: N generator instances (>= 1).
    profile: PTL(BS) curve of one instance (all instances alike).
    recent_lengths: output lengths observed in recent iterations; None or
      empty (first iteration) falls back to `fifo_plan`, logged once.
    alpha: fraction of prompts (by predicted length) treated as long tail;
      ceil(alpha * P) prompts.
    objective: "makespan" (max of the group latencies) or "sum" (paper).
    max_batch_size: the most requests one instance can run at once.
    latency_model: "paper" (PTL(BS) * L_avg * ceil(M / BS) with P90 / P50)
      or "simulate" (continuous batching replayed per instance with
      `calibrated_lengths`); see the module docstring.
    groups: [P] group keys (samples of one prompt share one); each group is
      placed on one instance, and a group the long-tail cut would split goes
      to the long tail whole (group-aware length prediction,
      `streamrl.scheduling.siblings`). None: prompts are placed one by one.
    rank_history: (rank quantile at prediction, observed length) pairs,
      recorded out of sample (`rank_quantiles`). With at least
      `MIN_RANK_HISTORY` of them the "simulate" model estimates lengths
      from them and times splits over draws of the ranker's real error (see
      the module docstring); the "paper" model ignores them.
    seed: of those draws.
  Returns:
    A DispatchPlan; long-tail instances come first.
  """
  global _warned_no_history
  if num_instances < 1:
    raise ValueError(f"num_instances must be >= 1, got {num_instances}.")
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f"alpha must be in [0, 1], got {alpha}.")
  if objective not in OBJECTIVES:
    raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}.")
  if max_batch_size < 1:
    raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}.")
  if latency_model not in LATENCY_MODELS:
    raise ValueError(f"latency_model must be one of {LATENCY_MODELS}, got {latency_model!r}.")
  pred = np.asarray(predicted_lengths, dtype=np.float64).reshape(-1)
  if not np.all(np.isfinite(pred)):
    raise ValueError("predicted lengths must be finite; check the ranker's output.")
  num_prompts = pred.shape[0]

  recent = (
      None if recent_lengths is None else np.asarray(recent_lengths, dtype=np.float64).reshape(-1)
  )
  if recent is None or recent.size == 0:
    if not _warned_no_history:
      _log.warning(
          "No output-length history yet (first iteration): dispatching FIFO "
          "round-robin until lengths have been observed."
      )
      _warned_no_history = True
    return fifo_plan(num_prompts, num_instances, max_batch_size)

  l_long, l_reg = (float(x) for x in np.percentile(recent, [90, 50]))
  order = lpt_order(pred)
  n_long = min(num_prompts, math.ceil(alpha * num_prompts - 1e-9)) if num_prompts else 0
  if groups is not None:
    if len(groups) != num_prompts:
      raise ValueError(
          f"groups has {len(groups)} entries for {num_prompts} prompts; give one each."
      )
    cut = {groups[p] for p in order[:n_long]}
    order = [p for p in order if groups[p] in cut] + [p for p in order if groups[p] not in cut]
    n_long = sum(groups[p] in cut for p in order)
  long_ids, reg_ids = order[:n_long], order[n_long:]
  simulate = latency_model == "simulate"
  draws = None  # [draws, P] lengths at the ranker's real error
  if simulate and rank_history is not None and len(rank_history) >= MIN_RANK_HISTORY:
    # Replays per draw: each candidate split's instances at two caps.
    per_draw = 2 * num_instances * max(1, num_instances)
    n_draws = max(2, min(RANK_DRAWS, REPLAY_BUDGET // per_draw))
    est, draws = _rank_draws(pred, rank_bins(rank_history), n_draws, seed)
  else:
    est = calibrated_lengths(pred, recent)

  if num_instances == 1:
    # One instance serves everything, in LPT order.
    bs = choose_batch_size(profile, num_prompts, max_batch_size)
    if simulate:
      runs = (est[None] if draws is None else draws)[:, order]
      t = float(np.mean(continuous_batching_times(runs, bs, profile)))
    else:
      l_avg = (n_long * l_long + len(reg_ids) * l_reg) / num_prompts if num_prompts else 0.0
      t = _group_time(profile, num_prompts, l_avg, 1, max_batch_size)
    return DispatchPlan(
        assignments=(tuple(order),),
        batch_sizes=(bs,),
        n_long_instances=0,
        predicted_time=t,
        objective=objective,
        objective_value=t,
        group_times=(0.0, t),
        lengths=tuple(float(x) for x in est),
    )

  if long_ids and reg_ids:
    # The simulate model also weighs no long-tail group at all (every
    # instance balanced, LPT order) against the makespan, since spreading the
    # tail can beat dedicating instances to it once long contexts cost what
    # they cost. (A sum over groups would favour one group by construction.)
    no_split = simulate and objective == "makespan"
    candidates = range(0 if no_split else 1, num_instances)
  elif long_ids:
    candidates = range(num_instances, num_instances + 1)
  else:
    candidates = range(0, 1)

  def cap_and_time(bucket):
    # Paper model: the wave-optimal cap, from the instance's own load (so an
    # instance that balancing gave more than ceil(P_g / N_g) prompts does not
    # run extra waves). Simulate model: continuous batching has no waves, so
    # also try the largest cap and keep whichever replays faster.
    # With draws: the cap with the least mean time, and its time per draw.
    wave_cap = choose_batch_size(profile, len(bucket), max_batch_size)
    if not simulate:
      return wave_cap, math.nan
    options = {wave_cap, max(1, min(max_batch_size, len(bucket)))}
    runs = (est[None] if draws is None else draws)[:, bucket]
    timed = [(continuous_batching_times(runs, c, profile), c) for c in sorted(options)]
    t, c = min(timed, key=lambda tc: (tc[0].mean(), tc[1]))
    return c, t if draws is not None else float(t[0])

  @functools.lru_cache(maxsize=None)  # the chosen split is built again below
  def split(n_l):
    if n_l == 0:
      buckets = _balance(order, est, num_instances, groups)
    else:
      buckets = _balance(long_ids, est, n_l, groups) + _balance(
          reg_ids, est, num_instances - n_l, groups
      )
    caps, times = zip(*(cap_and_time(b) for b in buckets))
    return buckets, list(caps), list(times)

  best = None
  for n_l in candidates:
    t_all = None  # with draws: the mean over them of the slowest instance
    if simulate and draws is not None:
      per_draw = np.asarray(split(n_l)[2]).reshape(num_instances, -1)
      t_long = float(per_draw[:n_l].max(axis=0).mean()) if n_l else 0.0
      t_reg = float(per_draw[n_l:].max(axis=0).mean()) if n_l < num_instances else 0.0
      t_all = float(per_draw.max(axis=0).mean())
    elif simulate:
      _, _, times = split(n_l)
      t_long, t_reg = max(times[:n_l], default=0.0), max(times[n_l:], default=0.0)
    else:
      t_long = _group_time(profile, len(long_ids), l_long, n_l, max_batch_size)
      t_reg = _group_time(profile, len(reg_ids), l_reg, num_instances - n_l, max_batch_size)
    span = max(t_long, t_reg) if t_all is None else t_all
    total = t_long + t_reg
    primary, other = (span, total) if objective == "makespan" else (total, span)
    key = (primary, other, n_l)  # Ties: the other objective, then fewer long instances.
    if best is None or key < best[0]:
      best = (key, n_l, t_long, t_reg, span)
  (primary, _, _), n_l, t_long, t_reg, span = best
  buckets, caps, _ = split(n_l)
  return DispatchPlan(
      assignments=tuple(tuple(int(p) for p in b) for b in buckets),
      batch_sizes=tuple(caps),
      n_long_instances=n_l,
      predicted_time=span,
      objective=objective,
      objective_value=primary,
      group_times=(t_long, t_reg),
      lengths=tuple(float(x) for x in est),
  )
