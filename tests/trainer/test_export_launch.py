"""launch/export.py on a real run's workdir, and vLLM serving what it wrote:
the engine's prompt and sampled logprobs are the trainer's.

Starts the script in a subprocess and a vLLM engine in this one (tiers
"e2e" and "engine", tests/conftest.py); the library and transformers on
the export: test_export.py.
"""

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from streamrl import errors
from streamrl.models import transformer

pytestmark = [pytest.mark.engine, pytest.mark.e2e]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPORT = os.path.join(REPO, "launch", "export.py")
PROMPTS = [[1] + [4 + (3 * i + 7 * j) % 50 for j in range(3 + 4 * i)] for i in range(4)]


def run_export(*args):
  env = {k: v for k, v in os.environ.items() if k != errors.DEBUG_ENV}
  env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, EXPORT, *args], env=env, capture_output=True, text=True, timeout=120
  )


@pytest.fixture(scope="module")
def exported(export_run, tmp_path_factory):
  workdir = export_run[0]
  out = str(tmp_path_factory.mktemp("launch") / "hf")
  res = run_export(f"--workdir={workdir}", f"--out={out}")
  assert res.returncode == 0, res.stderr
  assert res.stdout.strip() == f"wrote {out}: the policy of {workdir} at step 2"
  return out


def test_a_script_error_is_one_line(export_run, tmp_path):
  # One case of the script's handling; every refusal's sentence: test_export.py.
  workdir = export_run[0]
  res = run_export(f"--workdir={workdir}", "--step=5", f"--out={tmp_path / 'hf'}")
  assert res.returncode == 2, res.stderr
  assert res.stderr.splitlines() == [
      f"error: {workdir} has no checkpoint of step 5; pick one of the saved steps 1, 2."
  ]


def test_vllm_serves_the_export_with_the_trainers_logprobs(trained_policy, exported, monkeypatch):
  monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
  import vllm

  _, policy = trained_policy
  llm = vllm.LLM(
      model=exported,
      dtype="float32",
      seed=0,
      max_model_len=128,
      max_num_seqs=8,
      enforce_eager=True,
      enable_prefix_caching=False,
      enable_chunked_prefill=False,  # CPU generators can't rewind (vllm_engine.py)
      max_num_batched_tokens=2048,
  )
  try:
    params = vllm.SamplingParams(
        temperature=1.0, max_tokens=16, logprobs=0, prompt_logprobs=0, seed=0, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
  finally:
    llm.llm_engine.engine_core.shutdown()
  prompt_err, sampled_err = [], []
  for prompt, out in zip(PROMPTS, outs):
    sample = out.outputs[0]
    tokens = prompt + list(sample.token_ids)
    logp, _ = transformer.sequence_logprobs(policy, jnp.asarray([tokens]))
    logp = np.asarray(logp[0])
    engine_prompt = [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], prompt[1:])]
    engine_sampled = [step[t].logprob for step, t in zip(sample.logprobs, sample.token_ids)]
    n = len(prompt)
    prompt_err.append(np.abs(np.array(engine_prompt) - logp[: n - 1]).max())
    sampled_err.append(np.abs(np.array(engine_sampled) - logp[n - 1 : len(tokens) - 1]).max())
  print(
      f"max |vLLM - trainer| logprob: prompt {max(prompt_err):.2e}, sampled {max(sampled_err):.2e}"
  )
  assert max(prompt_err) < 1e-3 and max(sampled_err) < 1e-3, (prompt_err, sampled_err)
