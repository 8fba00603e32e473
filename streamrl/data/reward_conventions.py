"""A user's reward function called the way the framework it was written for calls it.

The framework is recognised by the function's parameter names (`convention`):

  StreamRL  `score(response, answer, **columns)`, once per sample: the
            decoded policy output (already cut at EOS; for work traces the
            part after the trace), the row's reference answer, and the row's
            other columns it names (all of them with `**kwargs`).
  verl      `compute_score(data_source, solution_str, ground_truth,
            extra_info=None, **kwargs)`, once per sample, by keyword.
  TRL       `f(prompts, completions, completion_ids=None, **columns)`, once
            per batch, every argument a list (chat prompts as message lists,
            their completions as `[{"role": "assistant", "content": ...}]`),
            returning one number or None (no reward) per sample.

`in_worker` is what a reward worker process runs (`streamrl.usercode.WorkerPool`);
`safe_reward` calls a function in this process and never raises.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

from streamrl import usercode
from streamrl.data.verifiers import RewardFn, get_reward_fn, to_score

_log = logging.getLogger(__name__)

STREAMRL, VERL, TRL = "StreamRL", "verl", "TRL"
# How each framework calls a reward; the functions below call it the same way.
SIGNATURES = {
    STREAMRL: "score(response, answer, **columns) -> float | dict",
    VERL: "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)",
    TRL: "f(prompts, completions, completion_ids=None, **columns) -> list[float | None]",
}
ALL_SIGNATURES = (
    f"StreamRL's {SIGNATURES[STREAMRL]}, verl's {SIGNATURES[VERL]} or TRL's {SIGNATURES[TRL]}"
)
_NAMED = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")
# The keywords verl's reward manager passes, and those TRL's trainer passes.
_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_TRL_ARGS = ("prompts", "completions", "completion_ids")


def describe(fn: Callable) -> list[tuple[str, str, bool]]:
  """(name, kind, has a default) of each parameter of `fn` ([] when unknown)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return []
  return [(p.name, p.kind.name, p.default is not p.empty) for p in params]


def convention(params: list[tuple[str, str, bool]]) -> str:
  """Which framework's signature the parameters are: verl's when they name
  `solution_str` or `ground_truth`, TRL's when they name `completions` or
  `prompts`, StreamRL's otherwise."""
  names = {n for n, kind, _ in params if kind in _NAMED}
  if names & {"solution_str", "ground_truth"}:
    return VERL
  if names & {"completions", "prompts"}:
    return TRL
  return STREAMRL


def signature_text(name: str, params: list[tuple[str, str, bool]]) -> str:
  """`name(a, b=..., **kw)`: the signature a function was found to have."""
  parts = []
  for n, kind, default in params:
    prefix = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(kind, "")
    parts.append(f"{prefix}{n}{'=...' if default else ''}")
  return f"{name}({', '.join(parts)})"


def missing_arguments(params, style: str, columns) -> list[str]:
  """Required parameters of a `style` function that neither the framework's
  call nor the row's `columns` fill."""
  given = set(columns) | set(_VERL_ARGS if style == VERL else _TRL_ARGS if style == TRL else ())
  required = [n for n, kind, default in params if kind in _NAMED and not default]
  if style == STREAMRL:  # response and answer fill the first two, by position.
    positional = [
        n for n, kind, _ in params if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    ]
    required = [n for n in required if n not in positional[:2]]
  return [n for n in required if n not in given]


def call_sample(fn: Callable, style: str, response: str, answer: Any, columns: dict) -> Any:
  """One sample's reward, called as its framework calls it: StreamRL's
  `fn(response, answer, **columns)`, verl's keyword call. Only the columns the
  function names reach it (all of them when it takes `**kwargs`)."""
  if style == VERL:
    kw = {
        **columns,
        "data_source": columns.get("data_source"),
        "solution_str": response,
        "ground_truth": answer,
        "extra_info": columns.get("extra_info"),
    }
    return usercode.call_with_fields(fn, (), kw)
  cols = {k: v for k, v in columns.items() if k not in ("response", "answer")}
  return usercode.call_with_fields(fn, (response, answer), cols)


def call_batch(fn: Callable, prompts: list, completions: list, ids: list, columns: dict) -> Any:
  """A batch's rewards, called as TRL calls a reward function: keyword lists
  of the prompts, the completions and their token ids, and of every column."""
  kw = {**columns, "prompts": prompts, "completions": completions, "completion_ids": ids}
  return usercode.call_with_fields(fn, (), kw)


@functools.cache
def _function(spec: str) -> Callable:
  return get_reward_fn(spec)


def in_worker(op: str, spec: str, style: str, payload: dict) -> Any:
  """What a reward worker process runs: `describe` the function `spec` names,
  or call it (`sample`: `call_sample`; `batch`: `call_batch`)."""
  fn = _function(spec)
  if op == "describe":
    return describe(fn)
  if op == "batch":
    return call_batch(fn, **payload)
  return call_sample(fn, style, **payload)


_warned: set[tuple[str, str]] = set()


def warn_failure(warned: set, name: str, kind: str, message: str, prompt_id: Any) -> None:
  """A failure's warning, once per function and kind of failure."""
  if (name, kind) in warned:
    return
  warned.add((name, kind))
  _log.warning(
      "Reward function %s failed with %s: %s (sample %s gets reward 0 from it; further %s "
      "failures of %s are counted in reward/errors_total, not logged).",
      name,
      kind,
      message,
      prompt_id,
      kind,
      name,
  )


def safe_reward(fn: RewardFn, response: str, example: Any) -> tuple[float, bool]:
  """Calls `fn(response, example.answer, **example.fields)` in this process
  and never raises: (reward, failed), with (0.0, True) and a warning once per
  function and error kind when it raises or returns no finite number."""
  try:
    fields = dict(getattr(example, "fields", {}) or {})
    return to_score(usercode.call_with_fields(fn, (response, example.answer), fields)).reward, False
  except Exception as err:  # pylint: disable=broad-except
    name = getattr(fn, "__name__", repr(fn))
    warn_failure(_warned, name, type(err).__name__, str(err), getattr(example, "prompt_id", "?"))
    return 0.0, True
