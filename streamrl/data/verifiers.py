"""The built-in reward functions (verifiers), by name, and what a reward returns.

Built-in names:

  exact_match        1.0 if the stripped response equals the answer, else 0.0.
  partial_match      exact_match, plus partial credit for near misses on the
                     synthetic tasks: `partial_weight * (characters right at
                     the right position) / max(len(answer), len(response))`
                     (default weight 0.5, so a near miss never beats a hit).
  math_verify        HF's `math-verify` package: the response's final answer
                     against the reference (its `\\boxed{}` or GSM8K `####`
                     part, else all of it), as mathematical objects
                     (`\\sqrt 2` = `\\sqrt{2}`, `x=5` = `5`, `0.5` = `\\frac12`).
  math_verify_light  the same idea without the dependency: the last
                     `\\boxed{}` / `####` / number, compared as exact
                     fractions or normalised strings (fast, no sympy).
  reasoning_gym      rows made by reasoning-gym (task.kind="gym"): the
                     generator's own scorer on the final answer.

A per-sample function returns a score, or a dict with `score` and optionally
`is_correct` (bool) and other numbers, which are logged as `reward_fn/<name>`
means, as is each function's own reward.

Correctness — the `accuracy` metrics — is the verifier's: the function's
`is_correct` where it returns one, else `score >= task.correct_threshold`
(1.0: a built-in scores 1 exactly when it counts the answer right).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
import re
import threading
from typing import Any, Callable, Mapping

import numpy as np

from streamrl import usercode

RewardFn = Callable[..., Any]


def exact_match(response: str, answer: str) -> float:
  """1.0 if `response` equals `answer` (outer whitespace ignored), else 0.0."""
  return float(response.strip() == answer.strip())


def partial_match(response: str, answer: str, *, partial_weight: float = 0.5) -> float:
  """Exact match, else `partial_weight` times the positional character overlap.

  The overlap is the number of positions i with response[i] == answer[i],
  divided by max(len(answer), len(response)); it is < 1 for any miss, so the
  reward of a miss stays below `partial_weight`.
  """
  response, answer = response.strip(), answer.strip()
  if response == answer:
    return 1.0
  denom = max(len(answer), len(response))
  if denom == 0:
    return 0.0
  hits = sum(a == b for a, b in zip(response, answer))
  return partial_weight * hits / denom


# ---------------------------------------------------------------- math_verify

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC_RE = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced."""
  start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
  if start < 0:
    return None
  i = text.index("{", start) + 1
  depth, j = 1, i
  while j < len(text):
    if text[j] == "{":
      depth += 1
    elif text[j] == "}":
      depth -= 1
      if depth == 0:
        return text[i:j]
    j += 1
  return None  # unbalanced: the response was cut off inside the box.


def _marked_answer(text: str) -> str | None:
  """Last `\\boxed{}` content, else the text after the last `####`."""
  boxed = _last_boxed(text)
  if boxed is not None:
    return boxed.strip()
  if "####" in text:
    tail = text.rsplit("####", 1)[1].strip()
    if tail:
      return tail.splitlines()[0].strip()
  return None


def extract_final_answer(text: str) -> str | None:
  """Final answer of a solution: last boxed content, else after the last
  `####` (GSM8K), else the last number in the text; None if there is none."""
  marked = _marked_answer(text)
  if marked is not None:
    return marked
  numbers = _NUMBER_RE.findall(text)
  # A sentence may end "... is 1,000, so": drop the trailing separator.
  return numbers[-1].rstrip(",") if numbers else None


