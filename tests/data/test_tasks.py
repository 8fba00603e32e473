"""Synthetic tasks: determinism, correctness per op, long-tailed lengths."""

import numpy as np
import pytest

from streamrl.data import tasks
from streamrl.data import tokenizer

pytestmark = [pytest.mark.unit]


def test_deterministic_under_seed():
  a = tasks.make_examples(300, seed=7)
  b = tasks.make_examples(300, seed=7)
  c = tasks.make_examples(300, seed=8)
  assert a == b
  assert a != c
  assert [ex.prompt_id for ex in a] == list(range(300))
  shifted = tasks.make_examples(5, seed=7, first_id=1000)
  assert [ex.prompt_id for ex in shifted] == list(range(1000, 1005))


@pytest.mark.parametrize(
    "op,s,want",
    [
        ("cpy", "abc", "abc"),
        ("rev", "abc", "cba"),
        ("dbl", "abc", "aabbcc"),
        ("srt", "cab", "abc"),
    ],
)
def test_solve(op, s, want):
  assert tasks.solve(op, s) == want


def test_answers_follow_the_prompt_for_every_op():
  examples = tasks.make_examples(400, seed=3, ops=tasks.KNOWN_OPS)
  assert {ex.task for ex in examples} == set(tasks.KNOWN_OPS)
  for ex in examples:
    op, s = tasks.parse_prompt(ex.prompt)
    assert op == ex.task
    assert ex.prompt == f"{op}:{s}="
    assert s and s.isalpha() and s.islower()
    if op == "cpy":
      assert ex.answer == s
    elif op == "rev":
      assert ex.answer == "".join(reversed(s))
    elif op == "dbl":
      assert ex.answer[::2] == s and ex.answer[1::2] == s
    elif op == "srt":
      assert list(ex.answer) == sorted(s)
    # Length is a function of the prompt alone.
    assert tasks.oracle_answer_length(ex.prompt) == len(ex.answer)


def test_prompts_are_short_and_in_vocab():
  examples = tasks.make_examples(2000, seed=0)
  assert max(len(ex.prompt) for ex in examples) <= 70
  for ex in examples:
    tokenizer.encode(ex.prompt)  # raises on an out-of-vocab character
    assert len(ex.answer) <= 48


def test_answer_lengths_are_heavy_tailed():
  stats = tasks.answer_length_stats(tasks.make_examples(5000, seed=0))
  assert stats["p50"] <= 8
  assert stats["p99_over_p50"] >= 4
  assert stats["max"] >= 40


def test_length_pmf_matches_samples():
  config = tasks.TaskConfig()
  pmf = tasks.answer_length_pmf(config)
  assert pmf.shape == (config.max_answer_len + 1,)
  assert pmf.sum() == pytest.approx(1.0)
  assert pmf[0] == 0.0
  lengths = [len(ex.answer) for ex in tasks.make_examples(5000, seed=4)]
  expected_mean = float((pmf * np.arange(len(pmf))).sum())
  assert np.mean(lengths) == pytest.approx(expected_mean, rel=0.08)


def test_options_change_the_distribution():
  short = tasks.make_examples(500, seed=0, max_answer_len=8, ops=["rev"], alphabet_size=3)
  assert max(len(ex.answer) for ex in short) <= 8
  assert set("".join(ex.answer for ex in short)) <= set("abc")
  wide = tasks.make_examples(2000, seed=0, sigma=1.5)
  narrow = tasks.make_examples(2000, seed=0, sigma=0.3)
  assert (
      tasks.answer_length_stats(wide)["p99_over_p50"]
      > tasks.answer_length_stats(narrow)["p99_over_p50"]
  )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"ops": ["add"]}, "add"),
        ({"ops": []}, "non-empty"),
        ({"ops": ["dbl"], "max_answer_len": 1}, "max_answer_len"),
        ({"sigma": 0.0}, "sigma"),
        ({"alphabet_size": 27}, "alphabet_size"),
    ],
)
def test_bad_config_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tasks.make_examples(3, seed=0, **kwargs)


def test_parse_prompt_rejects_other_text():
  with pytest.raises(ValueError, match="op:string="):
    tasks.parse_prompt("what is 2+2?")


# ------------------------------------------------------------------ traces


