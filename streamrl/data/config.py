"""The task's settings (`task.*`): which prompts, and how answers are scored."""

from __future__ import annotations

import dataclasses
import os

from streamrl.config_checks import need, one_of, positive
from streamrl.data import rewards, tasks

TASK_KINDS = ("trace", "synthetic", "jsonl")


@dataclasses.dataclass(frozen=True)
class Task:
  """Prompts and their verifier: synthetic string tasks or a JSONL file."""

  kind: str = "synthetic"
  ops: tuple = ("cpy", "rev", "dbl")
  max_answer_len: int = 48
  # kind="trace": passes over the input before the answer, geometric with mean
  # trace_base_passes + trace_passes_per_char * len(input) (streamrl/data/tasks.py).
  trace_base_passes: float = 0.5
  trace_passes_per_char: float = 0.125
  # The warm-up's traces fit this fraction of sampling.max_tokens. Below 1,
  # a sampled trace that overshoots still finishes instead of being cut
  # (reward 0), so RL is not pushed to drop the long traces.
  trace_token_fraction: float = 1.0
  reward: str = "partial_match"
  jsonl_path: str = ""
  num_eval: int = 256

  def check(self) -> None:
    one_of("task.kind", self.kind, TASK_KINDS)
    positive("task.num_eval", self.num_eval, zero_ok=True)
    if self.kind == "trace":
      positive("task.trace_base_passes", self.trace_base_passes, zero_ok=True)
      positive("task.trace_passes_per_char", self.trace_passes_per_char, zero_ok=True)
      need(
          0 < self.trace_token_fraction <= 1,
          f"task.trace_token_fraction={self.trace_token_fraction!r} must be in (0, 1]; "
          "fix --config.task.trace_token_fraction.",
      )
    if self.kind in ("synthetic", "trace"):
      bad = [op for op in self.ops if op not in tasks.KNOWN_OPS]
      need(
          self.ops and not bad,
          f"task.ops={self.ops!r} has unknown ops {bad}; use some of {tuple(tasks.KNOWN_OPS)}.",
      )
      positive("task.max_answer_len", self.max_answer_len)
    need(
        self.reward in rewards.known_reward_fns(),
        f"task.reward={self.reward!r} is unknown; use one of {rewards.known_reward_fns()}.",
    )

  def check_files(self) -> None:
    if self.kind == "jsonl":
      need(
          bool(self.jsonl_path) and os.path.isfile(self.jsonl_path),
          f"task.jsonl_path={self.jsonl_path!r} does not exist; point it at a JSONL file of "
          '{"prompt": ..., "answer": ...} rows.',
      )