def normalize_answer(ans: str) -> str:
  """Canonical string form: no `$`, spaces, `\\left`/`\\right`, `\\text{}`
  wrappers, thousands separators or trailing period; `\\dfrac` -> `\\frac`."""
  s = ans.strip()
  s = _TEXT_RE.sub(r"\1", s)
  for junk in ("$", "\\left", "\\right", "\\!", "\\,", "\\;", "^\\circ", "^{\\circ}", "\\%", "%"):
    s = s.replace(junk, "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = re.sub(r"\s+", "", s)
  s = s.rstrip(".")
  # Thousands separators only between digit groups: "1,000" but not "(1,2)".
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
    s = s.replace(",", "")
  return s


def parse_number(ans: str) -> fractions.Fraction | None:
  """Exact value of a normalised answer ("12", "-0.5", "3/4", "\\frac{3}{4}",
  "1e3"), or None if it is not a plain number."""
  s = normalize_answer(ans)
  m = _FRAC_RE.fullmatch(s) or re.fullmatch(r"(-?[\d.]+)/(-?[\d.]+)", s)
  try:
    if m:
      num, den = m.group(1), m.group(2)
      return fractions.Fraction(num) / fractions.Fraction(den)
    if s.startswith("-\\frac"):
      inner = parse_number(s[1:])
      return -inner if inner is not None else None
    return fractions.Fraction(s)
  except (ValueError, ZeroDivisionError):
    return None


def math_verify_light(response: str, answer: str) -> float:
  """1.0 if the response's final answer equals the reference's, else 0.0.

  The reference may be a bare answer ("72", "\\frac{3}{4}", used whole) or a
  full solution ending in `#### 72` or `\\boxed{72}` (that part is used). The
  response goes through `extract_final_answer`.
  Numbers compare exactly as fractions, anything else as normalised strings.
  """
  got = extract_final_answer(response)
  # A reference without a marker is the bare answer ("\frac{3}{4}", "72"):
  # taking its last number would turn "\frac{3}{4}" into "4".
  want = _marked_answer(answer)
  if want is None:
    want = answer.strip()
  if got is None or not want:
    return 0.0
  got_num, want_num = parse_number(got), parse_number(want)
  if got_num is not None and want_num is not None:
    return float(got_num == want_num)
  return float(normalize_answer(got) == normalize_answer(want))


def _reference(answer: str) -> str:
  """The part of a reference the verifier compares: its boxed / `####` part,
  else all of it (a bare "\\frac{3}{4}" is the answer, not its last number)."""
  want = _marked_answer(answer)
  return answer.strip() if want is None else want


def math_verify(response: str, answer: str) -> float:
  """1.0 if `math-verify` finds the response's final answer equal to the
  reference's, else 0.0. The reference (its marked part) is read as LaTeX
  math; the response as the package reads model output (boxed answers,
  `$...$` math, else the last expression)."""
  import math_verify as mv  # pylint: disable=g-import-not-at-top

  want = _reference(answer)
  if not want or not response.strip():
    return 0.0
  # Signal-based timeouts work only in a main thread (a worker process's is).
  kw = {} if threading.current_thread() is threading.main_thread() else {"parsing_timeout": None}
  gold = mv.parse(want if "$" in want or "\\boxed" in want else f"${want}$", **kw)
  pred = mv.parse(response, **kw)
  if not gold or not pred:
    return 0.0
  vkw = {} if not kw else {"timeout_seconds": None}
  return float(mv.verify(gold, pred, **vkw))


def reasoning_gym_score(response: str, answer: str, metadata: dict, gym_dataset: str) -> float:
  """A reasoning-gym row's score (streamrl/data/gym.py): the generator's own
  scorer on the response's final answer (the last `\\boxed{}`, `#### x` or
  number in it; the scorers read the first number of what they are given)."""
  import reasoning_gym  # pylint: disable=g-import-not-at-top

  entry = {"answer": answer, "metadata": metadata}
  return float(
      reasoning_gym.get_score_answer_fn(gym_dataset)(extract_final_answer(response), entry)
  )


# -------------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "partial_match": partial_match,
    "math_verify": math_verify,
    "math_verify_light": math_verify_light,
    # Rows of task.kind="gym": the reasoning-gym generator's own scorer.
    "reasoning_gym": reasoning_gym_score,
}


def known_reward_fns() -> list[str]:
  """Built-in names (a `module:function` or `file.py:function` works too)."""
  return sorted(_REGISTRY)


def check_reward_name(name: str) -> None:
  """ValueError unless `name` is a built-in or names a user's function (a
  UserError when a spec is malformed)."""
  if usercode.is_spec(name):
    usercode.split_spec(name)
    return
  if name not in _REGISTRY:
    raise ValueError(
        f"task.reward={name!r} is unknown; use one of {known_reward_fns()}, or your own "
        "function as `package.module:function`, `path/to/file.py:function` or "
        "`path/to/file.py` (its compute_score)."
    )


def get_reward_fn(name: str, **kwargs: Any) -> RewardFn:
  """The built-in reward `name` (keyword options bound), or the user's
  function a `module:function` / `file.py:function` / `file.py` spec names.

  Example: `get_reward_fn("partial_match", partial_weight=0.3)`.
  """
  if usercode.is_spec(name):
    return usercode.load_function(name, what="reward function")
  check_reward_name(name)
  fn = _REGISTRY[name]
  return functools.partial(fn, **kwargs) if kwargs else fn


# ---------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Score:
  """One verdict: the reward, whether the answer is right, extra metrics."""

  reward: float
  correct: bool
  metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def to_score(value: Any, threshold: float = 1.0) -> Score:
  """A reward function's result as a Score; ValueError for anything else
  (a non-number, a non-finite score, a dict without a numeric `score`)."""
  metrics = {}
  correct = None
  if isinstance(value, Mapping):
    if "score" not in value:
      raise ValueError(f"returned a dict without 'score' (keys {sorted(value)[:8]})")
    for k, v in value.items():
      if k in ("score", "is_correct"):
        continue
      if isinstance(v, (bool, int, float, np.number)) and math.isfinite(float(v)):
        metrics[str(k)] = float(v)
    if value.get("is_correct") is not None:
      correct = bool(value["is_correct"])
    value = value["score"]
  if isinstance(value, (bool, np.bool_)):
    value = float(value)
  if not isinstance(value, (int, float, np.number)):
    raise ValueError(f"returned {type(value).__name__}, not a number")
  reward = float(value)
  if not math.isfinite(reward):
    raise ValueError(f"returned the non-finite score {reward}")
  return Score(reward, reward >= threshold if correct is None else correct, metrics)
