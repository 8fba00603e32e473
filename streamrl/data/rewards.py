"""Reward functions (verifiers): built-in ones by name, or the user's own.

`task.reward` is a built-in name or a function the user wrote,
`package.module:function`, `path/to/file.py:function` or `path/to/file.py`
(its `compute_score`); several, comma-separated, are summed with
`task.reward_weights`. A user's function is called the way the framework it
was written for calls it, recognised by its parameter names (`convention`):

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

A per-sample function returns a score, or a dict with `score` and optionally
`is_correct` (bool) and other numbers, which are logged as `reward_fn/<name>`
means, as is each function's own reward.

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

`Rewarder` calls the functions through `streamrl.usercode.WorkerPool`: in
worker processes, each call with a deadline, as samples arrive. Before the
run it calls each once on a training row (`Rewarder.probe`): a function that
cannot work stops the run there with one sentence. A reward that raises,
hangs or returns garbage costs that sample its reward (0.0), is counted
(`reward/errors_total`) and logged once per function and kind; one failing on
more than `task.max_reward_error_rate` of its first samples stops the run.
"""

from __future__ import annotations

import collections
import dataclasses
import fractions
import functools
import inspect
import logging
import math
import re
import threading
from typing import Any, Callable, Mapping

import numpy as np

from streamrl import usercode
from streamrl.errors import UserError

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


# ------------------------------------------------------------- signatures
STREAMRL, VERL, TRL = "StreamRL", "verl", "TRL"
# How each framework calls a reward; the functions below call it the same way.
SIGNATURES = {
    STREAMRL: "score(response, answer, **columns) -> float | dict",
    VERL: "compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)",
    TRL: "f(prompts, completions, completion_ids=None, **columns) -> list[float | None]",
}
_ALL_SIGNATURES = (
    f"StreamRL's {SIGNATURES[STREAMRL]}, verl's {SIGNATURES[VERL]} or TRL's {SIGNATURES[TRL]}"
)
_NAMED = ("POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY")
# The keywords verl's reward manager passes, and those TRL's trainer passes.
_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_TRL_ARGS = ("prompts", "completions", "completion_ids")
# A reward's first samples, where its error rate may stop the run.
ERROR_WINDOW = 64
ERROR_MIN_SAMPLES = 8
DUMMY_RESPONSE = "0"
PROBE_TIMEOUT_S = 60.0


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


# ---------------------------------------------------------------- safe calling

_warned: set[tuple[str, str]] = set()


def _warn(warned: set, name: str, kind: str, message: str, prompt_id: Any) -> None:
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
    _warn(_warned, name, type(err).__name__, str(err), getattr(example, "prompt_id", "?"))
    return 0.0, True


@dataclasses.dataclass
class _Fn:
  """One reward function of the rewarder, and its failure counts."""

  spec: str  # what the worker loads: a built-in name or a resolved spec
  label: str  # as the user wrote it (messages)
  name: str  # as logged (reward_fn/<name>)
  weight: float
  params: list
  style: str
  builtin: bool
  calls: int = 0
  fails: int = 0
  last: str = ""

  def found(self) -> str:
    return signature_text(self.name, self.params)


class _Slot:
  """Sample `index` of a batched call (a future of the whole batch's list)."""

  def __init__(self, future, index: int, size: int):
    self.future, self.index, self.size = future, index, size

  def result(self) -> Any:
    out = self.future.result()
    if isinstance(out, usercode.Failure):
      return out
    if isinstance(out, np.ndarray):
      out = out.tolist()
    if not isinstance(out, (list, tuple)) or len(out) != self.size:
      what = f"a list of {len(out)}" if isinstance(out, (list, tuple)) else type(out).__name__
      return usercode.Failure(
          "Garbage", f"returned {what}, not a list of {self.size} numbers (or None)"
      )
    return _Item(out[self.index])


@dataclasses.dataclass(frozen=True)
class _Item:
  value: Any  # one sample's entry of a batched call's list


class _Failed(Exception):

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind, self.message = kind, message


