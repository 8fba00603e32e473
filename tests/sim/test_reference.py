"""The paper's reference numbers live in the repository (experiments/reference/).

experiments/sim/paper_figures.py is the figure driver behind reproduce_paper.py.
"""

import os

import pytest

from streamrl.scheduling import LatencyProfile

pytestmark = [pytest.mark.unit]

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Every top-level key that reproduce_paper.py, paper_figures.py or the Fig. 7
# curve reads.
KEYS_READ = (
    "fig8_throughput_samples_per_s",
    "table3_ablation_72b_20k_normalized_throughput",
    "fig9_generation_latency_normalized_to_random_fifo",
    "table4_ranker_recall_of_true_long_tail",
    "fig10_allocation",
    "fig11_elastic",
    "fig12_hetero_cost_normalized_samples_per_s",
    "ptl_ms_vs_batch_size_7b_h800_fig7",
)


@pytest.fixture(scope="module")
def figures():
  from experiments.sim import paper_figures  # pylint: disable=g-import-not-at-top

  return paper_figures


def test_default_reference_is_inside_the_repository(figures):
  path = os.path.realpath(figures.find_reference())
  assert path == os.path.realpath(
      os.path.join(ROOT, "experiments", "reference", "streamrl_paper.json")
  )
  ref = figures.load_reference()
  assert all(k in ref for k in KEYS_READ)
  cols = ref["fig8_throughput_samples_per_s"]["_columns"]
  for model in figures.MODEL_GPUS:
    for length in figures.LENGTHS:
      assert len(ref["fig8_throughput_samples_per_s"][model][length]) == len(cols)


def test_missing_reference_says_where_to_find_one(figures, tmp_path):
  with pytest.raises(FileNotFoundError, match="experiments/reference"):
    figures.find_reference(str(tmp_path / "nope.json"))


def test_embedded_fig7_curve_matches_the_reference(figures):
  assert LatencyProfile.from_paper() == LatencyProfile.from_paper(figures.REFERENCE_JSON)


def test_ranker_noise_from_table4(figures):
  # Table 4's top-20 % recall (0.87) needs some noise, but not much.
  sigma = figures.ranker_sigma_from_table4(figures.load_reference())
  assert 0.0 < sigma < 2.0
