"""Scoring samples with the task's reward functions, in worker processes (`Rewarder`).

`task.reward` is a built-in name or a function the user wrote,
`package.module:function`, `path/to/file.py:function` or `path/to/file.py`
(its `compute_score`); several, comma-separated, are summed with
`task.reward_weights`. A user's function is called the way the framework it
was written for calls it, recognised by its parameter names
(`reward_conventions.py`: StreamRL's, verl's or TRL's signature). The built-in
names and what a function may return are in `verifiers.py`.

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
import threading
from typing import Any, Callable, Mapping

import numpy as np

from streamrl import usercode
from streamrl.data import reward_conventions
from streamrl.data.reward_conventions import (
    ALL_SIGNATURES,
    SIGNATURES,
    TRL,
    convention,
    missing_arguments,
    signature_text,
    warn_failure,
)
from streamrl.data.verifiers import Score, check_reward_name, to_score
from streamrl.errors import UserError

# A reward's first samples, where its error rate may stop the run.
ERROR_WINDOW = 64
ERROR_MIN_SAMPLES = 8
DUMMY_RESPONSE = "0"
PROBE_TIMEOUT_S = 60.0


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
    self.pool = usercode.WorkerPool(
        f"{reward_conventions.__name__}:in_worker", workers=workers, timeout_s=timeout_s
    )
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
            f"{ALL_SIGNATURES}."
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
            f"{where} and a dummy response, and it {why}; write it as one of {ALL_SIGNATURES}."
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
        warn_failure(self._warned, fn.label, kind, message, sample.prompt_id)
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
