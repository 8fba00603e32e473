"""Each Ray actor's process imports only its own side's frameworks: the
trainer's never loads torch or vLLM (its tokenizer renders chat templates
without transformers' tokenizer classes), the generator's never loads JAX or
Flax. Each side is imported in a fresh interpreter, as its actor would."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit]

REPO = os.path.join(os.path.dirname(__file__), "..")

TRAINER_SIDE = """
import json, sys
import streamrl.experiment, streamrl.train
from streamrl.trainer import export, rl_trainer, setup
from streamrl.data import tokenizer
t = tokenizer.Tokenizer(sys.argv[1])
ids = t.encode_prompt("ab")
print(json.dumps({
    "first": ids[0],
    "rendered": t.decode(ids),
    "chat": t.chat,
    "loaded": sorted({"torch", "vllm"} & set(sys.modules)),
}))
"""

GENERATOR_SIDE = """
import json, sys
from streamrl.generator import actor, agentic, local, profiler, service, vllm_engine, vllm_worker
import streamrl.transfer
print(json.dumps({"loaded": sorted({"jax", "flax"} & set(sys.modules))}))
"""


def _run(code: str, *args: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run(
      [sys.executable, "-c", code, *args],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
      check=False,
  )
  assert res.returncode == 0, res.stderr
  return json.loads(res.stdout.splitlines()[-1])


def test_the_trainer_side_never_imports_torch(tmp_path):
  from streamrl.data import tokenizer

  tokenizer.save_hf_tokenizer(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  out = _run(TRAINER_SIDE, str(tmp_path))
  # The template saw the directory's own special tokens; decoding drops them.
  assert out == {"first": tokenizer.BOS_ID, "rendered": "ab", "chat": True, "loaded": []}


def test_the_generator_side_never_imports_jax():
  assert _run(GENERATOR_SIDE) == {"loaded": []}
