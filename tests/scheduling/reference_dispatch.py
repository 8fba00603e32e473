"""The dispatcher's helpers as they were before their vectorised rewrite:
plain loops, one request or one draw at a time. `install` puts them into
`streamrl.scheduling.dispatch`, so a test can plan the same round both ways
and compare the decisions."""

import heapq
import importlib

import numpy as np

dispatch_mod = importlib.import_module("streamrl.scheduling.dispatch")


def continuous_batching_time(lengths, max_in_flight, profile) -> float:
  """One instance's decode time, replayed event by event with a heap of the
  running requests (what `continuous_batching_times` computes in closed form)."""
  pending = [max(0.0, float(x)) for x in lengths]
  cap = max(1, int(max_in_flight))
  per_ctx = profile.context_s_per_token
  ptl = [profile.ptl(b) for b in range(min(cap, len(pending)) + 1)]
  running: list[tuple[float, float]] = []  # heap of (finish, start), in decode steps
  starts = 0.0
  now_steps, now_s, k = 0.0, 0.0, 0
  while k < len(pending) or running:
    while k < len(pending) and len(running) < cap:
      heapq.heappush(running, (now_steps + pending[k], now_steps))
      starts += now_steps
      k += 1
    n = len(running)
    steps = running[0][0] - now_steps
    now_s += steps * ptl[n]
    if per_ctx:
      now_s += per_ctx * (steps * (n * now_steps - starts) + n * steps * (steps - 1) / 2)
    now_steps = running[0][0]
    while running and running[0][0] <= now_steps:
      starts -= heapq.heappop(running)[1]
  return now_s


def continuous_batching_times(lengths_dm, max_in_flight, profile) -> np.ndarray:
  return np.asarray([continuous_batching_time(r, max_in_flight, profile) for r in lengths_dm])


def lpt_order(predicted_lengths) -> list[int]:
  lengths = [float(x) for x in predicted_lengths]
  return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def balance(prompts, lengths, num_instances, groups=None):
  buckets = [[] for _ in range(num_instances)]
  heap = [(0.0, 0, i) for i in range(num_instances)]
  for unit in dispatch_mod._units(prompts, groups):
    load, count, i = heapq.heappop(heap)
    buckets[i].extend(unit)
    added = sum(max(0.0, float(lengths[p])) for p in unit)
    heapq.heappush(heap, (load + added, count + len(unit), i))
  return buckets


def rank_bins(rank_history, num_bins=dispatch_mod.RANK_BINS):
  pairs = np.asarray(rank_history, dtype=np.float64).reshape(-1, 2)
  idx = np.clip((pairs[:, 0] * num_bins).astype(int), 0, num_bins - 1)
  bins = [pairs[idx == k, 1] for k in range(num_bins)]
  full = [k for k in range(num_bins) if bins[k].size]
  return [
      bins[k] if bins[k].size else bins[min(full, key=lambda j: (abs(j - k), j))]
      for k in range(num_bins)
  ]


def rank_draws(pred, bins, draws, seed):
  b = np.minimum((dispatch_mod.rank_quantiles(pred) * len(bins)).astype(int), len(bins) - 1)
  est = np.asarray([bins[k].mean() for k in b])
  rng = np.random.default_rng(seed)
  out = np.empty((draws, len(b)))
  for k in np.unique(b):
    where = np.flatnonzero(b == k)
    out[:, where] = rng.choice(bins[k], size=(draws, where.size))
  return est, out


def install(monkeypatch) -> None:
  """Plans with these helpers from now on (undone with the monkeypatch)."""
  for name, fn in [
      ("continuous_batching_times", continuous_batching_times),
      ("lpt_order", lpt_order),
      ("_balance", balance),
      ("rank_bins", rank_bins),
      ("_rank_draws", rank_draws),
      ("choose_batch_size", dispatch_mod.choose_batch_size.__wrapped__),
  ]:
    monkeypatch.setattr(dispatch_mod, name, fn)
