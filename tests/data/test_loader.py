"""PromptLoader (grain): order, epochs, checkpoint/restore; make_prompts."""

import json

import pytest

from streamrl.data import loader
from streamrl.data import tasks
from streamrl.data import tokenizer

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def examples():
  return tasks.make_examples(23, seed=0)


def _ids(batch):
  return [ex.prompt_id for ex in batch]


def test_batches_cover_each_epoch_without_duplicates(examples):
  pl = loader.PromptLoader(examples, batch_size=5, seed=1)
  assert pl.batches_per_epoch == 4
  epochs = []
  for _ in range(3):
    ids = [_ids(next(pl)) for _ in range(pl.batches_per_epoch)]
    for b in ids:
      assert len(b) == 5 and len(set(b)) == 5
    flat = sum(ids, [])
    assert len(set(flat)) == 20
    epochs.append(flat)
  # Reshuffled each epoch.
  assert epochs[0] != epochs[1]


def test_same_seed_same_order_other_seed_differs(examples):
  a = [_ids(next(loader.PromptLoader(examples, 4, seed=3)))]
  b = [_ids(next(loader.PromptLoader(examples, 4, seed=3)))]
  c = [_ids(next(loader.PromptLoader(examples, 4, seed=4)))]
  assert a == b != c


def test_finite_epochs_and_remainder(examples):
  pl = loader.PromptLoader(examples, 5, seed=0, num_epochs=2, drop_remainder=False)
  batches = list(pl)
  assert [len(b) for b in batches] == [5, 5, 5, 5, 3] * 2
  assert sorted(sum((_ids(b) for b in batches[:5]), [])) == list(range(23))
  ordered = loader.PromptLoader(examples, 23, seed=0, shuffle=False)
  assert _ids(next(ordered)) == list(range(23))


def test_restore_continues_like_uninterrupted(examples):
  ref = loader.PromptLoader(examples, 5, seed=9)
  for _ in range(6):  # into the second epoch
    next(ref)
  state = json.loads(json.dumps(ref.get_state()))  # survives a JSON file
  expected = [_ids(next(ref)) for _ in range(7)]

  fresh = loader.PromptLoader(examples, 5, seed=9)
  fresh.set_state(state)
  assert [_ids(next(fresh)) for _ in range(7)] == expected


def test_restore_refuses_other_data(examples):
  state = loader.PromptLoader(examples, 5, seed=9).get_state()
  with pytest.raises(ValueError, match="batch_size"):
    loader.PromptLoader(examples, 4, seed=9).set_state(state)
  with pytest.raises(ValueError, match="fingerprint"):
    loader.PromptLoader(tasks.make_examples(23, seed=1), 5, seed=9).set_state(state)


def test_bad_arguments(examples):
  with pytest.raises(ValueError, match="empty"):
    loader.PromptLoader([], 2, seed=0)
  with pytest.raises(ValueError, match="larger than the dataset"):
    loader.PromptLoader(examples, 100, seed=0)


def test_make_prompts_char_and_tokenizers(examples):
  batch = examples[:3]
  prompts = loader.make_prompts(batch)
  assert [pid for pid, _ in prompts] == [0, 1, 2]
  for (pid, ids), ex in zip(prompts, batch):
    assert ids == [tokenizer.BOS_ID] + tokenizer.encode(ex.prompt)
  # A tokenizers.Tokenizer adds its own specials: the same ids here.
  assert loader.make_prompts(batch, tokenizer.build_tokenizer()) == prompts
  assert loader.make_prompts(batch, tokenizer) == prompts
