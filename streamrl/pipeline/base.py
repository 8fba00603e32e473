"""What every pipeline mode shares.

A mode decides only order and overlap: which finished samples form the next
chunk the trainer works on, and when; when weights are pushed and whether the
trainer waits for them. The iteration itself (rewards, scoring, advantages,
updates, logging) is `streamrl/train.py`'s loop, the same for every mode.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import typing
from collections.abc import Callable, Iterator

from streamrl.generator.config import Sampling
from streamrl.generator import local
from streamrl.generator.rollout import PARTIAL, Rollout, Sample, UpdateHandle
from streamrl.pipeline import dynamic_sampling
from streamrl.scheduling import pool as pool_lib
from streamrl.scheduling.request import Request, as_requests

if typing.TYPE_CHECKING:  # Only named here: its module imports Ray.
  from streamrl.scheduling.scheduler import GenerationScheduler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Round:
  """One iteration's prompts, as generator requests."""

  it: int
  requests: list[Request]  # (id, prompt) tuples are turned into Requests
  examples_by_id: dict  # request id -> Example
  loader_state: dict  # the loader position a checkpoint after this round holds
  # Partial rollouts: request id -> the request actually sent (prompt plus
  # the response so far, and the budget left) for resumed responses.
  resume: dict = dataclasses.field(default_factory=dict)  # request id -> Request
  # Partial rollouts: what a checkpoint after this round saves of the
  # unfinished responses (`partial.PartialBuffer.state`); None otherwise.
  carry: dict | None = None

  def __post_init__(self):
    self.requests = as_requests(self.requests)
    self.resume = {int(k): Request.of(r) for k, r in self.resume.items()}


@dataclasses.dataclass
class Generated:
  """What the mode measured of one round's generation."""

  round: Round
  generation_s: float = 0.0  # first request sent -> last sample received
  wait_s: float = 0.0  # how long the trainer waited for the round (async)
  scheduler_metrics: dict = dataclasses.field(default_factory=dict)


def _as_sent(rnd: Round, request: Request) -> Request:
  """A planned request as sent: a resumed response continues from its tokens
  so far, keeping the plan's length hint (which then counts those tokens)."""
  resumed = rnd.resume.get(request.id)
  if resumed is None:
    return request
  hint = request.hint
  if hint is not None:
    hint = dataclasses.replace(hint, done=len(resumed.prompt) - len(request.prompt))
  return resumed.with_hint(hint)


def now() -> float:
  return time.perf_counter()


