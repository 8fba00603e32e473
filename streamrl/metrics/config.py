"""What a run logs (`log.*`): evaluation, the progress bar, Weights & Biases."""

from __future__ import annotations

import dataclasses
import importlib.util

from streamrl.errors import UserError

WANDB_MODES = ("offline", "online", "disabled")


@dataclasses.dataclass(frozen=True)
class Log:
  """What a run logs (`log.*`): held-out evaluation every `eval_every`
  iterations (0: never), and the progress bar.

  wandb_project: when set, every scalar (and histogram) also goes to a
  Weights & Biases run of this project, kept in <workdir>/wandb/, with the
  run's config; empty (the default): wandb is never imported. wandb_mode:
  "offline" (the default: nothing leaves the machine; `wandb sync
  <workdir>/wandb/offline-run-*` uploads it later), "online", or "disabled".
  """

  eval_every: int = 25
  progress: bool = True
  wandb_project: str = ""
  wandb_mode: str = "offline"

  def check(self) -> None:
    if self.eval_every < 0:
      raise UserError(
          f"log.eval_every={self.eval_every!r} must be >= 0; fix --config.log.eval_every."
      )
    if self.wandb_mode not in WANDB_MODES:
      raise UserError(f"log.wandb_mode={self.wandb_mode!r} is unknown; use one of {WANDB_MODES}.")
    if self.wandb_project and importlib.util.find_spec("wandb") is None:
      raise UserError(
          f"log.wandb_project={self.wandb_project!r} needs the wandb package; install it "
          "(pip install -e '.[wandb]') or leave log.wandb_project empty."
      )