class Rewarder:
  """Scores samples with the task's reward functions, in worker processes.

  `reward` names one function or several, comma-separated (each a built-in,
  `module:function`, `file.py:function` or `file.py`); a sample's reward is
  their `weights`-weighted sum, its correctness the first function's verdict.
  Each function is called as its signature says (`convention`): StreamRL's
  and verl's once per sample, TRL's once per batch of up to `batch_size`
  samples (submitted samples wait until a batch fills or is asked for).

  `submit(samples, examples_by_id)` starts scoring samples as they arrive
  (the pipeline calls it from the thread that receives them); calling the
  rewarder on a chunk waits for those scores (scoring what was not
  submitted). Calling it with `keep=True` (dynamic sampling looks at a
  group's rewards before the trainer does) holds the verdicts for the next
  plain call on the same responses, found by prompt and tokens whatever
  request id the sample has then, so nothing is scored or counted twice. A
  failed call (raised, timed out, garbage) scores 0 from that function,
  counts in `errors` (by kind in `errors_by_kind`) and is logged once per
  function and kind; a function failing on more than `max_error_rate` of its
  first samples (`ERROR_WINDOW`) stops the run with a UserError.

  Args:
    reward: the function name(s).
    tokenizer: decodes responses (`decode(ids)`).
    answer_of: cuts the part the verifier reads out of a decoded response
      (work traces: what follows the last `#`); None: all of it.
    workers: worker processes (0: call in this process, without deadline).
    timeout_s: deadline of one call (a batched call: per sample in it).
    correct_threshold: a score at or above it is correct, unless the
      function says `is_correct`.
    weights: one per function (None: all 1).
    answer_key: the column the answer came from; TRL's functions get it
      among the columns, as TRL passes every column.
    max_error_rate: see above.
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
      weights: tuple[float, ...] | None = None,
      answer_key: str = "answer",
      max_error_rate: float = 0.5,
      batch_size: int = 16,
  ):
    labels = [r.strip() for r in reward.split(",")]
    for label in labels:
      check_reward_name(label)
    weights = tuple(weights) if weights is not None else (1.0,) * len(labels)
    if len(weights) != len(labels):
      raise UserError(
          f"{len(weights)} reward weights for {len(labels)} reward functions ({reward!r}); "
          "give one weight per function."
      )
    self.name = reward
    self.tokenizer = tokenizer
    self.answer_of = answer_of
    self.correct_threshold = correct_threshold
    self.timeout_s = timeout_s
    self.answer_key = answer_key
    self.max_error_rate = max_error_rate
    self.batch_size = batch_size
    self.pool = usercode.WorkerPool(f"{__name__}:in_worker", workers=workers, timeout_s=timeout_s)
    try:
      self.fns = self._load(labels, weights, base_dir)
    except BaseException:
      self.pool.close()
      raise
    self.batched = any(f.style == TRL for f in self.fns)
    self.errors = 0
    self.errors_by_kind: collections.Counter = collections.Counter()
    self._warned: set[tuple[str, str]] = set()
    self._stop: UserError | None = None
    self._pending: collections.OrderedDict = collections.OrderedDict()
    # Submitted samples waiting for a batch to fill: key -> (sample, example).
    self._buffer: collections.OrderedDict = collections.OrderedDict()
    # Verdicts held by `keep=True` calls: (example id, tokens) -> [Score, ...].
    self._held: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._metrics: list[Mapping[str, float]] = []

  def _load(self, labels, weights, base_dir) -> list[_Fn]:
    """Loads each function in a worker (refusing one that cannot be loaded)
    and reads its signature."""
    fns, names = [], collections.Counter()
    for label, weight in zip(labels, weights):
      builtin = not usercode.is_spec(label)
      spec = label if builtin else usercode.resolve_spec(label, base_dir)
      params = self.pool.call_async(("describe", spec, "", {}), {}).result()
      if isinstance(params, usercode.Failure):
        if params.kind == "UserError":
          raise UserError(params.message)
        raise UserError(f"Loading the reward {label!r} failed ({params.kind}: {params.message}).")
      name = label if builtin else usercode.split_spec(spec)[1]
      names[name] += 1
      if names[name] > 1:
        name = f"{name}_{names[name]}"
      fns.append(_Fn(spec, label, name, float(weight), params, convention(params), builtin))
    return fns

  # ------------------------------------------------------------ calling
  def _columns(self, example) -> dict:
    """The columns TRL passes: every one but the prompt (the answer's too)."""
    cols = dict(example.fields or {})
    if self.answer_key and self.answer_key not in cols and "." not in self.answer_key:
      cols[self.answer_key] = example.answer
    return cols

  def _sample_call(self, fn: _Fn, text: str, example, timeout_s: float | None = None):
    payload = {"response": text, "answer": example.answer, "columns": dict(example.fields or {})}
    return self.pool.call_async(("sample", fn.spec, fn.style, payload), {}, timeout_s=timeout_s)

  def _batch_call(self, fn: _Fn, texts: list[str], token_ids: list, examples: list, timeout_s=None):
    chat = [isinstance(ex.prompt, (list, tuple)) for ex in examples]
    prompts = [list(ex.prompt) if c else ex.prompt for ex, c in zip(examples, chat)]
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
    cols = [self._columns(ex) for ex in examples]
    keys = list(dict.fromkeys(k for c in cols for k in c))
    payload = {
        "prompts": prompts,
        "completions": completions,
        "ids": [list(map(int, i)) for i in token_ids],
        "columns": {k: [c.get(k) for c in cols] for k in keys},
    }
    if timeout_s is None and self.timeout_s is not None:
      timeout_s = self.timeout_s * len(examples)
    return self.pool.call_async(("batch", fn.spec, fn.style, payload), {}, timeout_s=timeout_s)

  def _start(self, sample, example) -> list:
    """Starts every function's call on one sample: a future per function."""
    return self._start_many([(sample, example)])[0]

  def _start_all(self, items: list) -> list[list]:
    """`_start_many` when a function takes batches, else one sample at a time."""
    if self.batched:
      return self._start_many(items)
    return [self._start(s, ex) for s, ex in items]

  def _start_many(self, items: list) -> list[list]:
    """Starts every function's calls on [(sample, example)]: per sample for
    StreamRL's and verl's signatures, in batches for TRL's. Returns, per
    item, one future (or batch slot) per function."""
    texts = [self.text(s) for s, _ in items]
    out = [[None] * len(self.fns) for _ in items]
    for j, fn in enumerate(self.fns):
      if fn.style != TRL:
        for i, (_, ex) in enumerate(items):
          out[i][j] = self._sample_call(fn, texts[i], ex)
        continue
      for lo in range(0, len(items), self.batch_size):
        idx = range(lo, min(lo + self.batch_size, len(items)))
        future = self._batch_call(
            fn,
            [texts[i] for i in idx],
            [items[i][0].token_ids for i in idx],
            [items[i][1] for i in idx],
        )
        for k, i in enumerate(idx):
          out[i][j] = _Slot(future, k, len(idx))
    return out

  # ------------------------------------------------------- before the run
  def probe(self, example) -> None:
    """Calls every function once on `example` (a training row) and a dummy
    response, as the run will; a UserError naming the signature tried and
    the one found when the call cannot work (wrong signature, a column the
    rows lack, a result that is no number)."""
    answer = example.answer
    response = answer if isinstance(answer, str) and answer else DUMMY_RESPONSE
    for fn in self.fns:
      tried = f"{fn.style}'s {SIGNATURES[fn.style]}"
      where = f"training row {example.prompt_id}"
      if fn.builtin and not isinstance(answer, str):
        got = "no reference answer" if answer is None else f"a {type(answer).__name__}"
        raise UserError(
            f"The built-in reward {fn.label!r} compares the response with a string reference "
            f"answer, and {where} has {got} (task.answer_key={self.answer_key!r}); point "
            "task.answer_key at a string column or give your own reward function."
        )
      columns = self._columns(example) if fn.style == TRL else dict(example.fields or {})
      missing = missing_arguments(fn.params, fn.style, columns)
      if missing:
        raise UserError(
            f"The reward {fn.label!r} was called as {tried} (its signature is {fn.found()}), "
            f"and that call leaves its parameter(s) {missing} unfilled ({where} has the columns "
            f"{sorted(columns)}); add the column(s), or rename the parameters to one of "
            f"{_ALL_SIGNATURES}."
        )
      # A first call may import what the function needs: it gets a longer deadline.
      timeout = None if self.timeout_s is None else max(self.timeout_s, PROBE_TIMEOUT_S)
      if fn.style == TRL:
        value = self._batch_call(fn, [response], [[]], [example], timeout).result()
        value = _Slot(_Done(value), 0, 1).result()
      else:
        value = self._sample_call(fn, response, example, timeout).result()
      try:
        if isinstance(value, usercode.Failure):
          raise _Failed(value.kind, value.message)
        self._score(value, fn)
      except (_Failed, ValueError) as err:
        why = (
            f"raised {err.kind}: {err.message}" if isinstance(err, _Failed) else str(err)
        ).rstrip(".")
        raise UserError(
            f"The reward {fn.label!r} was called as {tried} (its signature is {fn.found()}) on "
            f"{where} and a dummy response, and it {why}; write it as one of {_ALL_SIGNATURES}."
        ) from None

  def _score(self, value, fn: _Fn) -> Score | None:
    """One function's result for one sample as a Score (None: a TRL function's
    "no reward for this sample"); ValueError when it is no reward."""
    if isinstance(value, _Item):
      if value.value is None:
        return None
      if isinstance(value.value, Mapping):
        raise ValueError("returned a dict in its list, not a number")
      return to_score(value.value, self.correct_threshold)
    return to_score(value, self.correct_threshold)

  # --------------------------------------------------------------- run
  @staticmethod
  def _key(sample, example) -> tuple:
    # The example's own id too: an eval request and a training one share
    # request ids, and two prompts may get the same response.
    return (sample.prompt_id, example.prompt_id, tuple(sample.token_ids))

  def text(self, sample) -> str:
    """What the verifier reads of a sample's response."""
    text = self.tokenizer.decode(sample.token_ids)
    return self.answer_of(text) if self.answer_of is not None else text

  def submit(self, samples, examples_by_id) -> None:
    """Starts scoring `samples` (finished ones) now, or once a batch fills
    when a function takes batches."""
    with self._lock:
      for s in samples:
        example = examples_by_id.get(s.prompt_id)
        if example is None:
          continue
        key = self._key(s, example)
        if key not in self._pending:
          self._buffer[key] = (s, example)
      if len(self._buffer) >= (self.batch_size if self.batched else 1):
        items = list(self._buffer.items())
        self._buffer.clear()
        for (key, _), futures in zip(items, self._start_all([v for _, v in items])):
          self._pending[key] = futures
      # Scores never asked for (a sample dropped by the pipeline) do not pile up.
      for table in (self._pending, self._buffer):
        while len(table) > 65536:
          table.popitem(last=False)

  def scores(self, samples, examples_by_id, *, keep: bool = False) -> list[Score]:
    """The verdict on each sample (waiting for submitted ones); `keep`: also
    held for the next call without it (see the class)."""
    out: list[Score | None] = [None] * len(samples)
    futures, todo = {}, []
    with self._lock:
      for i, s in enumerate(samples):
        example = examples_by_id[s.prompt_id]
        held = self._held.get((example.prompt_id, tuple(s.token_ids)))
        if held:
          out[i] = held[0] if keep else held.pop(0)
          if not held:
            del self._held[(example.prompt_id, tuple(s.token_ids))]
          continue
        key = self._key(s, example)
        f = self._pending.pop(key, None)
        if f is not None:
          futures[i] = f
        else:
          self._buffer.pop(key, None)
          todo.append(i)
      if todo:  # Started together: TRL's functions get them as one batch.
        started = self._start_all(
            [(samples[i], examples_by_id[samples[i].prompt_id]) for i in todo]
        )
        futures.update(zip(todo, started))
    for i, fs in futures.items():
      out[i] = self._verdict(samples[i], [f.result() for f in fs])
    if self._stop is not None:
      raise self._stop
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

  def _verdict(self, sample, results: list) -> Score:
    """The functions' results on one sample as one Score: the weighted sum of
    their rewards (a failure counts and adds 0), the first one's correctness."""
    reward, correct, metrics = 0.0, False, {}
    for j, (fn, result) in enumerate(zip(self.fns, results)):
      try:
        if isinstance(result, usercode.Failure):
          raise _Failed(result.kind, result.message)
        score = self._score(result, fn)
        failed = False
      except (_Failed, ValueError) as err:
        kind, message = (
            (err.kind, err.message) if isinstance(err, _Failed) else ("Garbage", str(err))
        )
        score, failed = None, True
        with self._lock:  # dynamic sampling scores from the generation thread too
          self.errors += 1
          self.errors_by_kind[kind] += 1
          fn.last = f"{kind}: {message}"
        _warn(self._warned, fn.label, kind, message, sample.prompt_id)
      self._count(fn, failed)
      if score is None:
        continue
      reward += fn.weight * score.reward
      metrics.update(score.metrics)
      metrics[fn.name] = score.reward
      if j == 0:
        correct = score.correct
    return Score(reward, correct, metrics)

  def _count(self, fn: _Fn, failed: bool) -> None:
    """Counts a call of `fn`; over its first samples, too many failures stop the run."""
    with self._lock:
      fn.calls += 1
      fn.fails += failed
      if (
          self._stop is None
          and ERROR_MIN_SAMPLES <= fn.calls <= ERROR_WINDOW
          and fn.fails > self.max_error_rate * fn.calls
      ):
        self._stop = UserError(
            f"The reward {fn.label!r} failed on {fn.fails} of its first {fn.calls} samples, "
            f"more than task.max_reward_error_rate={self.max_error_rate} (last: {fn.last}); "
            f"it is called as {fn.style}'s {SIGNATURES[fn.style]} and its signature is "
            f"{fn.found()}: fix the function, or raise task.max_reward_error_rate to train on."
        )

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
    """Means of each function's reward (`reward_fn/<function name>`) and of the
    extra metrics reward functions returned, since the last call, and the
    failure counts by kind (`reward/errors/<kind>`)."""
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


class _Done:
  """A finished future's stand-in (`result()` returns the value)."""

  def __init__(self, value):
    self.value = value

  def result(self):
    return self.value