def test_a_trace_counts_down_its_passes_then_answers():
  cfg = tasks.TraceConfig(base_passes=1.0, passes_per_char=0.0, max_tokens=64)
  rng = np.random.default_rng(0)
  seen = set()
  for _ in range(200):
    t = tasks.sample_trace("abc", "cba", rng, cfg)
    work, answer = t.rsplit("#", 1)
    assert answer == "cba" and tasks.final_answer(t) == "cba"
    k = len(work) // 5
    # Each pass is led by the passes still to go: a countdown to the answer.
    assert work == "".join(f"{j}...|" for j in range(k, 0, -1))
    seen.add(k)
  assert {0, 1, 2, 3} <= seen  # Geometric: the number of passes varies.
  assert max(seen) <= tasks.MAX_PASSES


def test_trace_lengths_match_their_expectation_and_fit_the_budget():
  cfg = tasks.TraceConfig(base_passes=0.5, passes_per_char=0.25, max_tokens=40)
  rng = np.random.default_rng(1)
  for s in ("ab", "abcdefgh", "abcdefghijklmnopqrstuvwxyz"):
    lens = [len(tasks.sample_trace(s, s, rng, cfg)) + 1 for _ in range(4000)]  # + EOS
    assert max(lens) <= cfg.max_tokens
    assert np.mean(lens) == pytest.approx(tasks.expected_response_length(s, s, cfg), rel=0.05)


def test_the_default_trace_workload_is_long_tailed_across_and_within_prompts():
  """The issue's shape targets on the trace distribution the warm-up teaches."""
  cfg = tasks.TraceConfig()
  rng = np.random.default_rng(2)
  lens, cvs = [], []
  for ex in tasks.make_examples(1000, seed=3):
    _, s = tasks.parse_prompt(ex.prompt)
    group = [len(tasks.sample_trace(s, ex.answer, rng, cfg)) + 1 for _ in range(8)]
    lens += group
    cvs.append(np.std(group) / np.mean(group))
  stats = tasks.length_stats(lens)
  assert stats["p99_over_p50"] >= 8 and stats["max"] >= 256
  assert np.median(cvs) >= 0.3


def test_final_answer_reads_after_the_last_mark_only():
  assert tasks.final_answer("ab|ab|#ba") == "ba"
  assert tasks.final_answer("#x#ba ") == "ba"
  assert tasks.final_answer("ab|ab|ba") == ""  # Never finished its work.


def test_trace_examples_carry_their_expected_length():
  cfg = tasks.TraceConfig()
  (ex,) = tasks.add_traces(tasks.make_examples(1, seed=0), cfg)
  _, s = tasks.parse_prompt(ex.prompt)
  assert ex.task.startswith("trace-")
  assert ex.expected_length == tasks.expected_response_length(s, ex.answer, cfg)
  assert tasks.sft_target(ex, np.random.default_rng(0), cfg).endswith("#" + ex.answer)


def test_the_work_unit_follows_the_tokenizer_and_the_character_text_stays():
  assert tasks.trace_text("abc", "cba", 2) == "2...|1...|#cba"
  assert tasks.work_unit("chars") == tasks.WORK
  unit = tasks.work_unit("sentencepiece")
  assert tasks.trace_text("abc", "cba", 2, unit) == "2000|1000|#cba"
  cfg = tasks.TraceConfig(base_passes=1.0, passes_per_char=0.0, max_tokens=64)
  a, b = np.random.default_rng(0), np.random.default_rng(0)
  for _ in range(20):
    dots, zeros = tasks.sample_trace("ab", "ba", a, cfg), tasks.sample_trace(
        "ab", "ba", b, cfg, unit
    )
    assert zeros == dots.replace(".", unit)
  with pytest.raises(ValueError, match="work unit"):
    tasks.work_unit("bytes")


def test_expected_length_counts_the_answer_in_the_tokenizers_tokens():
  cfg = tasks.TraceConfig()
  s = "abcdef"
  chars = tasks.expected_response_length(s, s, cfg)
  # An answer of 2 tokens where the characters are 6: 4 tokens fewer.
  assert tasks.expected_response_length(s, s, cfg, answer_tokens=2) == pytest.approx(chars - 4)
  # The character tokenizer's count of what an answer adds after `|#`.
  count = tasks.answer_token_counter(list)
  assert count("abc") == 3 and count("") == 0
  (ex,) = tasks.add_traces(tasks.make_examples(1, seed=0), cfg, answer_tokens=lambda a: 1)
  _, s = tasks.parse_prompt(ex.prompt)
  assert ex.expected_length == tasks.expected_response_length(s, ex.answer, cfg, 1)
