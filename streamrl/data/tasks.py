"""Synthetic verifiable string tasks: plain answers, or answers after a work trace.

A prompt names an operation and a random lowercase string; the answer is the
operation applied to the string:

  `cpy:abc=` -> `abc`      (copy)
  `rev:abc=` -> `cba`      (reverse)
  `dbl:abc=` -> `aabbcc`   (each character doubled)
  `srt:cab=` -> `abc`      (sorted; harder, not in the default mix)

The length of a correct answer is a function of the prompt (`len(s)` or
`2 * len(s)`), so an output-length ranker has something real to learn, and the
input length is drawn from a discretised log-normal distribution truncated to
the answer budget: most answers are a few characters, a few run to
`max_answer_len`. That is the skew the StreamRL paper is about (Fig. 3): a
handful of long generations hold up a batch of short ones.

For a tiny policy the difficulty grows with length: short strings are easy
to copy or reverse, long ones are not, so a warm-started policy is right on
short prompts and wrong on long ones, and RL has room to improve.

Work traces (`task.kind="trace"`, the run configs' default). Reasoning models
decide how long to work before they answer, so their output length varies
between samples of one prompt, not only between prompts. A trace response
works for a random number of passes before it answers; a pass is as long as
the input (one `.` per character) and is led by the number of passes still
to go:

  `rev:abc=` -> `2...|1...|#cba`   (two passes, then `#` and the answer)
  `rev:abc=` -> `#cba`             (no pass)

The number of passes is drawn once, by the first token (geometric, capped at
`MAX_PASSES` and by the token budget; the mean grows with the input,
`TraceConfig`): harder prompts take longer on average, and every prompt's
length varies between samples. The countdown ends the work where the policy
chose to, so a long trace is a finished one rather than a run-away loop. The
verifier reads only what follows the last `#` (`final_answer`). The warm-up
teaches the policy the trace distribution; RL may then lengthen or shorten
it (with the tiny policy it shortens it: longer traces are answered less
accurately). With the defaults, output lengths have p99/p50 above 8 and the
longest run past 256 tokens (`experiments/diag/workload_stats.py` measures them).

The work unit follows the policy's tokenizer, so that a pass costs one token
per input character under any of them (`work_unit`): `.` for the character
tokenizer, `0` for SentencePiece, which merges runs of dots into a few
pieces but splits digits one per token (the passes' countdown digits never
reach 0, so a unit is never read as a countdown):

  `rev:abc=` -> `2000|1000|#cba`   (the same trace under SentencePiece)

A response then has `passes * (len(input) + 2)` tokens of work under either
tokenizer; the answer's own tokens are the tokenizer's (`answer_tokens` of
`expected_response_length`).

Why filler and not a copy of the input: the tiny policy copies a string of
more than a few characters badly, so copied passes turned into garbage that
ran on (`experiments/diag/workload_stats.py` on the warm-started policy with
copied passes: 2.2 % of samples hit the 320-token limit, and the longest
quarter of samples was right 0.4 % of the time).
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from streamrl.data import tokenizer


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its reference answer.

  `prompt_id` is unique within a dataset; `task` names the operation
  (`cpy`, `rev`, ...) or `file` for a dataset row, whose prompt is text or a
  tuple of chat messages (`{"role": ..., "content": ...}` dicts), and whose
  answer may also be a list or an object (passed to the user's reward as it
  is), or None when the dataset has no reference answer.
  """

  prompt_id: int
  prompt: str
  answer: Any = dataclasses.field(hash=False)
  task: str
  # Mean response length in tokens (EOS included) when the task knows it
  # (work traces: `expected_response_length`); the oracle scheduler's input.
  expected_length: float | None = None
  # A dataset row's other columns, for the reward function (keyword arguments).
  fields: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
  # The row's `data_source` (accuracy is also reported per source).
  source: str | None = None
  # The prompt's token ids when they are not the tokenizer's encoding of
  # `prompt` (a prompt cut to fit the model's context, `loader.fit_prompts`).
  prompt_token_ids: tuple | None = dataclasses.field(default=None, hash=False)


