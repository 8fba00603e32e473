"""Multi-turn trajectories on a real vLLM engine: token-in, token-out, tools that
hang or crash.

The policy is the tiny model taught the calculator's call format for a few
seconds (sums of three small numbers, two calls and the answer), so its
trajectories run three turns.
"""

import re
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.data import calc
from streamrl.data import tokenizer as tok
from streamrl.envs import tools
from streamrl.envs.config import Env
from streamrl.generator.config import Sampling
from streamrl.generator.vllm_engine import GeneratorInstance
from streamrl.models import config, hf, tiny, transformer
from streamrl.trainer import experience

TEMPERATURE = 1.0
SAMPLING = Sampling(temperature=TEMPERATURE, max_tokens=96)


def _prompts(n=8, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    terms = [int(x) for x in rng.integers(10, 99, size=3)]
    out.append((i, "add:" + "+".join(map(str, terms)) + "="))
  return out


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import sft  # pylint: disable=g-import-not-at-top

  cfg = config.tiny_qwen2(tok.VOCAB_SIZE)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  pairs = [
      (
          [tok.BOS_ID] + tok.encode(p),
          tok.encode(calc.tool_trajectory(calc.terms_of(p))) + [tok.EOS_ID],
      )
      for _, p in _prompts(256, seed=1)
  ]
  model, _ = sft.warm_start(model, pairs, steps=120, batch_size=32, lr=3e-3, seq_len=64)
  path = str(tmp_path_factory.mktemp("calc_policy"))
  tiny.build_tiny_model_dir(path, cfg, model=model)
  return path


def _requests():
  return [(i, [tok.BOS_ID] + tok.encode(p)) for i, p in _prompts()]


def test_a_three_turn_trajectory_is_the_engines_tokens_with_observations_masked(policy_dir):
  env = Env(name="calc", max_turns=3, max_tokens_per_turn=24)
  gen = GeneratorInstance(policy_dir, max_num_seqs=8, max_model_len=160, seed=0, env=env)
  try:
    samples = list(gen.generate(_requests(), SAMPLING, seed=0))
  finally:
    gen.close()
  assert sorted(s.prompt_id for s in samples) == list(range(8))
  three = [s for s in samples if s.turns.turns == 3]
  assert three, [(s.turns, tok.decode(s.token_ids)) for s in samples]
  _, model = hf.load_hf(policy_dir)
  for s in three:
    text = tok.decode(s.token_ids)
    mask = np.array(s.mask)
    assert len(mask) == len(s.token_ids) == len(s.logprobs)
    # Observations are the calculator's answers, masked, with logprob 0; the rest is the
    # policy's, and each policy turn but the last ends on the call's "]".
    obs = tok.decode([t for t, m in zip(s.token_ids, mask) if m == 0])
    assert obs and obs.startswith("(") and obs.endswith(")"), text
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, mask) if m == 0)
    assert s.turns.tool_calls >= 2, text  # a third turn follows a second observation
    # Each observation is the calculator's answer to the call before it.
    calls = re.findall(r"\[calc ([^\]]*)\]\(([^)]*)\)", text)
    assert len(calls) >= 2, text
    for expr, result in calls:
      try:
        want = tools.calculator(expr)
      except tools.ToolError as err:
        want = f"error {err}"
      assert result == want, text
    # The trainer scores exactly these tokens: its logprobs on the policy's tokens agree.
    tokens = jnp.asarray([list(s.prompt_token_ids) + list(s.token_ids)])
    logp, _ = transformer.sequence_logprobs(model, tokens, temperature=TEMPERATURE)
    n = len(s.prompt_token_ids)
    trainer = np.asarray(logp[0, n - 1 : -1])
    err = np.abs(trainer - np.array(s.logprobs))[mask == 1]
    assert err.max() < 1e-3, err.max()
    # The batch's loss mask is the sample's mask, shifted onto the logprob columns.
    batch = experience.pad_samples([s])
    np.testing.assert_array_equal(batch["mask_bt"][0, n - 1 : n - 1 + len(mask)], mask)
    assert batch["mask_bt"][0].sum() == mask.sum()


HOSTILE_ENV = textwrap.dedent("""
    import os, time
    from streamrl.envs.base import CalcEnv

    COUNTER = {counter!r}

    class Hostile(CalcEnv):
      # Over all trajectories: the first call hangs, the second kills its worker, the rest answer.
      def step(self, state, action):
        fd = os.open(COUNTER, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, b"x")
        os.close(fd)
        n = os.path.getsize(COUNTER)
        if n == 1:
          time.sleep(600)
        if n == 2:
          os._exit(3)
        return super().step(state, action)
    """)


def test_a_hanging_and_a_crashing_tool_become_error_observations(policy_dir, tmp_path):
  path = tmp_path / "hostile.py"
  path.write_text(HOSTILE_ENV.format(counter=str(tmp_path / "calls")))
  env = Env(
      name=f"{path}:Hostile",
      max_turns=3,
      max_tokens_per_turn=24,
      tool_timeout_s=1.0,
      tool_workers=1,
  )
  gen = GeneratorInstance(policy_dir, max_num_seqs=8, max_model_len=160, seed=0, env=env)
  try:
    t0 = time.monotonic()
    samples = list(gen.generate(_requests(), SAMPLING, seed=0))
    took = time.monotonic() - t0
  finally:
    gen.close()
  assert sorted(s.prompt_id for s in samples) == list(range(8))
  assert took < 60  # cut at the tool's limit (1 s + the worker's grace), never the 600-s sleep
  texts = [tok.decode(s.token_ids) for s in samples]
  assert sum(t.count("(error timeout)") for t in texts) == 1, texts
  assert sum(t.count("(error tool failed)") for t in texts) == 1, texts
  assert sum(s.turns.tool_timeouts for s in samples) == 1
  # The worker was replaced: later calls were answered, and the trajectories that met the
  # failures went on to another turn.
  assert any(re.search(r"\[calc \d+\+\d+\]\(\d+\)", t) for t in texts), texts
  failed = [s for s, t in zip(samples, texts) if "(error t" in t]
  assert all(s.turns.turns >= 2 for s in failed), texts
