"""Partial rollouts: async rounds that stop early and resume the long tail.

`pipeline.partial=on` (async only). Each round starts more prompt groups
than it trains on (`pipeline.partial_oversample` more); once
`prompts_per_iteration` groups have finished, the generators stop
(`Rollout.stop_generation`) and every response still running comes back with
the tokens it has. Those responses are kept in a `PartialBuffer` and resumed
in the next round under the newest weights: the request's prompt is the
original prompt plus the tokens so far, and its budget what is left of
`max_tokens`. So the long tail of one round no longer holds up the round;
it is finished in the next one while new prompts fill the engine.

Every token keeps the weight version that sampled it and its behaviour
log-probability (`Sample.token_versions`, `Sample.logprobs`), so the
trainer's truncated importance weights (`loss.rollout_correction=tis`)
correct each token against the policy it trains. A token older than
`pipeline.max_token_version_gap` versions at training time is never
trained on: when carrying a response into a round would make its oldest
token too old, the response starts again (its tokens are counted as
wasted). Nothing is lost or counted twice: every started response is
trained exactly once, whole, and the buffer (unfinished responses and the
prompts drawn but not started) is saved with each checkpoint.

Multi-turn trajectories (`env.name` set) are carried the same way: a
stopped trajectory's sample holds its segment's tokens with their mask
(1 policy, 0 observation) and a `Resume` (streamrl/envs/runner.py: the
environment's state, its turns, whether it was cut mid-turn or waits on a
tool call); the resume request carries the newest one, and the prompt plus
tokens so far as above. An observation's tokens carry the version of the
segment that appended them; they are never trained, so the version-gap
bound and the gap metrics count the policy's tokens only.

Which groups a round trains: the oldest finished ones first (by the round
they started in, then the order they finished), `prompts_per_iteration` of
them; finished groups beyond that wait for the next round.

Dynamic sampling (`advantage.filter_groups`, streamrl/pipeline/dynamic_sampling.py):
a group is judged when its last response finishes, whole, and one whose
rewards are all equal leaves the buffer (`PartialBuffer.drop`); the next
top-up starts a fresh prompt in its place. A round whose requests all
finished with too few groups kept tops up and generates again, at most
`advantage.filter_max_rounds` times per iteration.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import numpy as np

from streamrl.data.tasks import Example
from streamrl.envs.runner import Resume
from streamrl.errors import UserError
from streamrl.generator.rollout import PARTIAL, Sample, TurnStats
from streamrl.scheduling.request import Request
from streamrl.pipeline import base, stream


@dataclasses.dataclass
class Member:
  """One response of a group, as far as it got."""

  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)  # per token
  finish_reason: str | None = None  # None while unfinished
  segments: int = 0  # generate calls that added tokens
  instance_id: int = -1
  # A trajectory's: per token 1 policy / 0 observation (empty for single-turn responses),
  # the newest segment's counts (the whole trajectory's), and where it resumes from.
  mask: list = dataclasses.field(default_factory=list)
  turns: TurnStats | None = None
  trajectory: Resume | None = None

  def policy_versions(self) -> list:
    return policy_versions(self.versions, self.mask)

  def saved(self) -> dict:
    """JSON-able (see `PartialBuffer.state`)."""
    if self.trajectory is not None:
      try:
        json.dumps(self.trajectory.state)
      except (TypeError, ValueError) as err:
        raise UserError(
            f"An unfinished trajectory's environment state ({type(self.trajectory.state).__name__}"
            ") is not JSON-serialisable, so partial rollouts cannot checkpoint it; make the "
            "environment's reset/step return dicts, lists, strings and numbers, or set "
            "pipeline.partial=off."
        ) from err
    return dataclasses.asdict(self)

  @classmethod
  def loaded(cls, saved: dict) -> Member:
    # Copies: the state dict stays as saved while the responses grow.
    kw = {k: list(v) if isinstance(v, list) else v for k, v in saved.items()}
    if kw.get("turns") is not None:
      kw["turns"] = TurnStats(**kw["turns"])
    if kw.get("trajectory") is not None:
      kw["trajectory"] = Resume(**kw["trajectory"])
    return cls(**kw)


def policy_versions(versions, mask) -> list:
  """The versions of the tokens the policy sampled (`mask` 1; empty or None: every token)."""
  return list(versions) if not mask else [v for v, k in zip(versions, mask) if k]


@dataclasses.dataclass
class Group:
  """The responses of one prompt (one for PPO, group_size for GRPO)."""

  example: Example
  prompt_ids: tuple
  members: list
  born: int  # the round it was first requested in
  done_seq: int | None = None  # finishing order, once every member finished

  @property
  def done(self) -> bool:
    return all(m.finish_reason is not None for m in self.members)


@dataclasses.dataclass
class RoundPlan:
  """What `PartialBuffer.start_round` asks the generators for."""

  requests: list[Request]  # what the scheduler plans on
  resume: dict  # request id -> Request(id, prompt + tokens so far, budget left[, trajectory])
  examples_by_id: dict
  wasted_tokens: int  # dropped by the version-gap bound this round
  replacements: int = 0  # fresh groups started in place of groups dynamic sampling dropped


class PartialBuffer:
  """The groups of the rounds in flight: what each response has so far.

  Pure bookkeeping (no engine), so its exactly-once rules are unit-tested:
  `start_round` -> `add` per arriving sample -> `finish_round`.
  """

  def __init__(
      self,
      *,
      target_groups: int,
      extra_groups: int,
      group_size: int,
      max_tokens: int,
      max_version_gap: int,
  ):
    self.target = int(target_groups)
    self.extra = int(extra_groups)
    self.group_size = int(group_size)
    self.max_tokens = int(max_tokens)
    self.max_gap = int(max_version_gap)
    self.fresh: collections.deque = collections.deque()  # (Example, prompt ids) drawn, not started
    self.groups: list[Group] = []
    self._ids: dict[int, tuple[Group, int]] = {}  # this round's request id -> (group, member)
    self._seq = 0
    self._wasted = 0
    self._dropped = 0  # groups dropped since the last top-up

  @classmethod
  def from_settings(cls, s, group_size: int) -> "PartialBuffer":
    groups = s.trainer.prompts_per_iteration
    return cls(
        target_groups=groups,
        extra_groups=max(1, math.ceil(groups * s.pipeline.partial_oversample)),
        group_size=group_size,
        max_tokens=s.sampling.max_tokens,
        max_version_gap=s.pipeline.max_token_version_gap,
    )

  # ------------------------------------------------------------- a round
  def start_round(
      self, it: int, pull: Callable[[], Sequence[tuple[Example, Sequence[int]]]]
  ) -> RoundPlan:
    """Drops tokens the gap bound forbids, tops the groups up to target +
    extra with fresh prompts (`pull()` gives the next loader batch as
    (Example, prompt ids) pairs) and numbers this round's requests."""
    wasted = 0
    for g in self.groups:
      for m in g.members:
        # Trained no earlier than iteration `it`: the oldest policy token's gap is at least this.
        if it - min(m.policy_versions(), default=it) > self.max_gap:
          wasted += len(m.tokens)
          m.__init__()  # starts again from the prompt
          g.done_seq = None
    started = 0
    while len(self.groups) < self.target + self.extra:
      if not self.fresh:
        self.fresh.extend((ex, tuple(int(t) for t in ids)) for ex, ids in pull())
      ex, ids = self.fresh.popleft()
      self.groups.append(Group(ex, ids, [Member() for _ in range(self.group_size)], born=it))
      started += 1
    replacements = min(started, self._dropped)
    self._dropped -= replacements
    requests, resume, by_id = [], {}, {}
    self._ids = {}
    for j, g in enumerate(self.groups):
      for k, m in enumerate(g.members):
        rid = j * self.group_size + k
        by_id[rid] = g.example
        self._ids[rid] = (g, k)
        if m.finish_reason is not None:
          continue
        requests.append(Request(rid, g.prompt_ids))
        if m.tokens:
          resume[rid] = Request(
              rid,
              g.prompt_ids + tuple(m.tokens),
              self.max_tokens - len(m.tokens),
              trajectory=m.trajectory,
          )
    self._wasted += wasted  # an extra round of the same iteration adds to it
    return RoundPlan(requests, resume, by_id, wasted, replacements)

  def add(self, sample: Sample) -> Group | None:
    """Appends an arriving sample to its response; returns the group when
    that finished the response's whole group (None otherwise)."""
    g, k = self._ids[sample.prompt_id]
    m = g.members[k]
    if m.finish_reason is not None:
      raise RuntimeError(f"Request {sample.prompt_id} got a second sample after it finished.")
    if sample.token_ids:
      m.tokens.extend(sample.token_ids)
      m.logprobs.extend(sample.logprobs)
      m.versions.extend([sample.weight_version] * len(sample.token_ids))
      m.mask.extend(sample.mask or ())
      m.segments += 1
      m.instance_id = sample.instance_id
    if sample.turns is not None:
      m.turns = sample.turns
    if sample.trajectory is not None:
      m.trajectory = sample.trajectory
    if sample.finish_reason == PARTIAL:
      return None
    m.finish_reason = sample.finish_reason
    if g.done and g.done_seq is None:
      g.done_seq = self._seq
      self._seq += 1
      return g
    return None

  def drop(self, group: Group) -> None:
    """Takes a finished group out untrained (dynamic sampling); the next
    top-up starts a fresh prompt in its place."""
    self.groups.remove(group)
    self._dropped += 1

  @property
  def num_done(self) -> int:
    return sum(g.done for g in self.groups)

  def samples_of(self, groups: Sequence[Group], it: int) -> tuple[list[Sample], dict]:
    """Finished `groups` as whole samples numbered 0..len(groups)*group_size-1
    in their order, and request id -> Example."""
    samples, by_id = [], {}
    for j, g in enumerate(groups):
      for k, m in enumerate(g.members):
        rid = j * self.group_size + k
        by_id[rid] = g.example
        samples.append(
            Sample(
                prompt_id=rid,
                prompt_token_ids=g.prompt_ids,
                token_ids=tuple(m.tokens),
                logprobs=tuple(m.logprobs),
                finish_reason=m.finish_reason,
                weight_version=min(m.policy_versions(), default=it),
                instance_id=m.instance_id,
                token_versions=tuple(m.versions),
                mask=None if m.turns is None else tuple(m.mask),
                turns=m.turns,
            )
        )
    return samples, by_id

  def finish_round(
      self, it: int, *, take: int | None = None, padding: Sequence[Group] = ()
  ) -> tuple[list[Sample], dict, dict]:
    """Takes the `take` (default `target`) oldest finished groups out, then
    `padding` (dropped groups dynamic sampling pads a short batch with):
    (their samples, request id -> Example, metrics). Samples are numbered
    from 0 in that order."""
    take = self.target if take is None else take
    done = sorted((g for g in self.groups if g.done), key=lambda g: (g.born, g.done_seq))
    if len(done) < take:
      raise RuntimeError(
          f"Round {it} ended with {len(done)} finished groups of the {take} it "
          "trains on; a generator returned fewer samples than requested."
      )
    chosen = done[:take]
    taken = {id(g) for g in chosen}
    self.groups = [g for g in self.groups if id(g) not in taken]
    chosen += list(padding)
    samples, by_id = self.samples_of(chosen, it)
    gaps = np.array(
        [it - v for g in chosen for m in g.members for v in m.policy_versions()], np.float64
    )
    carried = [m for g in self.groups for m in g.members]
    metrics = {
        "partial/resumed_fraction": float(
            np.mean([m.segments > 1 for g in chosen for m in g.members])
        ),
        "partial/token_version_gap_mean": float(gaps.mean()) if gaps.size else 0.0,
        "partial/token_version_gap_max": float(gaps.max()) if gaps.size else 0.0,
        "partial/wasted_tokens": float(self._wasted),
        "partial/carried_responses": float(sum(m.finish_reason is None for m in carried)),
        "partial/carried_tokens": float(sum(len(m.tokens) for m in carried)),
    }
    self._ids = {}
    self._wasted = 0
    return samples, by_id, metrics

  # ---------------------------------------------------------- checkpoint
  def state(self) -> dict:
    """JSON-serialisable: the groups in flight and the prompts drawn but not started (an
    unfinished trajectory's environment state included, which must be JSON-able too)."""
    return {
        "fresh": [[dataclasses.asdict(ex), list(ids)] for ex, ids in self.fresh],
        "groups": [
            {
                "example": dataclasses.asdict(g.example),
                "prompt_ids": list(g.prompt_ids),
                "born": g.born,
                "done_seq": g.done_seq,
                "members": [m.saved() for m in g.members],
            }
            for g in self.groups
        ],
        "seq": self._seq,
    }

  def load_state(self, state: dict) -> None:
    self.fresh = collections.deque(
        (Example(**ex), tuple(ids)) for ex, ids in state.get("fresh", [])
    )
    self.groups = []
    for g in state.get("groups", []):
      members = [Member.loaded(m) for m in g["members"]]
      if len(members) != self.group_size:
        raise ValueError(
            f"The checkpoint's partial responses come in groups of {len(members)}, this "
            f"run's advantage.group_size is {self.group_size}; resume with the same group size."
        )
      self.groups.append(
          Group(Example(**g["example"]), tuple(g["prompt_ids"]), members, g["born"], g["done_seq"])
      )
    self._seq = int(state.get("seq", 0))


