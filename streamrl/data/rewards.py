"""Reward functions (verifiers): built-in ones by name, or the user's own.

`task.reward` is a built-in name or a function the user wrote,
`package.module:function` or `path/to/file.py:function`. A reward function
is called `fn(response, answer, **fields)`: the decoded policy output
(already cut at EOS; for work traces the part after the trace), the row's
reference answer, and the row's other columns as keywords (only those the
function names, or all with `**kwargs`). It returns a score, or a dict with
`score` and optionally `is_correct` (bool) and other numbers, which are
logged as `reward_fn/<name>` means.

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

Correctness — the `accuracy` metrics — is the verifier's: the function's
`is_correct` where it returns one, else `score >= task.correct_threshold`
(1.0: a built-in scores 1 exactly when it counts the answer right).

`Rewarder` calls the function through `streamrl.usercode.WorkerPool`: in
worker processes, each call with a deadline, as samples arrive. A reward
that raises, hangs or returns garbage costs that sample its reward (0.0),
is counted (`reward/errors_total`) and logged once per kind.
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import functools
import logging
import math
import re
import threading
from typing import Any, Callable, Mapping

import numpy as np

from streamrl import usercode

RewardFn = Callable[..., Any]

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
  """ValueError unless `name` is a built-in or names a user's function."""
  if usercode.is_spec(name):
    usercode.split_spec(name)
    return
  if name not in _REGISTRY:
    raise ValueError(
        f"task.reward={name!r} is unknown; use one of {known_reward_fns()}, or your own "
        "function as `package.module:function` or `path/to/file.py:function`."
    )


def get_reward_fn(name: str, **kwargs: Any) -> RewardFn:
  """The built-in reward `name` (keyword options bound), or the user's
  function a `module:function` / `file.py:function` spec names.

  Example: `get_reward_fn("partial_match", partial_weight=0.3)`.
  """
  if usercode.is_spec(name):
    return usercode.load_function(name, what="reward function")
  check_reward_name(name)
  fn = _REGISTRY[name]
  return functools.partial(fn, **kwargs) if kwargs else fn


def spec_of(name: str) -> str:
  """The `module:function` a worker process loads for reward `name`."""
  return name if usercode.is_spec(name) else f"{__name__}:{_REGISTRY[name].__name__}"


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


# ---------------------------------------------------------------- safe calling

_warned: set[str] = set()


def _log_failure_once(name: str, kind: str, message: str, prompt_id: Any) -> None:
  if kind not in _warned:
    _warned.add(kind)
    _log.warning(
        "Reward function %s failed with %s: %s (sample %s gets reward 0; further %s "
        "failures are counted in reward/errors_total, not logged).",
        name,
        kind,
        message,
        prompt_id,
        kind,
    )


def safe_reward(fn: RewardFn, response: str, example: Any) -> tuple[float, bool]:
  """Calls `fn(response, example.answer, **example.fields)` in this process
  and never raises: (reward, failed), with (0.0, True) and a warning once per
  error kind when it raises or returns no finite number."""
  try:
    fields = dict(getattr(example, "fields", {}) or {})
    return to_score(usercode.call_with_fields(fn, (response, example.answer), fields)).reward, False
  except Exception as err:  # pylint: disable=broad-except
    name = getattr(fn, "__name__", repr(fn))
    _log_failure_once(name, type(err).__name__, str(err), getattr(example, "prompt_id", "?"))
    return 0.0, True


