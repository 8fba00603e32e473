"""Reward functions, the registry and safe_reward."""

import logging

import numpy as np
import pytest

from streamrl.data import rewards
from streamrl.data.tasks import Example


def _ex(answer):
  return Example(prompt_id=5, prompt="q", answer=answer, task="t")


def test_exact_match():
  assert rewards.exact_match("abc", "abc") == 1.0
  assert rewards.exact_match(" abc\n", "abc") == 1.0
  assert rewards.exact_match("abd", "abc") == 0.0
  assert rewards.exact_match("abcc", "abc") == 0.0
  assert rewards.exact_match("", "abc") == 0.0


def test_partial_match():
  assert rewards.partial_match("abcd", "abcd") == 1.0
  assert rewards.partial_match("abxd", "abcd") == pytest.approx(0.5 * 3 / 4)
  # Junk after a correct prefix is penalised through the longer denominator.
  assert rewards.partial_match("abcdxxxx", "abcd") == pytest.approx(0.5 * 4 / 8)
  assert rewards.partial_match("", "abcd") == 0.0
  assert rewards.partial_match("zzzz", "abcd") == 0.0
  fn = rewards.get_reward_fn("partial_match", partial_weight=0.2)
  assert fn("abxd", "abcd") == pytest.approx(0.2 * 3 / 4)
  # A miss never reaches the reward of a hit.
  assert rewards.partial_match("abcde", "abcd") < 0.5


@pytest.mark.parametrize(
    "response,answer,want",
    [
        ("so the answer is \\boxed{72}.", "72", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("The total is 1000.0 dollars", "#### 1,000", 1.0),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72", 1.0),
        ("x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
        ("It is 3/4", "0.75", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
        ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{71}", "72", 0.0),
        ("first 72 then 73", "72", 0.0),
        ("no number here", "72", 0.0),
        ("cut off \\boxed{7", "7", 1.0),  # unbalanced box: falls back to numbers
        ("\\boxed{(1,2)}", "(1,2)", 1.0),
        ("\\boxed{(1,2)}", "(12)", 0.0),
        ("the answer is 5, done", "5", 1.0),
        ("$1,234.50", "1234.5", 1.0),
    ],
)
def test_math_verify(response, answer, want):
  assert rewards.math_verify(response, answer) == want


def test_registry_and_unknown_name():
  for name in ("exact_match", "partial_match", "math_verify"):
    assert name in rewards.known_reward_fns()
    assert rewards.get_reward_fn(name)("7", "7") == 1.0
  with pytest.raises(ValueError, match="exact_match") as err:
    rewards.get_reward_fn("exact")
  assert "'exact'" in str(err.value)


def test_safe_reward_passes_values_through():
  assert rewards.safe_reward(rewards.exact_match, "ab", _ex("ab")) == (1.0, False)
  assert rewards.safe_reward(rewards.exact_match, "a", _ex("ab")) == (0.0, False)


def test_safe_reward_catches_and_warns_once_per_error_type(caplog):
  def boom(response, answer):
    raise RuntimeError("verifier crashed")

  def nan(response, answer):
    return float("nan")

  def wrong_type(response, answer):
    return "high"

  caplog.set_level(logging.WARNING, logger=rewards.__name__)
  rewards._warned.clear()
  results = [rewards.safe_reward(boom, "x", _ex("y")) for _ in range(3)]
  assert results == [(0.0, True)] * 3
  assert rewards.safe_reward(nan, "x", _ex("y")) == (0.0, True)
  assert rewards.safe_reward(wrong_type, "x", _ex("y")) == (0.0, True)
  messages = [r.getMessage() for r in caplog.records]
  assert sum("RuntimeError" in m for m in messages) == 1
  assert any("verifier crashed" in m and "boom" in m for m in messages)
  # nan and a non-number are ValueErrors: one more warning for that kind.
  assert sum("ValueError" in m for m in messages) == 1
  assert len(messages) == 2


def test_the_rewarder_scores_what_answer_of_cuts():
  """Work traces: the verifier and the correctness read the final answer only."""
  from streamrl.data import tasks
  from streamrl.data.rewards import Rewarder

  class Chars:

    def decode(self, ids):
      return "".join(map(chr, ids))

  class S:

    def __init__(self, text):
      self.prompt_id, self.token_ids = 0, [ord(c) for c in text]

  ex = tasks.Example(0, "rev:ab=", "ba", "trace-rev")
  rw = Rewarder(rewards.get_reward_fn("partial_match"), Chars(), tasks.final_answer)
  score, correct = rw([S("ab|ab|#ba"), S("ab|ba"), S("#bx")], {0: ex})
  np.testing.assert_allclose(score, [1.0, 0.0, 0.25])
  np.testing.assert_allclose(correct, [1.0, 0.0, 0.0])
