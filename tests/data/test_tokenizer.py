"""Character tokenizer: ids, round trip, and HF AutoTokenizer compatibility."""

import pytest

from streamrl.data import tasks
from streamrl.data import tokenizer as tok

pytestmark = [pytest.mark.unit]


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


# ------------------------------------------------- real tokenizers, chat templates
@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
  """mistral-common's 32,000-piece SentencePiece model as an HF directory,
  with the turns chat template (it ships none)."""
  return tok.save_sentencepiece_tokenizer(tmp_path_factory.mktemp("sp32k"))


def test_a_real_sentencepiece_tokenizer_renders_chats(sentencepiece_dir):
  import tokenizers
  import transformers

  hf = transformers.AutoTokenizer.from_pretrained(sentencepiece_dir, local_files_only=True)
  assert len(hf) == 32000
  t = tok.Tokenizer(sentencepiece_dir, system_prompt="Answer briefly.")
  assert t.chat
  chat = [{"role": "user", "content": "What is 12*3?"}]
  ids = t.encode_prompt("What is 12*3?")
  # A text prompt is the user's turn, led by the system prompt; rendered by
  # the template, then encoded without adding special tokens a second time.
  want = hf.apply_chat_template(
      [{"role": "system", "content": "Answer briefly."}] + chat,
      tokenize=False,
      add_generation_prompt=True,
  )
  assert want.startswith("<s><|system|>\nAnswer briefly.</s>") and want.endswith("<|assistant|>\n")
  assert ids == hf.encode(want, add_special_tokens=False) == t.encode_prompt(chat)
  assert ids[0] == hf.bos_token_id and ids.count(hf.bos_token_id) == 1
  assert t.decode(hf.encode("The answer is 36.", add_special_tokens=False)) == "The answer is 36."
  # Without the template: the raw text with the model's own BOS.
  raw = tok.Tokenizer(sentencepiece_dir, chat_template="off")
  assert raw.encode_prompt("12*3?") == hf.encode("12*3?")
  with pytest.raises(Exception, match="chat messages"):
    raw.encode_prompt(chat)
  # tokenizer.json read by `tokenizers` alone gives the same ids.
  fast = tokenizers.Tokenizer.from_file(f"{sentencepiece_dir}/tokenizer.json")
  assert fast.encode(want, add_special_tokens=False).ids == ids


def test_one_more_turn_appends_tokens_without_re_encoding(sentencepiece_dir):
  t = tok.Tokenizer(sentencepiece_dir)
  convo = [
      {"role": "user", "content": "Add 2 and 3."},
      {"role": "assistant", "content": "add(2,3)"},
  ]
  tool = {"role": "tool", "content": "5"}
  turn = t.turn_tokens(convo, tool)
  assert t.decode(turn) == "<|tool|>\n5\n<|assistant|>\n"
  # The text of the longer conversation is the shorter one's plus this turn's.
  assert t.render(convo + [tool]) == t.render(convo, add_generation_prompt=False) + (
      "<|tool|>\n5</s>\n<|assistant|>\n"
  )


def test_chat_template_modes_refuse_what_they_cannot_do(tmp_path, sentencepiece_dir):
  from streamrl.errors import UserError

  char_dir = tok.save_hf_tokenizer(tmp_path / "chars")
  assert not tok.Tokenizer(char_dir).chat  # auto: no template, raw text
  with pytest.raises(UserError, match="has no chat template"):
    tok.Tokenizer(char_dir, chat_template="on")
  with pytest.raises(UserError, match="system_prompt needs a chat template"):
    tok.Tokenizer(char_dir, system_prompt="Be brief.")
  with pytest.raises(UserError, match="unknown"):
    tok.Tokenizer(sentencepiece_dir, chat_template="yes")


def test_stop_tokens_come_from_generation_config(tmp_path):
  import json

  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
  assert tok.stop_token_ids(str(tmp_path)) == [7]
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
  assert tok.stop_token_ids(str(tmp_path)) == [9, 7]
