"""Each round's plan: which generator instance runs which prompt, in which
order, and how many at once.

Prompts go to instances through the project's real scheduler
(`streamrl.scheduling`): `fifo_plan` (random FIFO, round-robin) or `dispatch`
(Algorithm 2: long-tail prompts on instances running small batches, LPT order
inside each instance), fed with a simulated ranker's scores
(`ranker_model.noisy_scores`); a round of partial rollouts, which stops early,
is planned with `first_k_plan` (resumed requests first).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from streamrl.scheduling import dispatch, fifo_plan
from streamrl.scheduling.dispatch import first_k_plan, rank_quantiles
from streamrl.sim.costs import GenCostModel
from streamrl.sim.ranker_model import noisy_scores


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


def plan_round(
    gen: GenCostModel,
    j: int,
    n_inst: int,
    prompt: np.ndarray,
    out: np.ndarray,
    recent: np.ndarray,
    *,
    scheduler: str,
    ranker_sigma: float,
    long_tail_alpha: float,
    objective: str,
    latency_model: str,
    seed: int,
) -> tuple[tuple, tuple]:
  """Round j's prompt queues and batch caps per instance, from the project's
  scheduler; the keywords as the SimConfig fields of the same names."""
  max_bs, profile = dispatch_inputs(gen, prompt, recent, latency_model)
  if scheduler == "fifo":
    plan = fifo_plan(len(out), n_inst, max_bs, seed=_mix(seed, j, 2))
  else:
    rng = np.random.default_rng([seed, j, 1])
    scores = noisy_scores(out, ranker_sigma, rng)
    history = None
    if latency_model == "simulate":
      # The ranker's error as a run records it: the previous round's lengths
      # at the ranks a ranker of the same noise gave them.
      seen = noisy_scores(recent, ranker_sigma, np.random.default_rng([seed, j, 4]))
      history = list(zip(rank_quantiles(seen), recent))
    plan = dispatch(
        np.exp(scores),
        n_inst,
        profile,
        recent,
        alpha=long_tail_alpha,
        objective=objective,
        max_batch_size=max_bs,
        latency_model=latency_model,
        rank_history=history,
        seed=_mix(seed, j, 5),
    )
  return plan.assignments, plan.batch_sizes


def plan_stoppable_round(
    gen: GenCostModel,
    j: int,
    n_inst: int,
    context: np.ndarray,
    full: np.ndarray,
    resumed: Sequence[int],
    *,
    scheduler: str,
    ranker_sigma: float,
    seed: int,
) -> tuple[tuple, tuple]:
  """Round j of partial rollouts, which stops once enough groups are done:
  queues and batch caps per instance, the `resumed` requests (indices) first,
  then the shortest predicted, as the real scheduler plans it. `context`:
  each request's tokens to prefill; `full`: its whole output length."""
  max_bs = gen.max_concurrent(float(np.mean(context)))
  if scheduler == "fifo":
    plan = fifo_plan(len(context), n_inst, max_bs, seed=_mix(seed, j, 2))
  else:
    if len(context) <= n_inst * max_bs:  # all start at once: no lengths asked, round-robin
      est = np.zeros(len(context))
    else:
      est = np.exp(noisy_scores(full, ranker_sigma, np.random.default_rng([seed, j, 1])))
    plan = first_k_plan(est, n_inst, max_bs, first=resumed)
  return plan.assignments, plan.batch_sizes


def _mix(seed: int, *xs: int) -> int:
  return int(np.random.default_rng([seed, *xs]).integers(0, 2**31 - 1))
