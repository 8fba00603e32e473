"""Which instance generates which prompt, in which order: fifo | skew | oracle.

`skew` is the paper's skewness-aware generation: the output-length ranker
predicts each prompt's length, Algorithm 2 (`streamrl.scheduling.dispatch`)
sends the predicted long tail to instances running small batches, and each
instance admits its prompts longest-first (LPT) up to its batch cap. The
ranker is refreshed online from every round's generations (the policy's
lengths drift as it learns), and every (prompt, length) pair is appended to
`<workdir>/length_pairs.jsonl` for offline training
(`launch/train_ranker.py --config.data.pairs_path=...`). A prompt seen in
an earlier epoch is predicted mostly from its own lengths then
(`scheduler.prompt_lengths`, kept in the run's checkpoints: `get_state`);
every round logs recall@20 and Spearman of the ranker, that history, the
finished siblings and their combination (streamrl/scheduling/lengths.py).
`oracle` uses the task's true answer lengths (synthetic tasks only; for
experiments).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import time
import typing

import numpy as np

from streamrl import oom
from streamrl.scheduling.config import Scheduler
from streamrl.data import tasks
from streamrl.scheduling.request import as_requests
from streamrl.scheduling import ranker_actor
from streamrl.scheduling.dispatch import MIN_RANK_HISTORY, rank_quantiles
from streamrl.scheduling.lengths import (
    LengthHistory,
    combine,
    rank_lengths,
    sibling_estimates,
    source_metrics,
)
from streamrl.scheduling.latency import LatencyProfile
from streamrl.scheduling.policy import plan_generation
from streamrl.scheduling.siblings import LengthHint

log = logging.getLogger(__name__)


def with_length_hints(requests, groups, lengths) -> list:
  """`requests`, each carrying a LengthHint: its group and the group's mean
  estimated length (the instance refines it as siblings finish)."""
  total, count = collections.Counter(), collections.Counter()
  for g, n in zip(groups, lengths):
    total[g] += n
    count[g] += 1
  return [
      r.with_hint(LengthHint(group=g, prior=total[g] / count[g]))
      for r, g in zip(as_requests(requests), groups)
  ]


class Planned(typing.NamedTuple):
  """What a request's length sources said when its round was planned."""

  prompt_id: int | None  # its example's prompt id (None: unknown, no history kept)
  group: int  # its prompt among the round's distinct prompts
  ranker: float  # the ranker's score (only its order means anything)
  ranker_tokens: float  # that score as a length: the recent lengths at its rank
  history: tuple[int, ...]  # its prompt's lengths in earlier epochs


def _array(values) -> np.ndarray | None:
  """A deque of numbers ([N]) or of (rank quantile, length) pairs ([N, 2]) as
  float64; None when empty."""
  if not values:
    return None
  if isinstance(values[0], tuple):
    flat = itertools.chain.from_iterable(values)
    return np.fromiter(flat, np.float64, 2 * len(values)).reshape(-1, 2)
  return np.fromiter(values, np.float64, len(values))


