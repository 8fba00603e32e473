"""The elastic policy's settings (`elastic.*`; the rule is streamrl/elastic/policy.py)."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import need, positive
from streamrl.elastic.policy import parse_schedule
from streamrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class Elastic:
  """Generator instances added and removed during a run.

  After each iteration the policy compares the measured generation and
  training times: it adds an instance when generation is the slower stage by
  more than one more instance is expected to save and the generation pool
  has a free slot; it releases an added instance whose measured saving
  (median over `observe_iterations` iterations) falls below `min_gain` of the
  expected one, and one instance when training stays the slower stage even
  without it. After an addition that did not pay it waits
  `cooldown_iterations` (doubled for every such addition) before adding
  again. A dead instance is replaced when `replace_dead`. `schedule` forces
  changes instead of the policy, e.g. "2:+1,4:-1" (after iteration 2 add
  one, after 4 remove one): for tests and demos.
  """

  enabled: bool = False
  min_instances: int = 1
  max_instances: int = 4
  observe_iterations: int = 2
  min_gain: float = 0.5
  cooldown_iterations: int = 4
  replace_dead: bool = True
  # Iterations the policy never looks at (the trainer compiles its steps there).
  warmup_iterations: int = 1
  schedule: str = ""

  def check(self) -> None:
    if not self.enabled:
      return
    positive("elastic.observe_iterations", self.observe_iterations)
    need(0 <= self.min_gain <= 1, f"elastic.min_gain={self.min_gain} must be in [0, 1].")
    positive("elastic.cooldown_iterations", self.cooldown_iterations, zero_ok=True)
    positive("elastic.warmup_iterations", self.warmup_iterations, zero_ok=True)
    try:
      parse_schedule(self.schedule)
    except ValueError as e:
      raise UserError(f"elastic.schedule={self.schedule!r}: {e}") from None
