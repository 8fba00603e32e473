"""Partial rollouts in the simulator: the prompt groups across rounds, as
streamrl/pipeline/partial.py keeps them (`PartialBuffer`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from streamrl.sim.config import SimConfig
from streamrl.sim.lengths import LengthDistribution


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


class PartialBuffer:
  """Partial rollouts' groups across rounds, as streamrl/pipeline/partial.py
  keeps them: topped up to target + extra, the version-gap reset, the oldest
  finished groups trained first."""

  def __init__(self, c: SimConfig):
    self.c = c
    self.target = c.samples_per_iteration // c.group_size
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

  def resumed_requests(self) -> list[int]:
    """This round's requests (indices) that resume a response with tokens."""
    return [i for i, (x, k) in enumerate(self.round) if x.gen[k]]

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