class PartialAsyncMode(stream.AsyncMode):
  """Async with partial rollouts (`pipeline.partial=on`)."""

  def __init__(self, *args, buffer: PartialBuffer, **kwargs):
    super().__init__(*args, **kwargs)
    self.buffer = buffer
    self._loader_state: dict | None = None
    # Dynamic sampling: iteration -> fresh groups started in place of dropped ones.
    self._replacements: dict[int, int] = {}

  def restore(self, carry: dict | None, loader_state: dict) -> None:
    """The buffer and loader position a checkpoint saved (before the first
    round of a resumed run)."""
    self._loader_state = loader_state
    if carry:
      self.buffer.load_state(carry)

  def _pull(self, it: int) -> list:
    rnd = self.rounds(it)
    self._loader_state = rnd.loader_state
    return [(rnd.examples_by_id[r.id], r.prompt) for r in rnd.requests[:: self.group_size]]

  def _next_round(self, it: int) -> base.Round:
    plan = self.buffer.start_round(it, lambda: self._pull(it))
    self._replacements[it] = self._replacements.get(it, 0) + plan.replacements
    return base.Round(
        it, plan.requests, plan.examples_by_id, self._loader_state, resume=plan.resume
    )

  def _produce(self, rnd: base.Round):
    f = None if self.filter_rounds is None else self.new_filter()
    part = rnd
    for extra in range(1 + (self.filter_rounds or 0)):
      if extra:  # dynamic sampling kept too few groups: top up and generate again
        if self.buffer.num_done >= self.buffer.target:
          break
        part = self._next_round(rnd.it)
        f.extra_rounds += 1
      self._generate_part(part, f)
      if f is None:
        break
    num_kept = self.buffer.num_done
    take, padding = (self.buffer.target, []) if f is None else f.batch(num_kept)
    samples, by_id, metrics = self.buffer.finish_round(rnd.it, take=take, padding=padding)
    trained = dataclasses.replace(
        rnd,
        requests=[(s.prompt_id, s.prompt_token_ids) for s in samples],
        examples_by_id=by_id,
        loader_state=self._loader_state,
        resume={},
        carry=self.buffer.state(),
    )
    metrics.update(self.scheduler.observe(samples))
    replacements = self._replacements.pop(rnd.it, 0)
    if f is not None:
      f.extra_prompts = replacements
      metrics.update(f.metrics(num_kept))
    return trained, samples, metrics

  def _generate_part(self, part: base.Round, f) -> None:
    """Streams one round (or an extra round) into the buffer, judging each
    group as it finishes when `f` (dynamic sampling) is given; stops the
    generators once enough groups are done."""
    if not part.requests:
      return
    stopped = False
    for s in self.generate_round(part, stoppable=True):
      group = self.buffer.add(s)
      if group is None:
        continue
      if f is not None:
        samples, by_id = self.buffer.samples_of([group], part.it)
        if not f.judge(group, samples, by_id):
          self.buffer.drop(group)
      if not stopped and self.buffer.num_done >= self.buffer.target:
        self.rollout.stop_generation()
        stopped = True

  def _check_staleness(self, it: int, samples) -> None:
    gap = max(
        it - v
        for s in samples
        for v in (policy_versions(s.token_versions or (), s.mask) or (s.weight_version,))
    )
    if gap > self.buffer.max_gap:
      raise RuntimeError(
          f"A token trained in iteration {it} is {gap} versions old, beyond "
          f"pipeline.max_token_version_gap={self.buffer.max_gap}; this is a bug."
      )