# op name -> (function on the input string, answer length per input char).
_OPS: Mapping[str, tuple[Callable[[str], str], int]] = {
    "cpy": (lambda s: s, 1),
    "rev": (lambda s: s[::-1], 1),
    "dbl": (lambda s: "".join(c + c for c in s), 2),
    "srt": (lambda s: "".join(sorted(s)), 1),
}
KNOWN_OPS = tuple(_OPS)
DEFAULT_OPS = ("cpy", "rev", "dbl")
_SEP, _END = ":", "="


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """Shape of the synthetic task distribution.

  Attributes:
    ops: operations to mix, each drawn with equal probability.
    max_answer_len: longest answer in characters (the EOS token comes on top),
      so generation needs `max_tokens >= max_answer_len + 1`.
    median_len: median of the log-normal input-length distribution before
      truncation.
    sigma: log-normal shape; larger means a heavier tail.
    alphabet_size: the strings use the first `alphabet_size` lowercase
      letters.
  """

  ops: tuple[str, ...] = DEFAULT_OPS
  max_answer_len: int = 48
  median_len: float = 4.0
  sigma: float = 1.0
  alphabet_size: int = 26

  def __post_init__(self):
    # Accept lists from ml_collections configs but keep the dataclass hashable.
    object.__setattr__(self, "ops", tuple(self.ops))
    unknown = [op for op in self.ops if op not in _OPS]
    if not self.ops or unknown:
      raise ValueError(
          f"Unknown task ops {unknown or list(self.ops)}; choose a non-empty "
          f"subset of {list(KNOWN_OPS)}."
      )
    worst = max(_OPS[op][1] for op in self.ops)
    if self.max_answer_len < worst:
      raise ValueError(
          f"max_answer_len={self.max_answer_len} leaves no room for an input "
          f"string with ops {list(self.ops)}; set it to at least {worst}."
      )
    if self.median_len <= 0 or self.sigma <= 0:
      raise ValueError(
          f"median_len={self.median_len} and sigma={self.sigma} must both be " "positive."
      )
    if not 1 <= self.alphabet_size <= 26:
      raise ValueError(f"alphabet_size={self.alphabet_size} must be between 1 and 26.")

  def max_input_len(self, op: str) -> int:
    """Longest input string for `op` whose answer fits `max_answer_len`."""
    return self.max_answer_len // _OPS[op][1]


def solve(op: str, s: str) -> str:
  """Applies operation `op` to string `s` (the reference answer)."""
  if op not in _OPS:
    raise ValueError(f"Unknown task op {op!r}; choose one of {list(KNOWN_OPS)}.")
  return _OPS[op][0](s)


def parse_prompt(prompt: str) -> tuple[str, str]:
  """Splits `op:string=` into `(op, string)`; ValueError if it is not one."""
  if len(prompt) < 5 or prompt[3] != _SEP or not prompt.endswith(_END) or prompt[:3] not in _OPS:
    raise ValueError(f"{prompt!r} is not a synthetic task prompt of the form 'op:string='.")
  return prompt[:3], prompt[4:-1]


def oracle_answer_length(prompt: str) -> int:
  """Exact length of the correct answer to a synthetic prompt, in characters.

  The ideal output-length ranker (the policy adds one EOS token).
  """
  op, s = parse_prompt(prompt)
  return len(s) * _OPS[op][1]


def input_length_pmf(config: TaskConfig, op: str) -> np.ndarray:
  """P(input length = k) for k = 0..max_input_len(op); entry 0 is zero.

  Discretised log-normal: P(k) is proportional to the log-normal mass on
  [k - 1/2, k + 1/2) (from 0 for k = 1), truncated to the answer budget and
  renormalised. Truncation instead of clipping keeps a point mass from
  piling up at the longest length.
  """
  kmax = config.max_input_len(op)
  mu = math.log(config.median_len)

  def cdf(x: float) -> float:
    if x <= 0:
      return 0.0
    z = (math.log(x) - mu) / config.sigma
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

  pmf = np.zeros(kmax + 1)
  for k in range(1, kmax + 1):
    pmf[k] = cdf(k + 0.5) - cdf(k - 0.5 if k > 1 else 0.0)
  total = pmf.sum()
  if total <= 0:  # median far beyond the budget: everything sits at kmax.
    pmf[kmax] = 1.0
    return pmf
  return pmf / total


def answer_length_pmf(config: TaskConfig) -> np.ndarray:
  """P(answer length = L) for L = 0..max_answer_len under the op mixture."""
  pmf = np.zeros(config.max_answer_len + 1)
  for op in config.ops:
    factor = _OPS[op][1]
    in_pmf = input_length_pmf(config, op)
    for k, p in enumerate(in_pmf):
      pmf[k * factor] += p / len(config.ops)
  return pmf


