"""A scheduler's name -> a DispatchPlan: "fifo" | "skew" | "oracle".

`plan_generation` is what `GenerationScheduler` (streamrl/scheduling/
scheduler.py) calls each round with the run's `scheduler.kind`:
"fifo" is `fifo_plan`; "skew" and "oracle" run `dispatch` (Algorithm 2 +
LPT) on predicted or true lengths. The simulator calls `fifo_plan` and
`dispatch` directly.
"""

from __future__ import annotations

from typing import Sequence

from streamrl.scheduling.dispatch import DispatchPlan, dispatch, fifo_plan, first_k_plan
from streamrl.scheduling.latency import LatencyProfile

SCHEDULERS = ("fifo", "skew", "oracle")


def plan_generation(
    scheduler: str,
    *,
    num_prompts: int,
    num_instances: int,
    max_batch_size: int,
    profile: LatencyProfile | None = None,
    predicted_lengths: Sequence[float] | None = None,
    true_lengths: Sequence[float] | None = None,
    recent_lengths: Sequence[float] | None = None,
    alpha: float = 0.2,
    objective: str = "makespan",
    latency_model: str = "paper",
    seed: int | None = None,
    groups: Sequence | None = None,
    rank_history: Sequence[tuple[float, float]] | None = None,
    stoppable: bool = False,
    first: Sequence[int] = (),
) -> DispatchPlan:
  """Builds the plan for one generation round.

  Args:
    scheduler: "fifo" (round-robin, arrival order shuffled by `seed` if
      given), "skew" (ranker predictions -> Algorithm 2 -> LPT) or "oracle"
      (true lengths -> Algorithm 2 -> LPT; experiments only).
    num_prompts: P prompts, indexed 0..P-1 in every returned assignment.
    predicted_lengths: [P], needed for "skew".
    true_lengths: [P], needed for "oracle".
    recent_lengths: observed lengths of recent iterations (P50/P90 estimates);
      None/empty makes "skew" fall back to FIFO (logged once).
    profile, alpha, objective, max_batch_size, latency_model, groups,
      rank_history: see `dispatch` (FIFO ignores groups); the length draws
      of the "simulate" model are seeded by `seed`.
    stoppable: the round stops once enough groups finish (partial
      rollouts): "skew" and "oracle" plan `first_k_plan` on their lengths
      (shortest first after `first`, the resumed prompts) instead of
      Algorithm 2, whose LPT order and long-tail instance start first the
      work such a round stops and carries over.
  """
  if scheduler not in SCHEDULERS:
    raise ValueError(
        f"generation scheduler must be one of {SCHEDULERS}, got {scheduler!r}; "
        "set config.scheduler.kind."
    )
  if scheduler == "fifo":
    return fifo_plan(num_prompts, num_instances, max_batch_size, seed=seed)
  lengths = predicted_lengths if scheduler == "skew" else true_lengths
  what = "predicted_lengths (from the ranker)" if scheduler == "skew" else "true_lengths"
  if lengths is None or len(lengths) != num_prompts:
    raise ValueError(f"scheduler {scheduler!r} needs {what} for all {num_prompts} prompts.")
  if stoppable:
    return first_k_plan(lengths, num_instances, max_batch_size, first=first)
  if profile is None:
    raise ValueError(
        f"scheduler {scheduler!r} needs a LatencyProfile; profile the generator "
        "(streamrl.generator.profiler) or use LatencyProfile.from_paper()."
    )
  if scheduler == "oracle" and not (recent_lengths is not None and len(recent_lengths)):
    recent_lengths = true_lengths  # The oracle knows this round's distribution too.
  return dispatch(
      lengths,
      num_instances,
      profile,
      recent_lengths,
      alpha=alpha,
      objective=objective,
      max_batch_size=max_batch_size,
      latency_model=latency_model,
      groups=groups,
      rank_history=rank_history,
      seed=0 if seed is None else int(seed),
  )
