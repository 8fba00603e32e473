"""The ranker learns, saves/restores exactly, refreshes online, refuses wrong tokenizers."""

import numpy as np
import pytest

from configs import ranker as ranker_config
from streamrl.ranker import data
from streamrl.ranker import train as ranker_train
from streamrl.ranker.metrics import ranking_metrics
from streamrl.ranker.train import RankerTrainer

pytestmark = [pytest.mark.unit]

VOCAB, FP = data.char_tokenizer_fingerprint()


def _config():
  c = ranker_config.get_config("tiny")
  c.model.max_len = 32
  c.buckets = (32,)  # One bucket: one compiled train step.
  c.batch_size = 32
  c.predict_batch = 64
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 20
  c.online.steps = 5
  c.online.eval_newest = 64
  return c


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("ranker"))
  kw = dict(max_answer_len=24, median_len=4.0, sigma=1.0)  # Prompts fit in 32 tokens.
  train = data.synthetic_pairs(1500, seed=0, **kw)
  evals = data.synthetic_pairs(300, seed=1, first_id=1500, **kw)
  trainer = RankerTrainer(_config(), vocab_size=VOCAB, tokenizer_fingerprint=FP, workdir=workdir)
  trainer.fit(train, 200, eval_pairs=evals, log_every=100, eval_every=200)
  return trainer, train, evals, workdir


def test_ranker_beats_random_by_a_wide_margin(trained):
  trainer, _, evals, workdir = trained
  m = trainer.evaluate(evals)
  true = [n for _, n in evals]
  rand = ranking_metrics(np.random.default_rng(0).random(len(evals)), true)
  assert m["recall20"] >= rand["recall20"] + 0.4, (m, rand)
  assert m["recall20"] >= 0.75, m
  assert m["spearman"] >= 0.8, m
  import os

  assert os.listdir(os.path.join(workdir, "tb"))  # TensorBoard events were written.


def test_predict_handles_any_batch_and_rejects_unknown_ids(trained):
  trainer = trained[0]
  prompts = [p for p, _ in trained[2][:70]]  # More than one predict chunk.
  full = trainer.predict(prompts)
  assert full.shape == (70,)
  np.testing.assert_allclose(trainer.predict(prompts[65:]), full[65:], rtol=1e-5)
  assert trainer.predict([[]]).shape == (1,)  # Empty prompt does not crash.
  with pytest.raises(ValueError, match="vocabulary"):
    trainer.predict([[1, VOCAB + 3]])
  # The prompt named is the one with the bad id, whatever the order scored in.
  with pytest.raises(ValueError, match="prompt 1 "):
    trainer._pad([[1, 2, 3], [4, -1], [5]])


def test_a_prompt_scores_the_same_whatever_it_is_predicted_with(trained):
  trainer = trained[0]
  prompts = [p for p, _ in trained[2][:40]]
  mixed = [prompts[i] if i % 3 else prompts[i][:3] for i in range(40)]  # short and long ones
  alone = np.concatenate([trainer.predict([p]) for p in mixed])
  np.testing.assert_allclose(trainer.predict(mixed), alone, rtol=1e-5)
  np.testing.assert_allclose(trainer.predict(mixed[::-1]), alone[::-1], rtol=1e-5)
  tokens, mask = trainer._pad([[3, 4, 5], [], [6]], rows=4)
  assert tokens.tolist()[:3] == [[3, 4, 5] + [0] * 29, [0] * 32, [6] + [0] * 31]
  assert mask.sum(axis=1).tolist() == [3, 0, 1, 0]


def test_checkpoint_restore_gives_identical_predictions(trained):
  trainer, _, evals, workdir = trained
  trainer.save()
  prompts = [p for p, _ in evals[:50]]
  restored = RankerTrainer.restore(workdir, vocab_size=VOCAB, tokenizer_fingerprint=FP)
  assert restored.step == trainer.step
  np.testing.assert_array_equal(restored.predict(prompts), trainer.predict(prompts))
  # Optimizer state came back too: one identical step from both gives identical params.
  batch = trained[1][:64]
  a = restored.update(batch, steps=1)
  b = trainer.update(batch, steps=1)
  assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def test_mismatched_tokenizer_refused(trained):
  trainer, _, _, workdir = trained
  trainer.save()
  with pytest.raises(ValueError, match="retrain the ranker"):
    RankerTrainer.restore(workdir, vocab_size=VOCAB, tokenizer_fingerprint="0" * 16)
  with pytest.raises(ValueError, match="retrain the ranker"):
    RankerTrainer.restore(workdir, vocab_size=VOCAB * 2, tokenizer_fingerprint=FP)
  with pytest.raises(FileNotFoundError):
    RankerTrainer.restore(workdir + "/nope", vocab_size=VOCAB, tokenizer_fingerprint=FP)


def test_online_update_uses_recent_window_and_reports_pre_metrics(trained):
  trainer = trained[0]
  before = trainer.step
  out = trainer.update(trained[1][:200])
  assert trainer.step == before + trainer.config.online.steps
  assert "pre_recall20" in out and "loss" in out


def test_compile_all_leaves_the_ranker_as_it_was_and_nothing_to_compile():
  c = _config()
  c.buckets = (16, 32)
  trainer = RankerTrainer(c, vocab_size=VOCAB, tokenizer_fingerprint=FP)
  pairs = data.synthetic_pairs(100, seed=2, max_answer_len=24, median_len=4.0, sigma=1.0)
  before = trainer.predict([p for p, _ in pairs])
  trainer.compile_all()
  assert trainer.step == 0
  np.testing.assert_array_equal(trainer.predict([p for p, _ in pairs]), before)
  compiled = (trainer._train_step._cache_size(), trainer._score._cache_size())
  # One train program per bucket, a scorer per bucket (and half the smallest) and row count.
  assert trainer._predict_buckets == (8, 16, 32)
  assert compiled == (2, 3 * len(ranker_train._row_sizes(int(c.predict_batch))))
  trainer.update(pairs)
  trainer.predict([p[:10] for p, _ in pairs])  # the short bucket too
  assert (trainer._train_step._cache_size(), trainer._score._cache_size()) == compiled


def test_row_chunks_cover_every_prompt_with_little_padding():
  assert ranker_train._row_chunks(70, 256) == [64, 16]
  assert ranker_train._row_chunks(300, 256) == [256, 16, 16, 16]
  assert ranker_train._row_chunks(0, 256) == []
  assert ranker_train._row_chunks(3, 2) == [2, 1]
  for n in range(0, 600, 7):
    chunks = ranker_train._row_chunks(n, 256)
    assert sum(chunks) - n in range(16)  # only the last chunk pads
