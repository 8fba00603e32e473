"""Multi-turn trajectories on a real vLLM engine: token-in, token-out, stopped and
resumed under new weights, tools that hang or crash.

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
from streamrl.generator.agentic import AgentStream
from streamrl.generator.config import Sampling
from streamrl.generator.rollout import PARTIAL
from streamrl.generator.vllm_engine import GeneratorInstance
from streamrl.scheduling.request import Request
from streamrl.models import config, hf, tiny, transformer
from streamrl.trainer import experience

pytestmark = [pytest.mark.engine]

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


@pytest.fixture(scope="module")
def calc_engine(policy_dir):
  """Multi-turn rollouts with the calculator on an engine of the policy (its weights as
  policy_dir's after each test)."""
  env = Env(name="calc", max_turns=3, max_tokens_per_turn=24)
  gen = GeneratorInstance(policy_dir, max_num_seqs=8, max_model_len=160, seed=0)
  loop = AgentStream(gen, env)
  yield loop
  loop.close()
  gen.close()


def _check_observations(text):
  """Each observation in `text` is the calc tool's answer to the call before it; the calls."""
  calls = re.findall(r"\[calc ([^\[\]]*)\]\(([^)]*)\)", text)  # as envs/base.py parses a call
  for expr, result in calls:
    try:
      want = tools.TOOLS["calc"](expr)
    except tools.ToolError as err:
      want = f"error {err}"
    assert result == want, text
  return calls


def _trainer_error(model, s) -> float:
  """The largest gap between the trainer's logprobs of `s`'s policy tokens and the engine's."""
  tokens = jnp.asarray([list(s.prompt_token_ids) + list(s.token_ids)])
  logp, _ = transformer.sequence_logprobs(model, tokens, temperature=TEMPERATURE)
  n = len(s.prompt_token_ids)
  trainer = np.asarray(logp[0, n - 1 : -1])
  return float(np.abs(trainer - np.array(s.logprobs))[np.array(s.mask) == 1].max(initial=0.0))


def test_a_three_turn_trajectory_is_the_engines_tokens_with_observations_masked(
    policy_dir, calc_engine
):
  samples = list(calc_engine.generate(_requests(), SAMPLING, seed=0))
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
    assert len(_check_observations(text)) >= 2, text
    # The trainer scores exactly these tokens: its logprobs on the policy's tokens agree.
    assert _trainer_error(model, s) < 1e-3
    # The batch's loss mask is the sample's mask, shifted onto the logprob columns.
    n = len(s.prompt_token_ids)
    batch = experience.pad_samples([s])
    np.testing.assert_array_equal(batch["mask_bt"][0, n - 1 : n - 1 + len(mask)], mask)
    assert batch["mask_bt"][0].sum() == mask.sum()


def _resumed(samples):
  """The Requests that continue `samples`' stopped trajectories."""
  return [
      Request(s.prompt_id, s.prompt_token_ids + s.token_ids, trajectory=s.trajectory)
      for s in samples
      if s.finish_reason == PARTIAL
  ]


def test_a_stopped_trajectory_resumes_under_new_weights_with_each_versions_logprobs(
    policy_dir, calc_engine
):
  """Partial rollouts of trajectories: stopped mid-turn, resumed under new weights and stopped
  again while a tool call is out, then run to the end; stitched, the segments are one
  trajectory, and each segment's policy tokens have the logprobs of the weights that sampled
  them (fp32, <= 1e-3)."""
  loop = calc_engine
  gen = loop.engine
  cfg, old = hf.load_hf(policy_dir)
  tensors = hf.load_hf_tensors(policy_dir)
  tensors["model.norm.weight"] = 1.5 * tensors["model.norm.weight"]  # the same calls, sharper
  new = hf.from_hf_tensors(cfg, tensors)
  steps = []
  first = list(
      loop.generate(_requests(), SAMPLING, seed=0, stop=lambda: steps.append(1) or len(steps) > 14)
  )
  v_old = gen.weight_version
  assert sorted(s.prompt_id for s in first) == list(range(8))
  stopped = {s.prompt_id for s in first if s.finish_reason == PARTIAL}  # the rest ended in time
  assert len(stopped) >= 4 and all((s.prompt_id in stopped) == bool(s.trajectory) for s in first)
  assert any(s.trajectory.turn_cut for s in first if s.trajectory)  # cut mid-turn
  try:
    v_new = gen.update_weights(tensors)
    # Stopped as soon as a turn ends on its tool call (it leaves the engine for the tools).
    second = list(
        loop.generate(
            _resumed(first), SAMPLING, seed=0, stop=lambda: 0 < gen.in_flight < len(stopped)
        )
    )
    assert any(s.trajectory.tool_pending for s in second if s.trajectory)
    third = list(loop.generate(_resumed(second), SAMPLING, seed=0))
  finally:
    gen.update_weights(hf.load_hf_tensors(policy_dir))
  segments = {p: [s for s in first + second + third if s.prompt_id == p] for p in stopped}
  for segs in segments.values():
    assert [s.finish_reason == PARTIAL for s in segs] == [True] * (len(segs) - 1) + [False]
    for s, policy in zip(segs, [old, new, new]):
      assert s.weight_version == (v_old if policy is old else v_new)
      assert _trainer_error(policy, s) < 1e-3
    for a, b in zip(segs, segs[1:]):
      assert b.prompt_token_ids == a.prompt_token_ids + a.token_ids  # on from exactly its tokens
    # Stitched, it is one trajectory: observations answer its calls, masked with logprob 0,
    # and a cut turn's halves count as one turn.
    tokens = sum((s.token_ids for s in segs), ())
    mask = np.array(sum((s.mask for s in segs), ()))
    _check_observations(tok.decode(tokens))
    assert all(lp == 0.0 for s in segs for lp, m in zip(s.logprobs, s.mask) if m == 0)
    turns = segs[-1].turns  # the whole trajectory's
    assert turns.turns == int(mask[0] == 1) + int(np.sum(np.diff(mask) == 1))
    assert turns.tool_calls == int(np.sum(np.diff(mask) == -1))
  # The old weights would not have given the resumed tokens these logprobs.
  assert max(_trainer_error(old, s) for s in second + third) > 1e-2


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
  gen = GeneratorInstance(policy_dir, max_num_seqs=8, max_model_len=160, seed=0)
  loop = AgentStream(gen, env)
  try:
    t0 = time.monotonic()
    samples = list(loop.generate(_requests(), SAMPLING, seed=0))
    took = time.monotonic() - t0
  finally:
    loop.close()
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
  # While only tool calls were out the engine sat idle: those seconds are split among the
  # trajectories that waited (`env/engine_idle_s`), and the hung call's took at least a share.
  idle = [s.turns.idle_s for s in samples]
  assert 0 < sum(idle) <= took
  assert max(s.turns.idle_s for s, t in zip(samples, texts) if "(error timeout)" in t) > 0.05


def test_the_chat_templates_extra_variables_reach_the_agent_loops_tokenizer(calc_engine):
  """`task.chat_template_kwargs` (e.g. Qwen3's enable_thinking) render the observations too."""
  env = Env(name="calc", max_turns=3, max_tokens_per_turn=24)
  loop = AgentStream(calc_engine.loop.engine, env, chat_template_kwargs={"enable_thinking": False})
  try:
    assert loop.loop.tools.tokenizer.chat_template_kwargs == {"enable_thinking": False}
  finally:
    loop.close()
