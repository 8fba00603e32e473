"""The length predictor's sources: a prompt's own history (bounded, restored
from a checkpoint), finished siblings, the ranker, their combination, and the
per-source metrics the scheduler logs every round."""

import json
import types

import numpy as np
import pytest

from streamrl.data import tasks, tokenizer
from streamrl.ranker.metrics import recall_at_top, spearman
from streamrl.scheduling.config import Scheduler
from streamrl.scheduling.lengths import (
    MIN_METRIC_REQUESTS,
    LengthHistory,
    combine,
    rank_lengths,
    sibling_estimates,
    source_metrics,
)
from streamrl.scheduling.scheduler import GenerationScheduler

pytestmark = [pytest.mark.unit]


def test_combine_is_the_mean_of_every_length_known_with_the_ranker_weighted():
  assert combine(100.0) == 100.0  # an unseen prompt: the ranker's
  assert combine(100.0, [10, 20, 30]) == pytest.approx((100 + 60) / 4)
  assert combine(100.0, [10, 20, 30], [50]) == pytest.approx((100 + 60 + 50) / 5)
  assert combine(100.0, (), [50], ranker_weight=3.0) == pytest.approx((300 + 50) / 4)
  # The more a prompt's history holds, the less the ranker moves it.
  assert abs(combine(100.0, [10] * 8) - 10) < abs(combine(100.0, [10]) - 10)


def test_the_history_keeps_the_newest_lengths_of_the_most_recently_seen_prompts():
  h = LengthHistory(per_prompt=2, max_prompts=2)
  for pid, n in [(1, 10), (1, 11), (1, 12), (2, 20), (1, 13), (3, 30)]:
    h.add(pid, n)
  assert h.get(1) == (12, 13) and h.get(3) == (30,)
  assert 2 not in h and h.get(2) == () and len(h) == 2  # 2 was seen least recently
  with pytest.raises(ValueError, match="keeps"):
    LengthHistory(per_prompt=0)


def test_the_history_restores_from_its_json_state_within_its_own_bounds():
  h = LengthHistory(per_prompt=3)
  for k in range(20):
    h.add(k % 5, 100 + k)
  state = json.loads(json.dumps(h.get_state()))
  again = LengthHistory(per_prompt=3)
  again.set_state(state)
  assert again.get_state() == h.get_state()
  small = LengthHistory(per_prompt=1, max_prompts=2)
  small.set_state(state)
  assert [small.get(k) for k in range(5)] == [(), (), (), (118,), (119,)]


def test_rank_lengths_read_scores_as_the_recent_lengths_at_their_rank():
  from streamrl.scheduling.dispatch import calibrated_lengths

  rng = np.random.default_rng(0)
  for p in (1, 7, 128):
    scores = np.round(rng.normal(size=p), 1)  # ties too
    recent = rng.geometric(1 / 50, size=int(rng.integers(1, 2000))).astype(float)
    np.testing.assert_allclose(
        rank_lengths(scores, recent), calibrated_lengths(scores, recent), rtol=1e-12
    )


def test_sibling_estimates_are_the_lengths_of_the_group_finished_before():
  groups, lengths = ["a", "b", "a", "a", "b"], [5, 7, 9, 11, 13]
  assert sibling_estimates(groups, lengths) == [(), (), (5.0,), (5.0, 9.0), (7.0,)]


def test_source_metrics_score_each_source_on_the_requests_it_knew():
  rng = np.random.default_rng(0)
  true = rng.integers(1, 500, size=60).astype(float)
  noisy = true + rng.normal(0, 200, size=60)
  partial = [t if k % 2 else None for k, t in enumerate(true)]  # knows half
  few = [1.0] * (MIN_METRIC_REQUESTS - 1) + [None] * (60 - MIN_METRIC_REQUESTS + 1)
  m = source_metrics({"ranker": noisy, "history": partial, "siblings": few}, true)
  assert m["recall_at_20/ranker"] == recall_at_top(noisy, true, 0.2)
  assert m["spearman/ranker"] == pytest.approx(spearman(noisy, true))
  assert m["recall_at_20/history"] == 1.0 and m["spearman/history"] == pytest.approx(1.0)
  assert m["coverage/history"] == 0.5 and m["coverage/ranker"] == 1.0
  assert "recall_at_20/siblings" not in m and m["coverage/siblings"] < MIN_METRIC_REQUESTS / 60
  with pytest.raises(ValueError, match="one each"):
    source_metrics({"ranker": [1.0]}, true)


