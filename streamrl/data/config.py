"""The task's settings (`task.*`): which prompts, and how answers are scored."""

from __future__ import annotations

import dataclasses
import json
import math

from streamrl.config.checks import need, one_of, positive
from streamrl.data import dataset, gym, tasks, verifiers
from streamrl.data.tokenizer import CHAT_TEMPLATE_MODES
from streamrl.errors import UserError

TASK_KINDS = ("trace", "synthetic", "calc", "file", "gym")


@dataclasses.dataclass(frozen=True)
class Task:
  """Prompts and their verifier: synthetic string tasks, a dataset file
  (`kind="file"`: JSONL or Parquet, streamrl/data/dataset.py), or rows a
  reasoning-gym generator makes offline (`kind="gym"`, streamrl/data/gym.py)."""

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
  # kind="calc" (streamrl/data/calc.py; with env.name="calc"): sums of 2..calc_max_terms
  # numbers of calc_digits digits (the terms beyond 2 geometric with mean
  # calc_mean_extra_terms); the warm-up's first calc_tool_steps steps train tool
  # trajectories only, the rest a mixture with calc_tool_fraction of them.
  calc_max_terms: int = 6
  calc_mean_extra_terms: float = 1.0
  calc_digits: int = 4
  calc_tool_fraction: float = 0.25
  calc_tool_steps: int = 0
  # A built-in name (streamrl/data/verifiers.py) or the user's function,
  # `package.module:function` or `path/to/file.py:function` (a `.py` path
  # alone means its `compute_score`); several, comma-separated, are summed
  # with `reward_weights` (comma-separated numbers, "" for all 1), like TRL's
  # reward_funcs and reward_weights. The first decides the accuracy.
  reward: str = "partial_match"
  reward_weights: str = ""
  # A reward failing on more than this fraction of its first samples (raising,
  # hanging, returning no number) stops the run (1 never stops it).
  max_reward_error_rate: float = 0.5
  # Worker processes scoring rewards (0: in the trainer's process, no deadline).
  reward_workers: int = 1
  reward_timeout_s: float = 10.0
  # A score at or above it counts as correct (unless the reward says is_correct).
  correct_threshold: float = 1.0
  # kind="file": the training rows, and the held-out rows ("" holds out the
  # first num_eval // 10-capped rows of train_path, as before).
  train_path: str = ""
  eval_path: str = ""
  prompt_key: str = "prompt"
  # kind="gym": the reasoning-gym generator and how many training rows it makes
  # (the num_eval held-out rows come from another seed).
  gym_dataset: str = "gsm_symbolic"
  gym_size: int = 1024
  answer_key: str = "answer"
  # Chat template of the model's tokenizer: auto (when it has one) | on | off;
  # its extra variables as a JSON object, e.g. '{"enable_thinking": false}'.
  chat_template: str = "auto"
  chat_template_kwargs: str = ""
  # A prompt longer than engine.max_model_len - sampling.max_tokens tokens is
  # dropped (counted, logged once), cut (left | right | middle) or refused (error).
  truncation: str = "drop"
  system_prompt: str = ""
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
    if self.kind == "calc":
      need(
          self.calc_max_terms >= 2,
          f"task.calc_max_terms={self.calc_max_terms} must be >= 2 (a sum has two terms).",
      )
      positive("task.calc_mean_extra_terms", self.calc_mean_extra_terms, zero_ok=True)
      need(
          1 <= self.calc_digits <= 9,
          f"task.calc_digits={self.calc_digits} must be in [1, 9]; fix --config.task.calc_digits.",
      )
      need(
          0 <= self.calc_tool_fraction <= 1,
          f"task.calc_tool_fraction={self.calc_tool_fraction} must be in [0, 1].",
      )
      positive("task.calc_tool_steps", self.calc_tool_steps, zero_ok=True)
    if self.kind in ("synthetic", "trace"):
      bad = [op for op in self.ops if op not in tasks.KNOWN_OPS]
      need(
          self.ops and not bad,
          f"task.ops={self.ops!r} has unknown ops {bad}; use some of {tuple(tasks.KNOWN_OPS)}.",
      )
      positive("task.max_answer_len", self.max_answer_len)
    try:
      for name in self.reward_names():
        verifiers.check_reward_name(name)
    except (ValueError, UserError) as err:
      need(False, str(err))
    self.weights()
    need(
        0 <= self.max_reward_error_rate <= 1,
        f"task.max_reward_error_rate={self.max_reward_error_rate!r} must be in [0, 1]; fix "
        "--config.task.max_reward_error_rate (1 never stops the run).",
    )
    one_of("task.truncation", self.truncation, dataset.TRUNCATION_MODES)
    self.template_kwargs()
    positive("task.reward_workers", self.reward_workers, zero_ok=True)
    positive("task.reward_timeout_s", self.reward_timeout_s)
    one_of("task.chat_template", self.chat_template, CHAT_TEMPLATE_MODES)
    if self.kind == "gym":
      positive("task.gym_size", self.gym_size)
      need(
          gym.known(self.gym_dataset),
          f"task.gym_dataset={self.gym_dataset!r} is not a reasoning-gym generator; name one "
          "(reasoning_gym.factory.DATASETS lists them), e.g. gsm_symbolic.",
      )
    need(bool(self.prompt_key), "task.prompt_key is empty; name the dataset's prompt column.")

  def reward_names(self) -> list[str]:
    """The reward functions `reward` names, in order."""
    return [r.strip() for r in self.reward.split(",")]

  def weights(self) -> tuple[float, ...]:
    """One weight per reward function (`reward_weights`, all 1 when empty)."""
    n = len(self.reward_names())
    if not self.reward_weights.strip():
      return (1.0,) * n
    try:
      out = tuple(float(w) for w in self.reward_weights.split(","))
    except ValueError:
      out = ()
    need(
        len(out) == n and all(math.isfinite(w) for w in out),
        f"task.reward_weights={self.reward_weights!r} must be {n} comma-separated number(s), "
        f"one per function of task.reward={self.reward!r}.",
    )
    return out

  def template_kwargs(self) -> dict:
    """`chat_template_kwargs` as a dict (the chat template's extra variables)."""
    if not self.chat_template_kwargs.strip():
      return {}
    try:
      out = json.loads(self.chat_template_kwargs)
    except json.JSONDecodeError:
      out = None
    need(
        isinstance(out, dict),
        f"task.chat_template_kwargs={self.chat_template_kwargs!r} is not a JSON object; write "
        """e.g. --config.task.chat_template_kwargs='{"enable_thinking": false}'.""",
    )
    return out

  def calc_config(self):
    """The sums of kind="calc" (`data.calc.CalcConfig`)."""
    from streamrl.data import calc  # pylint: disable=g-import-not-at-top

    return calc.CalcConfig(
        max_terms=self.calc_max_terms,
        mean_extra_terms=self.calc_mean_extra_terms,
        digits=self.calc_digits,
        tool_fraction=self.calc_tool_fraction,
        tool_steps=self.calc_tool_steps,
    )

  def check_files(self) -> None:
    if self.kind != "file":
      return
    need(
        bool(self.train_path),
        "task.train_path is empty; point it at a JSONL or Parquet file of "
        '{"prompt": ..., "answer": ...} rows, a directory of them, or a '
        "datasets.save_to_disk directory.",
    )
    for path in (self.train_path, self.eval_path):
      if path:
        dataset.resolve_paths(path)
