"""Each process of a run imports only its own side's frameworks: the
trainer's never loads torch or vLLM (its tokenizer renders chat templates
without transformers' tokenizer classes), the generator's never loads JAX or
Flax, and the launcher's (launch/main.py: the config, the plan, starting the
actors) loads none of them. Each side is imported in a fresh interpreter, as
its process would."""

import ast
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

# What launch/main.py imports (`launcher_imports`), then what it does before
# starting the run.
LAUNCHER_SIDE = """
import json, sys
{imports}
from streamrl import experiment
from streamrl.config import settings
s = settings.from_config(settings.default_config())
experiment.refuse_incompatible_checkpoints(s, sys.argv[1])  # a new workdir: nothing to read
loaded = {{m.split(".")[0] for m in sys.modules}}
print(json.dumps({{"loaded": sorted({frameworks!r} & loaded)}}))
"""
FRAMEWORKS = {"jax", "flax", "optax", "orbax", "torch", "vllm", "tensorflow"}


def launcher_imports() -> str:
  """Every import statement of launch/main.py (top level and in `main`), as code."""
  with open(os.path.join(REPO, "launch", "main.py")) as f:
    tree = ast.parse(f.read())
  nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
  return "\n".join(ast.unparse(n) for n in nodes)


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


def test_the_launcher_never_imports_jax_or_torch(tmp_path):
  code = LAUNCHER_SIDE.format(imports=launcher_imports(), frameworks=FRAMEWORKS)
  assert _run(code, str(tmp_path / "workdir")) == {"loaded": []}


def test_the_settings_name_the_estimators_the_jax_modules_define():
  # The settings keep their own lists of names: the modules that define the
  # estimators import JAX, and the launcher reads the settings.
  from streamrl import rl
  from streamrl.rl import config

  assert sorted(config.ADVANTAGES) == sorted(rl.ADVANTAGE_ESTIMATORS)
  assert sorted(config.KLS) == sorted(rl.KL_ESTIMATORS)
  assert sorted(config.LOSS_AGGS) == sorted(rl.AGG_MODES)
  assert sorted(config.ROLLOUT_CORRECTIONS) == sorted(("auto", *rl.ROLLOUT_CORRECTIONS))
