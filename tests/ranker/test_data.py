import pytest

from streamrl.data import tokenizer
from streamrl.ranker import data

pytestmark = [pytest.mark.unit]


def test_append_and_load_pairs(tmp_path):
  path = tmp_path / "d" / "pairs.jsonl"
  assert data.append_pairs(path, [([1, 5, 6], 4), ((1, 7), 9)]) == 2
  data.append_pairs(path, [([1], 3)])
  assert data.load_pairs(path) == [((1, 5, 6), 4), ((1, 7), 9), ((1,), 3)]
  assert data.load_pairs(path, last=2) == [((1, 7), 9), ((1,), 3)]


def test_bad_pairs_refused(tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text('{"prompt_ids": [1, 2], "length": 3}\n{"prompt_ids": [1], "len": 2}\n')
  with pytest.raises(ValueError, match="prompt_ids and length"):
    data.load_pairs(path)
  with pytest.raises(FileNotFoundError, match="pairs_path"):
    data.load_pairs(tmp_path / "missing.jsonl")
  with pytest.raises(ValueError, match="non-negative"):
    data.append_pairs(path, [([1, 2], -1)])


def test_synthetic_pairs_lengths_are_answer_plus_eos():
  pairs = data.synthetic_pairs(50, seed=0)
  for ids, n in pairs:
    prompt = tokenizer.decode(ids[1:])
    op, s = prompt[:3], prompt[4:-1]
    assert ids[0] == tokenizer.BOS_ID
    assert n == len(s) * (2 if op == "dbl" else 1) + 1


def test_fingerprints(tmp_path):
  size, fp = data.char_tokenizer_fingerprint()
  tokenizer.save_hf_tokenizer(tmp_path)
  assert data.fingerprint_tokenizer_dir(tmp_path) == (size, fp)
  other = dict(tokenizer.vocab())
  other["a"], other["b"] = other["b"], other["a"]
  assert data.fingerprint_vocab(other) != fp