class Rewarder:
  """Scores samples with the task's verifier, in worker processes.

  `submit(samples, examples_by_id)` starts scoring samples as they arrive
  (the pipeline calls it from the thread that receives them); calling the
  rewarder on a chunk waits for those scores (scoring what was not
  submitted). Calling it with `keep=True` (dynamic sampling looks at a
  group's rewards before the trainer does) holds the verdicts for the next
  plain call on the same responses, found by prompt and tokens whatever
  request id the sample has then, so nothing is scored or counted twice. A
  failed call (raised, timed out, garbage) scores 0, counts in `errors` (by
  kind in `errors_by_kind`) and is logged once per kind.

  Args:
    reward: a built-in name or a `module:function` / `file.py:function` spec.
    tokenizer: decodes responses (`decode(ids)`).
    answer_of: cuts the part the verifier reads out of a decoded response
      (work traces: what follows the last `#`); None: all of it.
    workers: worker processes (0: call in this process, without deadline).
    timeout_s: deadline of one call.
    correct_threshold: a score at or above it is correct, unless the
      function says `is_correct`.
  """

  def __init__(
      self,
      reward: str,
      tokenizer,
      answer_of: Callable[[str], str] | None = None,
      *,
      workers: int = 1,
      timeout_s: float | None = 10.0,
      correct_threshold: float = 1.0,
      base_dir: str | None = None,
  ):
    check_reward_name(reward)
    self.name = reward
    self.tokenizer = tokenizer
    self.answer_of = answer_of
    self.correct_threshold = correct_threshold
    self.pool = usercode.WorkerPool(
        spec_of(reward), workers=workers, timeout_s=timeout_s, base_dir=base_dir
    )
    self.errors = 0
    self.errors_by_kind: collections.Counter = collections.Counter()
    self._pending: collections.OrderedDict = collections.OrderedDict()
    # Verdicts held by `keep=True` calls: (example id, tokens) -> [Score, ...].
    self._held: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._metrics: list[Mapping[str, float]] = []

  @staticmethod
  def _key(sample, example) -> tuple:
    # The example's own id too: an eval request and a training one share
    # request ids, and two prompts may get the same response.
    return (sample.prompt_id, example.prompt_id, tuple(sample.token_ids))

  def text(self, sample) -> str:
    """What the verifier reads of a sample's response."""
    text = self.tokenizer.decode(sample.token_ids)
    return self.answer_of(text) if self.answer_of is not None else text

  def _start(self, sample, example):
    fields = dict(example.fields or {})
    return self.pool.submit(self.text(sample), example.answer, **fields)

  def submit(self, samples, examples_by_id) -> None:
    """Starts scoring `samples` (finished ones) now."""
    with self._lock:
      for s in samples:
        example = examples_by_id.get(s.prompt_id)
        if example is None:
          continue
        key = self._key(s, example)
        if key not in self._pending:
          self._pending[key] = self._start(s, example)
      # Scores never asked for (a sample dropped by the pipeline) do not pile up.
      while len(self._pending) > 65536:
        self._pending.popitem(last=False)

  def scores(self, samples, examples_by_id, *, keep: bool = False) -> list[Score]:
    """The verdict on each sample (waiting for submitted ones); `keep`: also
    held for the next call without it (see the class)."""
    out: list[Score | None] = [None] * len(samples)
    futures = {}
    with self._lock:
      for i, s in enumerate(samples):
        example = examples_by_id[s.prompt_id]
        held = self._held.get((example.prompt_id, tuple(s.token_ids)))
        if held:
          out[i] = held[0] if keep else held.pop(0)
          if not held:
            del self._held[(example.prompt_id, tuple(s.token_ids))]
          continue
        f = self._pending.pop(self._key(s, example), None)
        futures[i] = f or self._start(s, example)
    for i, f in futures.items():
      out[i] = self._verdict(samples[i], f.result())
    if keep:
      with self._lock:
        for i in futures:
          key = (examples_by_id[samples[i].prompt_id].prompt_id, tuple(samples[i].token_ids))
          self._held.setdefault(key, []).append(out[i])
        # Verdicts never asked for again (a dropped group) do not pile up.
        while len(self._held) > 65536:
          self._held.popitem(last=False)
    return out

  def release(self, samples, examples_by_id) -> None:
    """Forgets the verdicts a `keep=True` call held for `samples` (a group
    dynamic sampling dropped: never trained)."""
    with self._lock:
      for s in samples:
        key = (examples_by_id[s.prompt_id].prompt_id, tuple(s.token_ids))
        held = self._held.get(key)
        if held:
          held.pop(0)
          if not held:
            del self._held[key]

  def _verdict(self, sample, result) -> Score:
    """A worker's result as a Score; a failure counts and scores 0."""
    try:
      if isinstance(result, usercode.Failure):
        raise _Failed(result.kind, result.message)
      return to_score(result, self.correct_threshold)
    except (_Failed, ValueError) as err:
      kind, message = (err.kind, err.message) if isinstance(err, _Failed) else ("Garbage", str(err))
      with self._lock:  # dynamic sampling scores from the generation thread too
        self.errors += 1
        self.errors_by_kind[kind] += 1
      _log_failure_once(self.name, kind, message, sample.prompt_id)
      return Score(0.0, False)

  def __call__(
      self, samples, examples_by_id, *, keep: bool = False
  ) -> tuple[np.ndarray, np.ndarray]:
    """(reward, correctness) per sample, float32; extra metrics kept for `metrics()`
    (by the call without `keep`, which is the one the trainer's batch makes).

    A multi-turn trajectory's reward adds its environment's per-turn rewards
    (`Sample.turns.env_reward`) to its final answer's."""
    scores = self.scores(samples, examples_by_id, keep=keep)
    if not keep:
      self._metrics.extend(s.metrics for s in scores if s.metrics)
    env = [x.turns.env_reward if getattr(x, "turns", None) else 0.0 for x in samples]
    return (
        np.asarray([s.reward + e for s, e in zip(scores, env)], np.float32),
        np.asarray([s.correct for s in scores], np.float32),
    )

  def metrics(self) -> dict[str, float]:
    """Means of the extra metrics reward functions returned since the last call,
    as `reward_fn/<name>`, and the failure counts by kind (`reward/errors/<kind>`)."""
    sums, counts = collections.defaultdict(float), collections.Counter()
    for m in self._metrics:
      for k, v in m.items():
        sums[k] += v
        counts[k] += 1
    self._metrics = []
    out = {f"reward_fn/{k}": sums[k] / counts[k] for k in sums}
    out.update({f"reward/errors/{k}": float(n) for k, n in self.errors_by_kind.items()})
    return out

  def close(self) -> None:
    self.pool.close()

  def __enter__(self) -> "Rewarder":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _Failed(Exception):

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind, self.message = kind, message
