"""The warm start with the SentencePiece tokenizer (the benchmark model's):
SFT on the task's demonstrations, prompts encoded as the run encodes them,
cached under a key that tells the tiny and the mid policy apart."""

import os

import pytest

from streamrl.data import tasks
from streamrl.data import tokenizer as tok
from streamrl.data.config import Task
from streamrl.models import hf
from streamrl.models.config import Model
from streamrl.trainer import warmstart
from streamrl.trainer.config import Warmstart

pytestmark = [pytest.mark.unit]

TRACE = tasks.TraceConfig(max_tokens=64)
TASK = Task(kind="trace")
WARM = Warmstart(steps=2, batch_size=4, lr=1e-3, num_examples=16)


def _examples():
  return tasks.add_traces(tasks.make_examples(16, 0, max_answer_len=12), TRACE)


def test_a_sentencepiece_policy_is_warm_started_once_and_reused(tmp_path):
  model = Model(tiny="qwen2", tokenizer="sentencepiece")
  kw = dict(seed=0, workdir=str(tmp_path), train_examples=_examples(), trace=TRACE)
  path = warmstart.prepare_model_dir(model, WARM, TASK, **kw)
  assert path == warmstart.tiny_model_dir(
      model, WARM, TASK, seed=0, workdir=str(tmp_path), trace=TRACE
  )
  assert hf.read_config(path).vocab_size == 32000
  assert tok.read_chat_template(path) == tok.TURNS_TEMPLATE
  stamp = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
  assert warmstart.prepare_model_dir(model, WARM, TASK, **kw) == path
  assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == stamp
  assert [p for p in os.listdir(tmp_path) if ".tmp" in p] == []


def test_the_warm_up_encodes_prompts_as_the_run_does(tmp_path):
  directory = tok.save_sentencepiece_tokenizer(tmp_path, chat_template=tok.CHATML_TEMPLATE)
  tokenizer = tok.Tokenizer(directory)
  examples = _examples()[:4]
  [(steps, pairs)] = warmstart.warmup_phases(
      WARM, examples, seed=0, trace=TRACE, tokenizer=tokenizer
  )
  assert steps == WARM.steps
  for ex, (prompt, answer) in zip(examples, pairs):
    assert prompt == tokenizer.encode_prompt(ex.prompt)
    assert tokenizer.decode(prompt).startswith("<|im_start|>user\n" + ex.prompt)
    assert answer[-1] == 2  # </s>, where generation stops
    assert tasks.final_answer(tokenizer.decode(answer)) == ex.answer
  # With the tokenizer's work unit the passes are zeros (one token each).
  [(_, pairs)] = warmstart.warmup_phases(
      WARM, examples, seed=0, trace=TRACE, tokenizer=tokenizer, work="0"
  )
  texts = [tokenizer.decode(a) for _, a in pairs]
  assert not any("." in t for t in texts) and any("0|" in t for t in texts)


def test_a_trace_pass_is_one_token_per_character_under_sentencepiece(tmp_path):
  """The SentencePiece work unit: every pass costs len(input) + 2 tokens where
  the policy writes it, so a response is as long as `expected_response_length`
  says with the answer in the tokenizer's own pieces."""
  directory = tok.save_sentencepiece_tokenizer(tmp_path, chat_template=tok.CHATML_TEMPLATE)
  tokenizer = tok.Tokenizer(directory)
  count = tasks.answer_token_counter(tokenizer.encode_text)
  unit = tasks.work_unit("sentencepiece")
  for ex in _examples():
    _, s = tasks.parse_prompt(ex.prompt)
    rendered = tokenizer.render(tokenizer.messages(ex.prompt))
    prompt = tokenizer.encode_text(rendered)
    for passes in (0, 1, 3):
      text = tasks.trace_text(s, ex.answer, passes, unit)
      ids = tokenizer.encode_text(rendered + text)[len(prompt) :]
      assert len(ids) == passes * (len(s) + 2) + 1 + count(ex.answer)
      assert tasks.final_answer(tokenizer.decode(ids)) == ex.answer
  # Dots, the character tokenizer's unit, merge: a pass of them is a few pieces.
  assert len(tokenizer.encode_text("1" + "." * 16 + "|")) < 10


def test_the_work_unit_enters_the_sentencepiece_key_only(tmp_path):
  def key(**fields):
    return os.path.basename(
        warmstart.tiny_model_dir(
            Model(**fields), WARM, TASK, seed=0, workdir=str(tmp_path), trace=TRACE
        )
    )

  # The character tokenizer's warm starts keep the names they had before
  # the work unit was a setting of the tokenizer (their text is unchanged).
  assert key(tiny="qwen2") == "warmstart-f86b305eaa69"
  # The SentencePiece one is taught another text: a new name.
  assert key(tiny="qwen2_mid", tokenizer="sentencepiece") != "warmstart-9771fc37cf19"


def test_the_cache_key_tells_tiny_mid_and_tokenizers_apart(tmp_path):
  def key(**fields):
    return warmstart.tiny_model_dir(Model(**fields), WARM, TASK, seed=0, workdir=str(tmp_path))

  mid = key(tiny="qwen2_mid", tokenizer="sentencepiece")
  tiny_sp = key(tiny="qwen2", tokenizer="sentencepiece")
  assert len({mid, tiny_sp, key(tiny="qwen2")}) == 3
  # The generators' dtype does not change the weights.
  assert key(tiny="qwen2_mid", tokenizer="sentencepiece", dtype="bfloat16") == mid
  system = Task(kind="trace", system_prompt="Be brief.")
  assert (
      warmstart.tiny_model_dir(
          Model(tiny="qwen2_mid", tokenizer="sentencepiece"),
          WARM,
          system,
          seed=0,
          workdir=str(tmp_path),
      )
      != mid
  )
