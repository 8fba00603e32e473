"""safe_reward and the Rewarder: scores in worker processes, failures counted, never raised."""

import logging

import numpy as np
import pytest

from streamrl.data import reward_conventions, rewards, verifiers
from streamrl.data.tasks import Example

pytestmark = [pytest.mark.unit]


def _ex(answer):
  return Example(prompt_id=5, prompt="q", answer=answer, task="t")


def test_safe_reward_passes_values_through():
  assert reward_conventions.safe_reward(verifiers.exact_match, "ab", _ex("ab")) == (1.0, False)
  assert reward_conventions.safe_reward(verifiers.exact_match, "a", _ex("ab")) == (0.0, False)


def test_safe_reward_catches_and_warns_once_per_function_and_error_type(caplog):
  def boom(response, answer):
    raise RuntimeError("verifier crashed")

  def nan(response, answer):
    return float("nan")

  def wrong_type(response, answer):
    return "high"

  caplog.set_level(logging.WARNING, logger=reward_conventions.__name__)
  reward_conventions._warned.clear()
  results = [reward_conventions.safe_reward(boom, "x", _ex("y")) for _ in range(3)]
  assert results == [(0.0, True)] * 3
  assert reward_conventions.safe_reward(nan, "x", _ex("y")) == (0.0, True)
  assert reward_conventions.safe_reward(wrong_type, "x", _ex("y")) == (0.0, True)
  messages = [r.getMessage() for r in caplog.records]
  assert sum("RuntimeError" in m for m in messages) == 1
  assert any("verifier crashed" in m and "boom" in m for m in messages)
  # nan and a non-number are both ValueErrors, but of two functions: each warns once.
  assert sum("ValueError" in m for m in messages) == 2
  assert len(messages) == 3


class _Chars:

  def decode(self, ids):
    return "".join(map(chr, ids))


class _S:

  def __init__(self, text, prompt_id=0):
    self.prompt_id, self.token_ids = prompt_id, tuple(ord(c) for c in text)


def test_the_rewarder_scores_what_answer_of_cuts():
  """Work traces: the verifier and the correctness read the final answer only."""
  from streamrl.data import tasks

  ex = tasks.Example(0, "rev:ab=", "ba", "trace-rev")
  with rewards.Rewarder("partial_match", _Chars(), tasks.final_answer, workers=0) as rw:
    score, correct = rw([_S("ab|ab|#ba"), _S("ab|ba"), _S("#bx")], {0: ex})
  np.testing.assert_allclose(score, [1.0, 0.0, 0.25])
  np.testing.assert_allclose(correct, [1.0, 0.0, 0.0])


def test_accuracy_follows_the_verifier_not_the_answer_string():
  """The reported bug: math_verify scores the boxed response 1 against a raw
  GSM8K answer; the accuracy is 1 with it (it compared strings before)."""
  ex = Example(0, "q", "6*12=72 #### 72", "file")
  with rewards.Rewarder("math_verify", _Chars(), str.strip, workers=1) as rw:
    score, correct = rw([_S("... The answer is \\boxed{72}."), _S("\\boxed{71}")], {0: ex})
  np.testing.assert_array_equal(score, [1.0, 0.0])
  np.testing.assert_array_equal(correct, [1.0, 0.0])


def test_a_users_reward_reads_columns_and_its_verdicts_are_kept(tmp_path):
  """`file.py:function` with an extra column; is_correct wins over the score;
  extra numbers are logged; raising, hanging and garbage cost one sample each."""
  (tmp_path / "rw.py").write_text(
      "import time\n"
      "def score(response, answer, weight, **rest):\n"
      "  if response == 'hang':\n"
      "    time.sleep(600)\n"
      "  if response == 'raise':\n"
      "    raise KeyError('no such key')\n"
      "  if response == 'junk':\n"
      "    return {'points': 3}\n"
      "  return {'score': weight * (response == answer), 'is_correct': response == answer,\n"
      "          'n_rest': len(rest)}\n"
  )
  ex = Example(0, "q", "ab", "file", fields={"weight": 0.5, "data_source": "gsm"})
  texts = ["ab", "hang", "raise", "junk", "zz", "hang"]
  with rewards.Rewarder(
      f"{tmp_path / 'rw.py'}:score", _Chars(), workers=2, timeout_s=0.5, correct_threshold=0.1
  ) as rw:
    rw.submit([_S(t, 0) for t in texts[:2]], {0: ex})  # Started as they arrive.
    score, correct = rw([_S(t, 0) for t in texts], {0: ex})
    metrics = rw.metrics()
  # 0.5 >= correct_threshold, but is_correct says so anyway; "zz" scores 0.
  np.testing.assert_allclose(score, [0.5, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(correct, [1, 0, 0, 0, 0, 0])
  assert rw.errors == 4
  assert dict(rw.errors_by_kind) == {"Timeout": 2, "KeyError": 1, "Garbage": 1}
  assert metrics["reward_fn/n_rest"] == 1.0  # data_source reached **rest.
  assert metrics["reward/errors/Timeout"] == 2.0


def test_an_unloadable_reward_is_refused_before_the_run(tmp_path):
  from streamrl.errors import UserError

  with pytest.raises(UserError, match="does not exist"):
    rewards.Rewarder(f"{tmp_path}/none.py:score", _Chars())
  (tmp_path / "m.py").write_text("x = 1\n")
  with pytest.raises(UserError, match="has no function 'score'"):
    rewards.Rewarder(f"{tmp_path}/m.py:score", _Chars())
  with pytest.raises(ValueError, match="unknown"):
    rewards.Rewarder("exactmatch", _Chars())


def test_a_pending_score_is_never_given_to_another_prompts_sample():
  """Async runs submit the next round's samples before an eval whose
  requests reuse the same ids: the same response to another prompt is
  scored against its own answer."""
  train_ex, eval_ex = Example(0, "q", "ab", "file"), Example(10**6, "p", "zz", "file")
  with rewards.Rewarder("exact_match", _Chars(), workers=0) as rw:
    rw.submit([_S("ab", 0)], {0: train_ex})
    assert rw(([_S("ab", 0)]), {0: eval_ex})[0].tolist() == [0.0]
    assert rw(([_S("ab", 0)]), {0: train_ex})[0].tolist() == [1.0]