def make_examples(
    n: int,
    seed: int,
    *,
    ops: Sequence[str] = DEFAULT_OPS,
    max_answer_len: int = TaskConfig.max_answer_len,
    median_len: float = TaskConfig.median_len,
    sigma: float = TaskConfig.sigma,
    alphabet_size: int = TaskConfig.alphabet_size,
    first_id: int = 0,
) -> list[Example]:
  """Draws `n` synthetic examples; the same arguments give the same list.

  Args:
    n: number of examples.
    seed: numpy RNG seed.
    ops, max_answer_len, median_len, sigma, alphabet_size: see `TaskConfig`.
    first_id: prompt ids are `first_id .. first_id + n - 1` (use disjoint
      ranges for train and eval sets).

  Returns:
    list of `Example` with `task` set to the op name.
  """
  if n < 0:
    raise ValueError(f"n={n} must be non-negative.")
  config = TaskConfig(
      ops=tuple(ops),
      max_answer_len=max_answer_len,
      median_len=median_len,
      sigma=sigma,
      alphabet_size=alphabet_size,
  )
  rng = np.random.default_rng(seed)
  alphabet = np.array(list(string.ascii_lowercase[: config.alphabet_size]))
  pmfs = {op: input_length_pmf(config, op) for op in config.ops}
  op_idx = rng.integers(len(config.ops), size=n)
  examples = []
  for i in range(n):
    op = config.ops[op_idx[i]]
    length = int(rng.choice(len(pmfs[op]), p=pmfs[op]))
    s = "".join(rng.choice(alphabet, size=length))
    examples.append(
        Example(prompt_id=first_id + i, prompt=f"{op}{_SEP}{s}{_END}", answer=solve(op, s), task=op)
    )
  return examples


def length_stats(lengths: Sequence[int] | np.ndarray) -> dict[str, float]:
  """Summary of a length sample: mean, p50, p90, p99, max, p99_over_p50."""
  arr = np.asarray(lengths, dtype=np.float64)
  if arr.size == 0:
    raise ValueError("length_stats needs at least one length.")
  p50, p90, p99 = np.percentile(arr, [50, 90, 99])
  return {
      "mean": float(arr.mean()),
      "p50": float(p50),
      "p90": float(p90),
      "p99": float(p99),
      "max": float(arr.max()),
      "p99_over_p50": float(p99 / max(p50, 1.0)),
  }


def answer_length_stats(examples: Sequence[Example]) -> dict[str, float]:
  """`length_stats` of the answers' token counts (characters, without EOS)."""
  return length_stats([len(tokenizer.encode(ex.answer)) for ex in examples])


# ------------------------------------------------------------------ traces
PASS_END, WORK_END, WORK = "|", "#", "."
# A pass: the passes left (one digit, so at most 9 passes), one work unit per
# input character, PASS_END.
MAX_PASSES = 9
# Bumped when the text of a trace changes, so a cached warm start taught the
# old text is not reused (2: countdown passes of WORK; 1 copied the input).
# A work unit other than WORK enters the key on its own (`work_unit`).
TRACE_FORMAT = 2
# The work unit per tokenizer kind (`model.tokenizer`): one token per unit.
# SentencePiece (Llama/Mistral's, split_digits) merges `....` into one piece
# but keeps every digit its own token.
WORK_UNITS = {"chars": WORK, "sentencepiece": "0"}


def work_unit(tokenizer_kind: str) -> str:
  """The trace's work unit under `model.tokenizer=tokenizer_kind`."""
  if tokenizer_kind not in WORK_UNITS:
    raise ValueError(
        f"No trace work unit for tokenizer {tokenizer_kind!r}; choose one of {list(WORK_UNITS)}."
    )
  return WORK_UNITS[tokenizer_kind]


