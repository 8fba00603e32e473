"""The built-in reward functions (verifiers) and their registry."""

import pytest

from streamrl.data import verifiers

pytestmark = [pytest.mark.unit]


def test_exact_match():
  assert verifiers.exact_match("abc", "abc") == 1.0
  assert verifiers.exact_match(" abc\n", "abc") == 1.0
  assert verifiers.exact_match("abd", "abc") == 0.0
  assert verifiers.exact_match("abcc", "abc") == 0.0
  assert verifiers.exact_match("", "abc") == 0.0


def test_partial_match():
  assert verifiers.partial_match("abcd", "abcd") == 1.0
  assert verifiers.partial_match("abxd", "abcd") == pytest.approx(0.5 * 3 / 4)
  # Junk after a correct prefix is penalised through the longer denominator.
  assert verifiers.partial_match("abcdxxxx", "abcd") == pytest.approx(0.5 * 4 / 8)
  assert verifiers.partial_match("", "abcd") == 0.0
  assert verifiers.partial_match("zzzz", "abcd") == 0.0
  fn = verifiers.get_reward_fn("partial_match", partial_weight=0.2)
  assert fn("abxd", "abcd") == pytest.approx(0.2 * 3 / 4)
  # A miss never reaches the reward of a hit.
  assert verifiers.partial_match("abcde", "abcd") < 0.5


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
        ("\\boxed{(1,2)}", "(1,2)", 1.0),
        ("\\boxed{(1,2)}", "(12)", 0.0),
        ("the answer is 5, done", "5", 1.0),
        ("$1,234.50", "1234.5", 1.0),
    ],
)
def test_both_math_verifiers(response, answer, want):
  assert verifiers.math_verify(response, answer) == want
  assert verifiers.math_verify_light(response, answer) == want


@pytest.mark.parametrize(
    "response,answer,package,light",
    [
        # The bug report: boxed response vs a raw GSM8K answer.
        ("... The answer is \\boxed{72}.", "6*12=72 #### 72", 1.0, 1.0),
        # Equivalences only the package knows.
        ("so $\\sqrt 2$", "\\sqrt{2}", 1.0, 0.0),
        ("\\boxed{x=5}", "5", 1.0, 0.0),
        ("\\boxed{0.5}", "\\frac12", 1.0, 0.0),
        ("\\boxed{10^{3}}", "1000", 1.0, 0.0),
        # A box the response never closed (cut at max_tokens) is no answer to
        # the package; the light one falls back to the last number.
        ("cut off \\boxed{7", "7", 0.0, 1.0),
    ],
)
def test_math_verify_uses_the_package(response, answer, package, light):
  assert verifiers.math_verify(response, answer) == package
  assert verifiers.math_verify_light(response, answer) == light


def test_registry_and_unknown_name():
  for name in ("exact_match", "partial_match", "math_verify", "math_verify_light"):
    assert name in verifiers.known_reward_fns()
    assert verifiers.get_reward_fn(name)("7", "7") == 1.0
  with pytest.raises(ValueError, match="exact_match") as err:
    verifiers.get_reward_fn("exact")
  assert "'exact'" in str(err.value)