# ------------------------------------------------------------- in the scheduler
PROMPTS, GROUP = 8, 4


def _scheduler(model_dir, **kw):
  """A skew scheduler whose ranker scores a prompt by its length (a poor
  predictor here: the true lengths below run the other way)."""
  gs = GenerationScheduler(
      Scheduler(kind="skew", **kw),
      model_dir=model_dir,
      workdir=None,
      num_instances=2,
      max_batch_size=4,
  )
  gs.ranker.predict = lambda prompts: np.asarray([float(len(p)) for p in prompts])
  gs.ranker.update = lambda pairs: {}
  return gs


def _epoch(examples, first_id):
  """One round over every prompt: requests, examples by request id, and the
  samples as generated (prompt k's responses run about 40 * (PROMPTS - k) tokens)."""
  reqs, by_id, samples = [], {}, []
  for k, ex in enumerate(examples):
    ids = (tokenizer.BOS_ID,) + (5,) * (k + 1)  # longer prompts, shorter responses
    for s in range(GROUP):
      rid = first_id + k * GROUP + s
      reqs.append((rid, ids))
      by_id[rid] = ex
      n = 40 * (PROMPTS - k) + s
      samples.append(types.SimpleNamespace(prompt_id=rid, prompt_token_ids=ids, token_ids=[7] * n))
  return reqs, by_id, samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("tok"))
  tokenizer.save_hf_tokenizer(path)
  return path


def test_a_prompts_history_reorders_its_next_epoch_and_each_source_is_scored(model_dir):
  examples = tasks.make_examples(PROMPTS, 0)
  gs, plain = _scheduler(model_dir), _scheduler(model_dir, prompt_lengths=0)
  for s in (gs, plain):
    s.recent.extend(range(1, 400, 3))
  reqs, by_id, samples = _epoch(examples, 0)
  # Epoch 1: no prompt was seen, so the plan is the ranker's alone.
  assert gs.plan(reqs, by_id, seed=0) == plain.plan(reqs, by_id, seed=0)
  first = gs.observe(samples)
  plain.observe(samples)
  assert first["ranker/coverage/history"] == 0.0 and "ranker/recall_at_20/history" not in first
  assert first["ranker/spearman/ranker"] < 0  # the ranker has it backwards
  assert first["ranker/spearman/siblings"] > 0.9  # the group's finished samples know better
  assert gs.history.get(examples[0].prompt_id) == tuple(40 * PROMPTS + s for s in range(GROUP))
  # Epoch 2: the same prompts under new request ids; their history leads.
  reqs, by_id, samples = _epoch(examples, 1000)
  gs.plan(reqs, by_id, seed=1)
  longest = max(gs.estimates, key=gs.estimates.get)
  assert by_id[longest].prompt_id == examples[0].prompt_id
  plain.plan(reqs, by_id, seed=1)
  assert by_id[max(plain.estimates, key=plain.estimates.get)].prompt_id == examples[-1].prompt_id
  m = gs.observe(samples)
  for source in ("ranker", "history", "siblings", "combined"):
    assert f"ranker/recall_at_20/{source}" in m and f"ranker/spearman/{source}" in m
  assert m["ranker/coverage/history"] == 1.0 and m["ranker/spearman/history"] > 0.9
  assert m["ranker/recall_at_20/history"] > m["ranker/recall_at_20/ranker"]
  assert m["ranker/spearman/combined"] > 0.9 > m["ranker/spearman/ranker"]


def test_the_history_survives_a_checkpoint_and_plans_the_same_after_it(model_dir):
  examples = tasks.make_examples(PROMPTS, 1)
  gs = _scheduler(model_dir)
  gs.recent.extend(range(1, 400, 3))
  reqs, by_id, samples = _epoch(examples, 0)
  gs.plan(reqs, by_id, seed=0)
  gs.observe(samples)
  state = json.loads(json.dumps(gs.get_state()))  # what the checkpoint's meta holds
  resumed = _scheduler(model_dir)
  resumed.set_state(state)
  resumed.recent.extend(gs.recent)
  assert resumed.history.get_state() == gs.history.get_state()
  reqs, by_id, _ = _epoch(examples, 1000)
  assert resumed.plan(reqs, by_id, seed=1) == gs.plan(reqs, by_id, seed=1)
  resumed.set_state(None)  # a checkpoint from before the history: nothing to take
  assert _scheduler(model_dir, prompt_lengths=0).get_state() == {}