@dataclasses.dataclass(frozen=True)
class TraceConfig:
  """How long a work trace runs: `passes` ~ Geometric on {0, 1, ...} with
  mean `base_passes + passes_per_char * len(input)`, capped at `MAX_PASSES`
  and so that the whole response (passes, `#`, answer, EOS) fits
  `max_tokens`."""

  base_passes: float = 0.5
  passes_per_char: float = 0.125
  max_tokens: int = 320

  def __post_init__(self):
    if self.base_passes < 0 or self.passes_per_char < 0:
      raise ValueError(
          f"base_passes={self.base_passes} and passes_per_char={self.passes_per_char} must "
          "be non-negative."
      )
    if self.max_tokens < 2:
      raise ValueError(f"max_tokens={self.max_tokens} leaves no room for `#` and EOS.")

  def stop_probability(self, n: int) -> float:
    """Per-pass stop probability for an input of n characters: the geometric
    with mean `base_passes + passes_per_char * n`."""
    return 1.0 / (1.0 + self.base_passes + self.passes_per_char * n)

  def max_passes(self, s: str, answer: str) -> int:
    """Most passes that fit the token budget (answer, `#` and EOS on top)."""
    fit = (self.max_tokens - len(answer) - 2) // (len(s) + 2)
    return min(max(fit, 0), MAX_PASSES)


def trace_text(s: str, answer: str, passes: int, work: str = WORK) -> str:
  """The response with `passes` passes over `s`: `2...|1...|#cba` (`work`
  the unit: `work_unit`)."""
  return "".join(f"{left}{work * len(s)}{PASS_END}" for left in range(passes, 0, -1)) + (
      WORK_END + answer
  )


def sample_trace(
    s: str, answer: str, rng: np.random.Generator, config: TraceConfig, work: str = WORK
) -> str:
  """One response to a prompt with input `s`: passes, `#`, the answer."""
  stop = config.stop_probability(len(s))
  passes = min(int(rng.geometric(stop)) - 1, config.max_passes(s, answer))
  return trace_text(s, answer, passes, work)


def expected_response_length(
    s: str, answer: str, config: TraceConfig, answer_tokens: int | None = None
) -> float:
  """E[tokens] of a `sample_trace` response, EOS included (exact: the
  truncated geometric's mean). A pass is `len(s) + 2` tokens under every
  tokenizer (`work_unit`); `answer_tokens` is the answer's own count (default
  `len(answer)`, the character tokenizer's; `answer_token_counter` for
  another tokenizer)."""
  stop = config.stop_probability(len(s))
  cap = config.max_passes(s, answer)
  q = 1.0 - stop
  # E[min(K, cap)] for K ~ Geometric(stop) on {0, 1, ...} = sum_{j=1..cap} q^j.
  mean_k = q * (1.0 - q**cap) / stop if stop < 1.0 else 0.0
  n_answer = len(answer) if answer_tokens is None else answer_tokens
  return mean_k * (len(s) + 2) + n_answer + 2


def answer_token_counter(encode: Callable[[str], Sequence[int]]) -> Callable[[str], int]:
  """answer -> its tokens where a trace writes it, after `|#`, under
  `encode` (a tokenizer's text -> ids, no special tokens): what the answer
  adds to the encoding of a pass's end and the `#`."""
  lead = PASS_END + WORK_END
  base = len(encode(lead))
  return lambda answer: len(encode(lead + answer)) - base


def final_answer(response: str) -> str:
  """What a trace response answers: the text after its last `#` ("" when it
  never finished its work)."""
  cut = response.rfind(WORK_END)
  return response[cut + 1 :].strip() if cut >= 0 else ""


def add_traces(
    examples: Sequence[Example],
    config: TraceConfig,
    answer_tokens: Callable[[str], int] | None = None,
) -> list[Example]:
  """The same examples as trace prompts: same prompt and answer, task
  `trace-<op>`, and their expected response length (the answer counted by
  `answer_tokens`, default its characters: `expected_response_length`)."""
  out = []
  for ex in examples:
    _, s = parse_prompt(ex.prompt)
    n_answer = None if answer_tokens is None else answer_tokens(ex.answer)
    out.append(
        dataclasses.replace(
            ex,
            task=f"trace-{ex.task}",
            expected_length=expected_response_length(s, ex.answer, config, n_answer),
        )
    )
  return out


def sft_target(
    example: Example, rng: np.random.Generator, config: TraceConfig | None, work: str = WORK
) -> str:
  """The warm-up's target response: the answer, or (trace tasks) a sampled
  trace of `work` units (`work_unit`)."""
  if config is None or not example.task.startswith("trace-"):
    return example.answer
  _, s = parse_prompt(example.prompt)
  return sample_trace(s, example.answer, rng, config, work)
