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
