"""The rewards the trainer trains on: the task's verifier, shaped.

`shaped_rewards` adds DAPO's overlong penalty (`loss.overlong_buffer`) to
what the rewarder (streamrl/data/rewards.py) scores; `GroupRewards` is the
same rewards as dynamic sampling (streamrl/pipeline/dynamic_sampling.py)
judges prompt groups by before the trainer sees them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl import rl
from streamrl.data.rewards import Rewarder
from streamrl.rl.config import Loss


def shaped_rewards(
    rewarder: Rewarder,
    samples,
    examples_by_id: dict,
    loss: Loss | None,
    max_tokens: int,
    *,
    keep: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
  """(reward, correctness) per sample: the task's verifier, plus DAPO's
  overlong penalty when `loss.overlong_buffer` is set (`rl.overlong_penalty`
  of the response length against `max_tokens`). `keep`: the verdicts are
  held for the trainer's own call (dynamic sampling judges groups first)."""
  r, c = rewarder(samples, examples_by_id, keep=True) if keep else rewarder(samples, examples_by_id)
  if loss is not None and loss.overlong_buffer:
    lengths = [len(x.token_ids) for x in samples]
    penalty = rl.overlong_penalty(lengths, max_tokens, loss.overlong_buffer, loss.overlong_penalty)
    r = r + np.asarray(penalty, np.float32)
  return r, c


@dataclasses.dataclass(frozen=True)
class GroupRewards:
  """What dynamic sampling judges a group by (`pipeline.base.Mode`'s
  `group_rewards`): the rewards the trainer will use (`shaped_rewards`), held
  by the rewarder so that the trainer's call does not score them again."""

  rewarder: Rewarder
  loss: Loss
  max_tokens: int

  def __call__(self, samples, examples_by_id: dict) -> np.ndarray:
    r, _ = shaped_rewards(
        self.rewarder, samples, examples_by_id, self.loss, self.max_tokens, keep=True
    )
    return r

  def release(self, samples, examples_by_id: dict) -> None:
    self.rewarder.release(samples, examples_by_id)