class Mode:
  """Base of the modes: generation rounds, weight pushes, shutdown.

  Subclasses implement `chunks(it)`, yielding lists of samples (whole
  groups) the trainer can train on now, and set `scores_up_front` when every
  sample of an iteration is scored before the first update (the trainer
  then need not copy its parameters to keep the old policy).

  `filter_rounds` (None: off) turns on dynamic sampling with at most that
  many extra rounds per iteration (streamrl/pipeline/dynamic_sampling.py),
  judging groups by `group_rewards` (the rewards the trainer will use).
  `on_sample` is called with ([sample], its round's examples_by_id) for each
  finished sample as it arrives (the run starts scoring its reward there).

  What the loop reads of a mode: `scores_up_front`, `chunks`, `round` (the
  round being released), `generated` (once `chunks` ended), `round_instances`,
  `push`, `restore`, `quiesce` and `close`.
  """

  scores_up_front = True

  def __init__(
      self,
      rollout: Rollout,
      scheduler: GenerationScheduler,
      rounds: Callable[[int], Round],
      *,
      sampling: Sampling,
      seed: int,
      group_size: int,
      mini_batch_size: int,
      prompts_per_iteration: int = 0,
      filter_rounds: int | None = None,
      on_sample: Callable[[list[Sample], dict], None] | None = None,
      group_rewards: dynamic_sampling.GroupRewards | None = None,
  ):
    if filter_rounds is not None and group_rewards is None:
      raise ValueError("dynamic sampling (filter_rounds) needs the group_rewards to judge by.")
    self.rollout = rollout
    self.scheduler = scheduler
    self.rounds = rounds
    self.sampling = sampling
    self.seed = seed
    self.group_size = group_size
    self.mini_batch_size = mini_batch_size
    self.prompts_per_iteration = prompts_per_iteration
    self.filter_rounds = filter_rounds
    self.on_sample = on_sample
    self.group_rewards = group_rewards
    self.round_instances: dict[int, int] = {}  # iteration -> instances its round was planned for
    self.round: Round | None = None  # the round whose chunks are being released
    self.generated: Generated | None = None  # the last round's, once chunks() ended

  def chunks(self, it: int) -> Iterator[list[Sample]]:
    raise NotImplementedError

  def generate_round(self, rnd: Round, *, stoppable: bool = False) -> Iterator[Sample]:
    """Streams one round's samples, dispatched by the generation scheduler
    (which sees each request's prompt; `rnd.resume` says what is sent)."""
    # The instances taking work now (elastic generation changes them between rounds).
    live = list(self.rollout.live_instances)
    self.round_instances[rnd.it] = len(live)
    assignments, caps = self.scheduler.plan(
        rnd.requests,
        rnd.examples_by_id,
        seed=self.seed + rnd.it,
        num_instances=len(live),
        stoppable=stoppable,
        resumed=rnd.resume,
    )
    kw = {"stoppable": True} if stoppable else {}
    if self.scheduler.pool == "shared" and self.rollout.pooled:
      # One shared pool (streamrl/scheduling/pool.py): the plan says what goes first and to whom.
      if assignments is None:  # FIFO: round-robin, in arrival order
        assignments = [rnd.requests[k :: len(live)] for k in range(len(live))]
        caps = [None] * len(live)
      pool = pool_lib.from_parts(
          [[_as_sent(rnd, r) for r in part] for part in assignments],
          live,
          n_long=self.scheduler.n_long,
          estimates=self.scheduler.estimates,
      )
      full_caps = [None] * self.rollout.num_instances
      for i, cap in zip(live, caps):
        full_caps[i] = cap
      stream = self.rollout.generate(
          None,
          self.sampling,
          seed=local.round_seed(self.seed, rnd.it),
          caps=full_caps,
          pool=pool,
          migrate=self.scheduler.migrate,
          straggler_tokens=self.scheduler.straggler_tokens,
          **kw,
      )
      return stream if self.on_sample is None else self._tap(stream, rnd)
    if assignments is not None:
      # One list (and cap) per instance id; none for the ones not taking work.
      full, full_caps = [[] for _ in range(self.rollout.num_instances)], [None] * (
          self.rollout.num_instances
      )
      for i, part, cap in zip(live, assignments, caps):
        full[i], full_caps[i] = [_as_sent(rnd, r) for r in part], cap
      assignments, caps = full, full_caps
    stream = self.rollout.generate(
        None if assignments else [rnd.resume.get(r.id, r) for r in rnd.requests],
        self.sampling,
        seed=local.round_seed(self.seed, rnd.it),
        assignments=assignments,
        caps=caps,
        **kw,
    )
    return stream if self.on_sample is None else self._tap(stream, rnd)

  # ------------------------------------------------------- dynamic sampling
  def new_filter(self) -> dynamic_sampling.GroupFilter:
    """An iteration's `GroupFilter` (dynamic sampling is on)."""
    return dynamic_sampling.GroupFilter(
        self.group_rewards,
        group_size=self.group_size,
        target=self.prompts_per_iteration,
        unit=dynamic_sampling.groups_per_unit(self.mini_batch_size, self.group_size),
    )

  def filtered_groups(self, rnd: Round, f: dynamic_sampling.GroupFilter) -> Iterator[list[Sample]]:
    """Generates round `rnd`, then extra rounds of the same iteration while
    `f` is short of kept groups (at most `filter_rounds`); yields each kept
    group as soon as it is judged. An extra round's prompts are the next
    batch of `rounds`, numbered after every request sent so far; `rnd`
    takes them in (requests, examples, loader position), so it describes
    the whole iteration. Every generated sample is shown to the scheduler;
    its metrics are left in `f.scheduler_metrics`."""
    part = rnd
    for extra in range(self.filter_rounds + 1):
      if extra:
        part = self._extra_round(rnd)
        f.extra_rounds += 1
        f.extra_prompts += len(part.requests) // self.group_size
      samples = []
      for s in self.generate_round(part):
        samples.append(s)
        group = f.add(s, rnd.examples_by_id)
        if group is not None:
          yield group
      f.scheduler_metrics.update(self.scheduler.observe(samples))
      if f.full:
        return

  def _extra_round(self, rnd: Round) -> Round:
    """The next prompt batch as more requests of `rnd`'s iteration, merged into `rnd`."""
    more = self.rounds(rnd.it)
    # Whole groups past every id sent: requests stay unique (and keep their own seeds).
    offset = (max(r.id for r in rnd.requests) // self.group_size + 1) * self.group_size
    part = Round(
        rnd.it,
        [dataclasses.replace(r, id=r.id + offset) for r in more.requests],
        {i + offset: ex for i, ex in more.examples_by_id.items()},
        more.loader_state,
    )
    rnd.requests.extend(part.requests)
    rnd.examples_by_id.update(part.examples_by_id)
    rnd.loader_state = more.loader_state
    return part

  def filtered_round(self, rnd: Round) -> tuple[list[Sample], dict]:
    """Dynamic sampling over a whole round (sync, async): the samples to
    train, by request id, and the scheduler's and the filter's metrics."""
    f = self.new_filter()
    for _ in self.filtered_groups(rnd, f):
      pass
    take, pad = f.batch()
    for g in f.kept[take:]:  # cut to whole mini-batches: never trained
      self.group_rewards.release(g, rnd.examples_by_id)
    samples = [s for g in f.kept[:take] + pad for s in g]
    return sorted(samples, key=lambda s: s.prompt_id), {**f.scheduler_metrics, **f.metrics()}

  def _tap(self, stream: Iterator[Sample], rnd: Round) -> Iterator[Sample]:
    try:
      for sample in stream:
        if sample.finish_reason != PARTIAL:
          self.on_sample([sample], rnd.examples_by_id)
        yield sample
    finally:
      stream.close()

  def push(self, tensors, version: int) -> UpdateHandle:
    """Sends new weights; on-policy modes wait until every instance loaded them."""
    handle = self.rollout.update(tensors, version)
    handle.wait()
    return handle

  def restore(self, carry: dict | None, loader_state: dict) -> None:
    """What a checkpoint saved of the unfinished responses (`Round.carry`)
    and the loader position, before the first round of a resumed run. Only
    partial rollouts keep them; here they are dropped, with a warning."""
    del loader_state  # the run's loader is restored already
    if carry and carry.get("groups"):
      log.warning(
          "The checkpoint holds %d prompt groups of unfinished partial responses; this run "
          "(pipeline.partial=off) drops them. Resume with pipeline.partial=on to keep them.",
          len(carry["groups"]),
      )

  def quiesce(self) -> None:
    """Returns when no stream or update of the mode is in flight (before eval)."""

  def close(self) -> None:
    self.quiesce()
    self.scheduler.close()
