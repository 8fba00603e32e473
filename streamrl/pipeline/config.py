"""How generation and training overlap (`pipeline.*`; streamrl/pipeline)."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import need, one_of, positive

PIPELINE_MODES = ("colocated", "sync", "stream", "async")


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """The mode and its staleness; partial rollouts.

  Partial rollouts (async only; streamrl/pipeline/partial.py): "on" asks
  each round for `partial_oversample` more prompt groups than it trains,
  stops the round once enough groups finished and resumes the unfinished
  responses next round under the new weights. A token more than
  `max_token_version_gap` versions older than the weights it is trained
  with is never trained on: its response starts again. "auto": on in async
  mode, off in the others (the run configs' choice, so that
  `--config.pipeline.mode=sync` needs nothing else).
  """

  mode: str = "colocated"
  max_staleness: int = 1
  stall_timeout_s: float = 600.0
  partial: str = "off"
  partial_oversample: float = 0.25
  max_token_version_gap: int = 2

  @property
  def partial_rollouts(self) -> bool:
    """Whether rounds resume unfinished responses (`auto` resolved by mode)."""
    return self.partial == "on" or (self.partial == "auto" and self.mode == "async")

  def check(self) -> None:
    one_of("pipeline.mode", self.mode, PIPELINE_MODES)
    need(
        self.max_staleness >= 1,
        f"pipeline.max_staleness={self.max_staleness} must be >= 1 (async is one step "
        "off-policy at least).",
    )
    positive("pipeline.stall_timeout_s", self.stall_timeout_s)
    one_of("pipeline.partial", self.partial, ("off", "on", "auto"))
    if not self.partial_rollouts:
      return
    need(
        self.mode == "async",
        "pipeline.partial='on' resumes responses under newer weights, which only "
        "pipeline.mode='async' does; set pipeline.mode=async or pipeline.partial=off "
        f"(got pipeline.mode={self.mode!r}).",
    )
    need(
        0 < self.partial_oversample <= 4,
        f"pipeline.partial_oversample={self.partial_oversample} must be in (0, 4]: "
        "the fraction of extra prompt groups each round starts.",
    )
    need(
        self.max_token_version_gap >= self.max_staleness,
        f"pipeline.max_token_version_gap={self.max_token_version_gap} must be >= "
        f"pipeline.max_staleness={self.max_staleness}, or no fresh sample could be "
        "trained on; raise it.",
    )
