"""Dynamic sampling (`advantage.filter_groups`, DAPO): train on informative groups only.

A prompt group (the `group_size` samples of one prompt) whose rewards are all
equal has zero advantages under the group estimators, so it teaches nothing
and only dilutes the loss. With the filter on, each group is scored as soon
as its last sample arrives (`Mode.group_rewards`: the rewards the trainer
will use, shaping included), and a group with equal rewards is dropped
(`rl.group_keep_mask`). When a round ends with fewer than
`prompts_per_iteration` kept groups, the mode generates another round of the
same iteration, on more prompts, at most `advantage.filter_max_rounds` times:

  sync, colocated, stream, async  an extra round draws the next prompt batch
                                  (`Mode.rounds`), numbered after the ones
                                  already sent, and stops counting groups
                                  once enough are kept (the rest are left
                                  out, as in DAPO)
  async with partial rollouts     a dropped group leaves the buffer and the
                                  next top-up replaces it; an extra round
                                  tops the buffer up at once

Each round goes through the generation scheduler like any other (the skew
dispatcher plans it, and the ranker learns from every sample generated,
dropped or not). If the bound is hit first, the iteration trains what it
kept, rounded down to whole mini-batches (`rl.groups_to_train`). Logged:
`filter/dropped_groups`, `filter/extra_rounds`, `filter/extra_prompts`,
`filter/batch_fill` (the fraction of the wanted groups trained that were
kept) and `filter/kept_fraction` (of the groups scored).
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from streamrl import rl
from streamrl.generator.rollout import Sample


class GroupRewards(Protocol):
  """What groups are judged by (`streamrl.trainer.shaping.GroupRewards`)."""

  def __call__(self, samples: list[Sample], examples_by_id: dict) -> np.ndarray:
    """[B] the rewards `samples` will be trained with (scored once: held for the trainer)."""

  def release(self, samples: list[Sample], examples_by_id: dict) -> None:
    """Forgets what was held for `samples` (a dropped group: never trained)."""


def groups_per_unit(mini_batch_size: int, group_size: int) -> int:
  """The fewest whole groups that fill whole mini-batches."""
  return mini_batch_size // math.gcd(mini_batch_size, group_size)


class GroupFilter:
  """One iteration's dynamic sampling: judges finished groups, collects the kept ones.

  Args:
    rewards: scores samples as the trainer will (`GroupRewards`).
    group_size: samples per prompt; request id // group_size is the group.
    target: groups an iteration trains (`trainer.prompts_per_iteration`).
    unit: the fewest groups that fill whole mini-batches (`groups_per_unit`).
  """

  def __init__(self, rewards: GroupRewards, *, group_size: int, target: int, unit: int):
    self.rewards = rewards
    self.group_size = group_size
    self.target = target
    self.unit = unit
    self.kept: list = []  # kept groups, while fewer than target (`add`)
    self.dropped: list = []  # dropped groups, in the order they finished
    self.judged = 0
    self.extra_rounds = 0
    self.extra_prompts = 0
    self.scheduler_metrics: dict = {}  # the scheduler's, from the last round it observed
    self._open: dict[int, list[Sample]] = {}  # groups still missing samples

  @property
  def full(self) -> bool:
    return len(self.kept) >= self.target

  def judge(self, group, samples: list[Sample], examples_by_id: dict) -> bool:
    """Whether `group` (whose samples are `samples`) is kept; a dropped one is
    remembered (to pad a batch the bound left short)."""
    rewards = self.rewards(samples, examples_by_id)
    _, keep = rl.group_keep_mask(rewards, np.zeros(len(samples), np.int64))
    self.judged += 1
    if not keep[0]:
      self.dropped.append(group)
      self.rewards.release(samples, examples_by_id)
    return bool(keep[0])

  def add(self, sample: Sample, examples_by_id: dict) -> list[Sample] | None:
    """Adds one arriving sample; returns its group (samples by request id)
    when that completed it and it is kept among the first `target`."""
    gid = sample.prompt_id // self.group_size
    group = self._open.setdefault(gid, [])
    group.append(sample)
    if len(group) < self.group_size:
      return None
    del self._open[gid]
    if self.full:  # enough already: left out unscored
      return None
    group.sort(key=lambda x: x.prompt_id)
    if not self.judge(group, group, examples_by_id):
      return None
    self.kept.append(group)
    return group

  def batch(self, num_kept: int | None = None) -> tuple[int, list]:
    """(kept groups to train, dropped groups to pad with) once generation
    ended: `rl.groups_to_train` of `num_kept` (default: those `add` kept)."""
    num_kept = len(self.kept) if num_kept is None else num_kept
    take, pad = rl.groups_to_train(num_kept, self.target, self.unit)
    return take, self.dropped[:pad]

  def metrics(self, num_kept: int | None = None) -> dict:
    take, _ = self.batch(num_kept)
    return {
        "filter/dropped_groups": float(len(self.dropped)),
        "filter/extra_rounds": float(self.extra_rounds),
        "filter/extra_prompts": float(self.extra_prompts),
        "filter/batch_fill": take / self.target,
        "filter/kept_fraction": 1.0 - len(self.dropped) / max(self.judged, 1),
    }
