"""Algorithm 2 with the long/regular split chosen in hindsight.

A diagnostic for the skewness-aware dispatcher (streamrl.scheduling.dispatch):
how far any choice of split inside Algorithm 2 can go on one draw of lengths.
"""

from __future__ import annotations

import math

import numpy as np

from streamrl.scheduling.dispatch import _balance, calibrated_lengths, choose_batch_size
from streamrl.scheduling.lpt import lpt_order
from streamrl.sim.generation import simulate_generation
from streamrl.sim.plans import dispatch_inputs


def best_split_makespan(
    gen, num_instances: int, prompt_lens, output_lens, recent_lengths, *, alpha: float = 0.2
) -> tuple[float, int, list]:
  """Algorithm 2 with true lengths and the long/regular split chosen in hindsight.

  Builds every split N_l = 1 .. N-1 exactly as `streamrl.scheduling.dispatch`
  does (the true top `alpha` prompts on N_l instances, the rest on N - N_l,
  greedy LPT balancing on the calibrated length estimates, the wave-optimal
  batch cap per instance, the simulator's max batch size and PTL profile),
  simulates each one and keeps the fastest. The oracle dispatch (ranker noise
  0) picks one of these splits with its latency model, so on the same draw
  this is a lower bound on its makespan: how far any choice of split inside
  Algorithm 2 can go.

  Args:
    gen: the generator cost model (streamrl.sim.costs.GenCostModel).
    num_instances: generator instances N (>= 2).
    prompt_lens, output_lens: one draw of prompt and true output lengths.
    recent_lengths: output lengths of earlier iterations, for the estimates.
    alpha: fraction of prompts treated as long-tail.

  Returns:
    (best makespan s, its N_l, [(N_l, makespan s)] for every split).
  """
  prompt = np.asarray(prompt_lens, dtype=np.int64)
  out = np.asarray(output_lens, dtype=np.int64)
  recent = np.asarray(recent_lengths, dtype=np.float64)
  if num_instances < 2:
    raise ValueError(f"a long/regular split needs at least two instances, got {num_instances}.")
  max_bs, profile = dispatch_inputs(gen, prompt, recent)
  pred = np.exp(
      np.log(out.astype(np.float64))
  )  # What the simulated oracle ranker hands to dispatch.
  order = lpt_order(pred)
  est = calibrated_lengths(pred, recent)
  n_long = min(len(out), math.ceil(alpha * len(out) - 1e-9))
  long_ids, reg_ids = order[:n_long], order[n_long:]
  results = []
  for n_l in range(1, num_instances):
    buckets = _balance(long_ids, est, n_l) + _balance(reg_ids, est, num_instances - n_l)
    caps = [choose_batch_size(profile, len(b), max_bs) for b in buckets]
    r = simulate_generation(gen, num_instances, prompt, out, queues=buckets, caps=caps)
    results.append((n_l, r.makespan))
  n_best, t_best = min(results, key=lambda x: (x[1], x[0]))
  return t_best, n_best, results
