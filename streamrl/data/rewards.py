"""Rule-based reward functions (verifiers), chosen by name.

Every reward function has the signature `fn(response: str, answer: str) ->
float`, where `response` is the decoded policy output (already cut at EOS) and
`answer` the reference from the dataset. Names:

  exact_match    1.0 if the stripped response equals the answer, else 0.0.
  partial_match  exact_match, plus partial credit for near misses on the
                 synthetic tasks: `partial_weight * (characters right at the
                 right position) / max(len(answer), len(response))`
                 (default weight 0.5, so a near miss never beats a hit and
                 padding the output with junk lowers the credit).
  math_verify    GSM8K / MATH style: extracts the final answer (last
                 `\\boxed{...}`, else `#### x`, else the last number) from
                 the response and compares it with the reference (its
                 boxed / `####` part, else all of it), numerically when
                 both parse ("1,000" == "1000.0", "1/2" == "0.5" == "\\frac{1}{2}").

The loop calls rewards through `safe_reward`, so a verifier that raises costs
one sample its reward (0.0, counted) instead of killing the run.
"""

from __future__ import annotations

import fractions
import functools
import logging
import math
import re
from typing import Any, Callable

import numpy as np

RewardFn = Callable[[str, str], float]

_log = logging.getLogger(__name__)


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


def math_verify(response: str, answer: str) -> float:
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


# -------------------------------------------------------------------- registry

_REGISTRY: dict[str, Callable[..., float]] = {
    "exact_match": exact_match,
    "partial_match": partial_match,
    "math_verify": math_verify,
}


def known_reward_fns() -> list[str]:
  """Names accepted by `get_reward_fn`."""
  return sorted(_REGISTRY)


def get_reward_fn(name: str, **kwargs: Any) -> RewardFn:
  """Reward function registered as `name`, with keyword options bound.

  Example: `get_reward_fn("partial_match", partial_weight=0.3)`.
  Raises ValueError listing the known names for an unknown one.
  """
  if name not in _REGISTRY:
    raise ValueError(
        f"Unknown reward function {name!r}; set the reward name to one of " f"{known_reward_fns()}."
    )
  fn = _REGISTRY[name]
  return functools.partial(fn, **kwargs) if kwargs else fn


# ---------------------------------------------------------------- safe calling

_warned: set[str] = set()


def safe_reward(fn: RewardFn, response: str, example: Any) -> tuple[float, bool]:
  """Calls `fn(response, example.answer)` and never raises.

  Returns:
    (reward, failed): on an exception, or a result that is not a finite
    number, (0.0, True) and a warning is logged once per error kind, so the
    loop can count failures without flooding the log.
  """
  try:
    value = float(fn(response, example.answer))
    if not math.isfinite(value):
      raise ValueError(f"reward function returned non-finite value {value}")
    return value, False
  except Exception as err:  # pylint: disable=broad-except
    kind = type(err).__name__
    if kind not in _warned:
      _warned.add(kind)
      _log.warning(
          "Reward function %s raised %s: %s (sample %s gets reward 0; further "
          "%s errors are counted, not logged).",
          getattr(fn, "__name__", repr(fn)),
          kind,
          err,
          getattr(example, "prompt_id", "?"),
          kind,
      )
    return 0.0, True


class Rewarder:
  """Scores samples with the task's verifier; a raising verifier scores 0
  and is counted in `errors` (logged as reward/errors_total)."""

  def __init__(self, reward_fn: RewardFn, tokenizer, answer_of: Callable[[str], str] | None = None):
    """`answer_of` cuts the part the verifier reads out of a decoded response
    (work traces: what follows the last `#`); None gives it all of it."""
    self.reward_fn = reward_fn
    self.tokenizer = tokenizer
    self.answer_of = answer_of
    self.errors = 0

  def __call__(self, samples, examples_by_id) -> tuple[np.ndarray, np.ndarray]:
    """(reward, exact-match correctness) per sample, float32."""
    scores, correct = [], []
    for s in samples:
      ex = examples_by_id[s.prompt_id]
      text = self.tokenizer.decode(s.token_ids)
      if self.answer_of is not None:
        text = self.answer_of(text)
      r, failed = safe_reward(self.reward_fn, text, ex)
      self.errors += int(failed)
      scores.append(r)
      correct.append(float(text.strip() == ex.answer.strip()))
    return np.asarray(scores, np.float32), np.asarray(correct, np.float32)
