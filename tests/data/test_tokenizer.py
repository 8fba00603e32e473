"""Character tokenizer: ids, round trip, and HF AutoTokenizer compatibility."""

import pytest

from streamrl.data import tasks
from streamrl.data import tokenizer as tok


def test_fixed_special_ids_and_vocab_size():
  v = tok.vocab()
  assert len(v) == tok.VOCAB_SIZE == 64
  assert (v["<pad>"], v["<bos>"], v["<eos>"]) == (0, 1, 2)
  assert (tok.PAD_ID, tok.BOS_ID, tok.EOS_ID) == (0, 1, 2)
  assert sorted(v.values()) == list(range(64))
  assert tok.build_tokenizer().get_vocab_size() == 64


def test_round_trip_on_task_prompts_and_answers():
  for ex in tasks.make_examples(200, seed=1):
    for text in (ex.prompt, ex.answer, ex.prompt + ex.answer):
      ids = tok.encode(text)
      assert len(ids) == len(text)
      assert all(i > tok.UNK_ID for i in ids)
      assert tok.decode(ids) == text
  assert tok.decode(tok.encode(tok.CHARS)) == tok.CHARS


def test_decode_stops_at_eos_and_drops_pad_and_bos():
  ids = [tok.BOS_ID] + tok.encode("ab c") + [tok.EOS_ID] + tok.encode("zz")
  assert tok.decode(ids) == "ab c"
  assert tok.decode([tok.PAD_ID, *tok.encode("x"), tok.PAD_ID]) == "x"
  assert tok.decode([]) == ""


def test_encode_rejects_unknown_characters():
  with pytest.raises(ValueError, match="'A'"):
    tok.encode("abA")


def test_tokenizers_object_matches_encode():
  t = tok.build_tokenizer()
  text = "rev:hello world=dlrow olleh"
  assert t.encode(text, add_special_tokens=False).ids == tok.encode(text)
  assert t.encode(text).ids == [tok.BOS_ID] + tok.encode(text)
  assert t.decode(tok.encode(text)) == text


def test_auto_tokenizer_loads_with_same_ids(tmp_path):
  transformers = pytest.importorskip("transformers")
  tok.save_hf_tokenizer(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf.is_fast
  assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
  assert len(hf) == tok.VOCAB_SIZE
  for ex in tasks.make_examples(20, seed=2):
    assert hf.encode(ex.prompt, add_special_tokens=False) == tok.encode(ex.prompt)
    assert hf(ex.prompt)["input_ids"] == [tok.BOS_ID] + tok.encode(ex.prompt)
    ids = tok.encode(ex.answer) + [tok.EOS_ID]
    assert hf.decode(ids, skip_special_tokens=True) == ex.answer
  assert hf.convert_ids_to_tokens(tok.encode("a b")) == ["a", " ", "b"]
  assert hf.decode(tok.encode("a b, c")) == "a b, c"