class GenerationScheduler:
  """Plans each generation round and learns from its results."""

  def __init__(
      self,
      sched: Scheduler,
      *,
      model_dir: str,
      workdir: str | None,
      num_instances: int,
      max_batch_size: int,
      helper: tuple[dict, tuple[int, ...] | None] | None = None,
  ):
    """`helper`: Ray options and cores for a process on the generation side
    (`StreamGenerationService.helper_placement`); with it and
    `sched.ranker_side == "generators"` the ranker runs there
    (`ranker_actor.RankerActor`), else in this process."""
    self.kind = sched.kind
    self.num_instances = num_instances
    self.max_batch_size = max_batch_size
    self.alpha = sched.long_tail_alpha
    self.objective = sched.objective
    self.latency_model = sched.latency_model
    self.siblings = sched.sibling_lengths == "on"
    self.pool = sched.pool
    self.migrate = sched.migrate
    self.straggler_tokens = sched.straggler_tokens
    # The last plan's length estimate per request id ({} for FIFO) and its
    # number of long-tail instances: what a shared pool hands out first, and to whom.
    self.estimates: dict[int, float] = {}
    self.n_long = 0
    self.recent = collections.deque(maxlen=sched.length_history)
    # (rank quantile at which a request was predicted, its length): the
    # ranker's real error, which the "simulate" latency model draws from;
    # `_ranked` holds the quantiles of requests planned and not yet observed.
    self.rank_history = collections.deque(maxlen=max(sched.length_history, MIN_RANK_HISTORY))
    self._ranked: collections.OrderedDict = collections.OrderedDict()
    self.pairs = collections.deque(maxlen=4096)
    self.pairs_path = os.path.join(workdir, "length_pairs.jsonl") if workdir else None
    self.profile = None
    self.ranker = None
    self._warned = False
    self._actor = None
    self._refreshes: list = []  # the actor's refreshes not yet taken: (metrics, leaves) refs
    self._adopted = None  # metrics of the newest refresh taken, not yet reported
    self._leaves = None  # that refresh's parameters (a Ray reference), not yet set here
    self.plan_s = 0.0  # how long the last `plan` took
    # Each prompt's newest lengths (by prompt id), and per request planned and
    # not yet observed what each source predicted (`Planned`).
    self.history = LengthHistory(sched.prompt_lengths) if sched.prompt_lengths else None
    self._planned: collections.OrderedDict = collections.OrderedDict()
    if self.kind == "fifo":
      return
    if sched.latency_profile:
      self.profile = LatencyProfile.from_json(sched.latency_profile)
    else:
      # Only the curve's shape matters for the split; measure the real one
      # with streamrl.generator.profiler and set scheduler.latency_profile.
      self.profile = LatencyProfile.from_paper()
      log.info("scheduler.latency_profile is empty: using the paper's PTL(BS) shape.")
    if self.kind == "skew":
      if helper is not None and sched.ranker_side == "generators":
        options, cores = helper
        # The actor's working directory need not be this one.
        path, sep, name = sched.ranker_config.partition(":")
        if path and os.path.isfile(path):
          sched = dataclasses.replace(sched, ranker_config=os.path.abspath(path) + sep + name)
        self._actor = ranker_actor.RankerActor.options(**options).remote(
            sched, model_dir, cores, self.pairs.maxlen
        )
        self._memory = oom.Watch()  # a ranker killed for memory stops the run in one sentence
      # Predictions run here in either case; with the actor, on the
      # parameters of its newest refresh done (`_adopt`).
      self.ranker = ranker_actor.build_ranker(sched, model_dir)
      if self._actor is not None:
        self.ranker.compile_all(train=False)

  def plan(
      self,
      requests,
      examples_by_id,
      seed: int,
      num_instances: int | None = None,
      *,
      stoppable: bool = False,
      resumed=(),
  ):
    """-> (assignments, caps), one per instance, for `num_instances` instances
    (default: the count given at construction); (None, None) means round-robin.
    `stoppable`: the round ends once enough groups finish (partial rollouts),
    so it is planned for its first finished groups (`first_k_plan`), the
    requests of `resumed` (ids of responses carried over) first; when the
    instances' slots (max_batch_size each) hold every request, they all start
    at once and the plan is round-robin, resumed first, without asking the
    ranker.
    Its seconds are reported by the next `observe` (`scheduler/plan_s`)."""
    t0 = time.perf_counter()
    try:
      return self._plan(requests, examples_by_id, seed, num_instances, stoppable, resumed)
    finally:
      self.plan_s = time.perf_counter() - t0

  def _plan(self, requests, examples_by_id, seed, num_instances, stoppable, resumed):
    num_instances = int(num_instances or self.num_instances)
    self.estimates, self.n_long = {}, 0
    if self.kind == "fifo":
      return None, None
    requests = as_requests(requests)
    if stoppable and len(requests) <= num_instances * self.max_batch_size:
      # Every request starts at once (the instances' slots hold the round): there is
      # no admission order to decide, and a prediction would only add its time to
      # the round's start. Resumed responses first, round-robin.
      carried = set(resumed)
      order = [r for r in requests if r.id in carried] + [
          r for r in requests if r.id not in carried
      ]
      parts = [order[k::num_instances] for k in range(num_instances)]
      return parts, [self.max_batch_size] * num_instances
    # The samples of one prompt share its tokens: index of each request's
    # prompt among the round's distinct prompts, in order of first appearance.
    index: dict = {}
    slot = [index.setdefault(r.prompt, len(index)) for r in requests]
    groups = slot if self.siblings else None  # samples of one prompt form a group
    predicted = true = None
    recent = _array(self.recent)
    if self.kind == "skew":
      if not self.recent and not self._warned:
        log.warning("No output lengths seen yet: the first round is dispatched FIFO.")
        self._warned = True
      self._adopt()
      # Each distinct prompt is scored once.
      predicted = np.asarray(self.ranker.predict([list(p) for p in index]))[slot]
      predicted = self._with_history(requests, examples_by_id, slot, predicted, recent)
    else:
      exs = [examples_by_id[r.id] for r in requests]
      if any(e.task in ("file", "gym") for e in exs):
        raise ValueError(
            "scheduler.kind='oracle' needs a synthetic task with known "
            "answer lengths; use 'skew' for real data."
        )
      # Work traces: the expected length (it varies between samples); plain
      # tasks: the answer's exact length plus EOS.
      true = [
          e.expected_length
          if e.expected_length is not None
          else tasks.oracle_answer_length(e.prompt) + 1
          for e in exs
      ]
    for r, q in zip(requests, rank_quantiles(predicted if true is None else true)):
      self._ranked[r.id] = float(q)
      self._ranked.move_to_end(r.id)
    while len(self._ranked) > 4 * self.rank_history.maxlen:  # never observed (dropped)
      self._ranked.popitem(last=False)
    while len(self._planned) > 4 * self.rank_history.maxlen:
      self._planned.popitem(last=False)
    carried = set(resumed)
    plan = plan_generation(
        self.kind,
        num_prompts=len(requests),
        num_instances=num_instances,
        max_batch_size=self.max_batch_size,
        profile=self.profile,
        predicted_lengths=predicted,
        true_lengths=true,
        recent_lengths=recent,
        alpha=self.alpha,
        objective=self.objective,
        latency_model=self._latency_model(),
        seed=seed,
        groups=groups,
        rank_history=_array(self.rank_history),
        stoppable=stoppable,
        first=[i for i, r in enumerate(requests) if r.id in carried],
    )
    if plan.lengths:
      self.estimates = {r.id: float(n) for r, n in zip(requests, plan.lengths)}
    self.n_long = plan.n_long_instances
    if groups is not None and plan.lengths:
      requests = with_length_hints(requests, groups, plan.lengths)
    assignments = [[requests[i] for i in part] for part in plan.assignments]
    return assignments, list(plan.batch_sizes)

  def _with_history(self, requests, examples_by_id, slot, predicted, recent) -> np.ndarray:
    """The lengths the plan orders by: the ranker's `predicted` scores as they
    are while no request's prompt has a history (the ranker alone decides),
    else each request's `lengths.combine` of the ranker's estimate (its rank
    in the recent lengths) and its prompt's history. Records what each
    source said, for `observe`'s metrics."""
    ranker_tokens = predicted if recent is None else rank_lengths(predicted, recent)
    seen = []
    for r in requests:
      ex = examples_by_id.get(r.id) if self.history is not None else None
      pid = None if ex is None else ex.prompt_id
      seen.append((pid, self.history.get(pid) if pid is not None else ()))
    for r, g, score, tokens, (pid, hist) in zip(
        requests, slot, predicted.tolist(), ranker_tokens.tolist(), seen
    ):
      self._planned[r.id] = Planned(pid, g, score, tokens, hist)
      self._planned.move_to_end(r.id)
    if not any(hist for _, hist in seen):
      return predicted
    return np.asarray([combine(t, hist) for t, (_, hist) in zip(ranker_tokens, seen)])

  def _latency_model(self) -> str:
    """The configured model; "paper" while "simulate" lacks the rank history
    that tells it how far to trust the ranker's order (the first rounds)."""
    if self.latency_model == "simulate" and len(self.rank_history) < MIN_RANK_HISTORY:
      return "paper"
    return self.latency_model

  def observe(self, samples) -> dict:
    """Records this round's lengths and refreshes the ranker on them; the
    ranker's metrics, and the seconds the last plan and this call took on
    the round's path (`scheduler/plan_s`, `scheduler/observe_s`)."""
    t0 = time.perf_counter()
    out = self._observe(samples)
    out["scheduler/observe_s"] = time.perf_counter() - t0
    out["scheduler/plan_s"] = self.plan_s
    return out

  def _observe(self, samples) -> dict:
    new = [(list(s.prompt_token_ids), len(s.token_ids)) for s in samples]
    out = self._source_metrics(samples, [n for _, n in new])
    self.recent.extend(n for _, n in new)
    for sample, (_, n) in zip(samples, new):
      q = self._ranked.pop(sample.prompt_id, None)
      if q is not None:
        self.rank_history.append((q, n))
    self.pairs.extend(new)
    if self.pairs_path:
      from streamrl.ranker import data as ranker_data  # pylint: disable=g-import-not-at-top

      ranker_data.append_pairs(self.pairs_path, new)
    if self._actor is not None:
      # Off this process: submitted, not waited for. The metrics are those of
      # the newest refresh taken by now (usually the previous round's).
      self._refreshes.append(tuple(self._actor.update.remote(new)))
      self._take()
      metrics, self._adopted = self._adopted, None
    elif self.ranker is not None:
      metrics = self.ranker.update(list(self.pairs))
    else:
      metrics = None
    out.update({k: float(v) for k, v in (metrics or {}).items() if np.isscalar(v)})
    return {f"ranker/{k}": v for k, v in out.items()}

  def _source_metrics(self, samples, lengths) -> dict:
    """Each length source's recall@20 and Spearman on the samples planned
    by `_with_history` (`lengths.source_metrics`); each sample's length then
    joins its prompt's history."""
    planned = [self._planned.pop(s.prompt_id, None) for s in samples]
    known = [(p, n) for p, n in zip(planned, lengths) if p is not None]
    if not known:
      return {}
    siblings = sibling_estimates([p.group for p, _ in known], [n for _, n in known])
    mean = lambda xs: float(np.mean(xs)) if xs else None
    out = source_metrics(
        {
            "ranker": [p.ranker for p, _ in known],
            "history": [mean(p.history) for p, _ in known],
            "siblings": [mean(sib) for sib in siblings],
            "combined": [
                combine(p.ranker_tokens, p.history, sib) for (p, _), sib in zip(known, siblings)
            ],
        },
        [n for _, n in known],
    )
    if self.history is not None:
      for p, n in known:
        if p.prompt_id is not None:
          self.history.add(p.prompt_id, n)
    return out

  def get_state(self) -> dict:
    """What a checkpoint keeps of the scheduler: each prompt's newest
    lengths (JSON-serialisable; `set_state` restores it)."""
    return {} if self.history is None else {"prompt_lengths": self.history.get_state()}

  def set_state(self, state: dict | None) -> None:
    """Takes `get_state()` of a checkpoint (None or {}: nothing kept)."""
    if self.history is not None and state and "prompt_lengths" in state:
      self.history.set_state(state["prompt_lengths"])

  def _take(self) -> None:
    """Takes the actor's newest refresh done by now: its metrics wait in
    `_adopted` for `observe`, its parameters (not fetched yet) in `_leaves`."""
    if self._actor is None or not self._refreshes:
      return
    import ray  # pylint: disable=g-import-not-at-top

    refs = [m for m, _ in self._refreshes]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    if done:  # the actor runs its refreshes in order: the done ones come first
      k = len(done)
      self._adopted, self._leaves = self._get(refs[k - 1]), self._refreshes[k - 1][1]
      self._refreshes = self._refreshes[k:]

  def _adopt(self) -> None:
    """Sets the parameters of the actor's newest refresh done by now in this
    process's ranker (before it predicts)."""
    self._take()
    if self._leaves is not None:
      import ray  # pylint: disable=g-import-not-at-top

      self.ranker.set_param_leaves(self._get(self._leaves))
      self._leaves = None

  def _get(self, ref):
    """ray.get of the ranker actor's result; its death for memory as one sentence."""
    import ray  # pylint: disable=g-import-not-at-top

    try:
      return ray.get(ref)
    except ray.exceptions.RayActorError as e:
      killed = self._memory.explain("length ranker (scheduler.kind=skew)", str(e))
      if killed is not None:
        raise killed from None
      raise

  def close(self) -> None:
    """Stops the ranker's actor (if it has one)."""
    if self._actor is not None:
      import ray  # pylint: disable=g-import-not-at-top

      ray.kill(self._actor)
      self._actor = None
