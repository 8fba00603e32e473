"""Length distributions and the simulated ranker."""

import numpy as np
import pytest

from streamrl.sim.lengths import EmpiricalLengths, FixedLengths, PaperLengths, from_lengths, paper_lengths
from streamrl.sim.ranker_model import noisy_scores, sigma_for_recall, tail_recall

pytestmark = [pytest.mark.unit]


def test_paper_shape():
  p, o = paper_lengths(20480).sample(np.random.default_rng(0), 20000)
  assert o.max() <= 20480 and o.min() >= 1 and p.max() <= 6144
  hist, edges = np.histogram(o, bins=20, range=(0, 20480))
  assert edges[np.argmax(hist)] < 3000  # peak near 2K
  assert 0.08 < np.mean(o > 12288) < 0.14  # flat tail from ~12K
  assert np.median(p) < 1024  # prompts mostly < 1K
  # 5K is the 20K shape scaled down.
  _, o5 = paper_lengths(5120).sample(np.random.default_rng(0), 20000)
  assert np.mean(o5) == pytest.approx(np.mean(o) / 4, rel=0.01)


def test_empirical_and_fixed():
  d = from_lengths([5, 6, 7], 3)
  p, o = d.sample(np.random.default_rng(0), 100)
  assert set(o.tolist()) <= {5, 6, 7} and set(p.tolist()) == {3}
  assert FixedLengths(2, 9).sample(None, 3)[1].tolist() == [9, 9, 9]


@pytest.mark.parametrize(
    "make",
    [
        lambda: from_lengths([], 3),
        lambda: from_lengths([5, -1], 3),
        lambda: from_lengths([5, 0], 3),
        lambda: FixedLengths(3, -2),
        lambda: PaperLengths(max_output=0),
        lambda: EmpiricalLengths(prompt_lens=(1, 2), output_lens=(3,)),
    ],
)
def test_bad_lengths_are_one_sentence_errors(make):
  with pytest.raises(ValueError) as e:
    make()
  assert e.value.args[0].count(".") >= 1 and "\n" not in e.value.args[0]


def test_ranker_noise_matches_target_recall():
  dist = paper_lengths(20480)
  sigma = sigma_for_recall(0.87, dist)
  _, o = dist.sample(np.random.default_rng(5), 20000)
  rec = tail_recall(o, noisy_scores(o, sigma, np.random.default_rng(6)), 0.2)
  assert rec == pytest.approx(0.87, abs=0.02)
  assert tail_recall(o, noisy_scores(o, 0.0, np.random.default_rng(0)), 0.2) == pytest.approx(
      1.0, abs=0.01
  )
