"""Environments and tools without an engine: the calculator, the sandbox's limits,
tool workers that hang or crash, trajectories and the agentic task's data."""

import textwrap
import time

import numpy as np
import pytest

from streamrl.config import settings
from streamrl.data import calc, tasks
from streamrl.data import tokenizer as tok
from streamrl.envs import base, runner, tools
from streamrl.envs.config import Env
from streamrl.errors import UserError
from streamrl.generator.rollout import Sample, TurnStats
from streamrl.trainer import experience

pytestmark = [pytest.mark.unit]


def test_the_calc_tool_does_one_operation_per_call():
  assert tools.TOOLS["calc"] is tools.step_calculator
  steps, expr = [], "(2+3)*4-1"
  while not expr.lstrip("-").isdigit():
    expr = tools.step_calculator(expr)
    steps.append(expr)
  assert steps == ["5*4-1", "20-1", "19"]
  assert tools.step_calculator("4821+3377+1234") == "8198+1234"
  assert tools.step_calculator("3*-5") == "-15"
  assert tools.step_calculator("2.5*2+1") == "5+1"
  with pytest.raises(tools.ToolError, match="power too large"):
    tools.step_calculator("1+9**9**9")  # the whole expression is checked, not only the step


def test_the_calculator_does_arithmetic_and_nothing_else():
  assert tools.calculator("4821+3377") == "8198"
  assert tools.calculator("(2+3)*4-1") == "19"
  assert tools.calculator("7/2") == "3.5"
  assert tools.calculator("6/3") == "2"
  for bad, why in [
      ("9**9**9", "power too large"),
      ("1/0", "division by zero"),
      ("__import__('os')", "not arithmetic"),
      ("a+1", "not arithmetic"),
      ("1+", "bad expression"),
      ("9" * 70 + "*2", "result too large"),
  ]:
    with pytest.raises(tools.ToolError, match=why):
      tools.calculator(bad)


def test_the_sandbox_runs_code_within_its_limits(tmp_path):
  assert tools.python_sandbox("print(6*7)", 10) == "42"
  t0 = time.monotonic()
  with pytest.raises(tools.ToolError):
    tools.python_sandbox("while True: pass", 1.0)
  assert time.monotonic() - t0 < 5
  with pytest.raises(tools.ToolError, match="MemoryError"):
    tools.python_sandbox("x = bytearray(4 << 30)", 10)
  # Its own empty working directory, nothing of ours in its environment.
  assert tools.python_sandbox("import os; print(len(os.listdir('.')))", 10) == "0"
  assert "STREAMRL" not in tools.python_sandbox("import os; print(sorted(os.environ))", 10)
  with pytest.raises(tools.ToolError):
    tools.python_sandbox("import socket; socket.create_connection(('127.0.0.1', 22), 2)", 10)


def test_tool_envs_answer_calls_and_report_errors():
  env = base.ToolEnv()
  state = env.reset("add:1+2=")
  step = env.step(state, "let me [calc 12+30]")
  assert (step.observation, step.tool_error, step.state["calls"]) == ("(42)", False, 1)
  assert env.step(state, "no call here").observation == "(error no tool call)"
  assert env.step(state, "[what 1]").observation == "(error unknown tool what)"
  assert base.CalcEnv().step(state, "[py print(1)]").tool_error
  assert base.parse_call("x [calc 1+2]") == ("calc", "1+2")
  assert base.parse_call("[calc 1+2] more") is None


HOSTILE = textwrap.dedent("""
    import os, time
    from streamrl.envs.base import CalcEnv, Step

    class Hostile(CalcEnv):
      def step(self, state, action):
        if "hang" in action:
          time.sleep(600)
        if "crash" in action:
          os._exit(3)
        if "raise" in action:
          raise RuntimeError("boom")
        return super().step(state, action)
    """)


def _traj(text):
  t = runner.Trajectory(0, (tok.BOS_ID,))
  t.add_turn(tok.encode(text), [-0.5] * len(text))
  return t


def test_tool_workers_cut_a_hang_survive_a_crash_and_keep_serving(tmp_path):
  path = tmp_path / "hostile.py"
  path.write_text(HOSTILE)
  tools_ = runner.ToolRunner(
      Env(name=f"{path}:Hostile", tool_timeout_s=1.0, tool_workers=1),
      tok.Tokenizer(_tiny(tmp_path)),
  )
  try:
    t0 = time.monotonic()
    results = {}
    for action in ("[calc hang]", "[calc crash]", "[calc raise]", "[calc 2+2]"):
      traj = _traj(action)
      results[action] = (traj, tools_.submit(traj).result(timeout=30))
    assert time.monotonic() - t0 < 20
    obs = {a: s.observation for a, (_, s) in results.items()}
    assert obs == {
        "[calc hang]": "(error timeout)",
        "[calc crash]": "(error tool failed)",
        "[calc raise]": "(error tool failed)",
        "[calc 2+2]": "(4)",
    }
    assert results["[calc hang]"][1].timed_out
    traj, step = results["[calc 2+2]"]
    ids = tools_.apply(traj, step)
    traj.add_observation(ids)
    assert tok.decode(traj.tokens) == "[calc 2+2](4)"
    assert traj.mask == [1] * 10 + [0] * 3 and traj.logprobs[-3:] == [0.0] * 3
    assert traj.tool_calls == 1 and traj.state == {"calls": 1}
  finally:
    tools_.close()


def test_a_slow_remote_tools_latency_holds_no_worker(tmp_path):
  # 6 calls of 0.4 s extra latency on one worker: they wait out their latency together.
  tools_ = runner.ToolRunner(
      Env(name="calc", tool_workers=1, extra_tool_latency_s=0.4), tok.Tokenizer(_tiny(tmp_path))
  )
  try:
    tools_.submit(_traj("[calc 1+1]")).result(timeout=30)  # the worker is up
    t0 = time.monotonic()
    trajs = [_traj(f"[calc {i}+1]") for i in range(6)]
    steps = [f.result(timeout=30) for f in [tools_.submit(t) for t in trajs]]
    took = time.monotonic() - t0
    assert [s.observation for s in steps] == [f"({i + 1})" for i in range(6)]
    assert 0.4 <= took < 1.5, took  # one latency, not six
    assert all(t.tool_s >= 0.4 for t in trajs)
  finally:
    tools_.close()


def _tiny(tmp_path):
  d = tmp_path / "tok"
  tok.save_hf_tokenizer(str(d))
  return str(d)


def test_a_stop_string_of_several_tokens_is_refused(tmp_path):
  path = tmp_path / "env.py"
  path.write_text("from streamrl.envs.base import CalcEnv\nclass Long(CalcEnv):\n  stop = 'end]'\n")
  with pytest.raises(UserError, match="one token"):
    runner.ToolRunner(Env(name=f"{path}:Long"), tok.Tokenizer(_tiny(tmp_path)))


def test_observation_tokens_are_left_out_of_the_loss():
  s = Sample(
      prompt_id=0,
      prompt_token_ids=(1, 5, 6),
      token_ids=(7, 8, 9, 10, 11),
      logprobs=(-1.0, -1.0, 0.0, 0.0, -1.0),
      finish_reason="stop",
      weight_version=0,
      instance_id=0,
      mask=(1, 1, 0, 0, 1),
      turns=TurnStats(turns=2, tool_calls=1),
  )
  batch = experience.pad_samples([s])
  np.testing.assert_array_equal(batch["mask_bt"][0, 2:7], [1, 1, 0, 0, 1])
  assert batch["mask_bt"][0].sum() == 3
  metrics = runner.trajectory_metrics([s])
  assert metrics["env/turns_mean"] == 2 and metrics["env/observation_tokens"] == 2
  assert (
      runner.trajectory_metrics([s.__class__(**{**s.__dict__, "mask": None, "turns": None})]) == {}
  )


def test_the_sums_need_the_tool_and_their_trajectories_solve_them():
  cfg = calc.CalcConfig()
  examples = calc.make_examples(2000, 0, cfg)
  assert examples == calc.make_examples(2000, 0, cfg)
  terms = [len(calc.terms_of(e.prompt)) for e in examples]
  assert min(terms) == 2 and max(terms) == cfg.max_terms
  assert np.mean(terms) == pytest.approx(2 + 0.9, abs=0.15)  # long-tailed, capped
  env = base.CalcEnv()
  for e in examples[:50]:
    text = calc.tool_trajectory(calc.terms_of(e.prompt))
    assert tasks.final_answer(text) == e.answer
    assert text.count("[calc ") == len(calc.terms_of(e.prompt)) - 1
    tok.encode(e.prompt + text)  # in the tiny tokenizer's characters
    # Replayed through the real calculator: every observation is the one it answers.
    state, rest = env.reset(e.prompt), text
    while rest.startswith("[calc"):
      call, rest = rest.split("]", 1)
      step = env.step(state, call + "]")
      assert rest.startswith(step.observation), (text, step.observation)
      state, rest = step.state, rest[len(step.observation) :]
    assert rest == f"#{e.answer}"
  rng = np.random.default_rng(0)
  targets = [calc.sft_target(e, rng, cfg) for e in examples]
  share = np.mean([t[0][0].startswith("[calc") for t in targets])
  assert share == pytest.approx(cfg.tool_fraction, abs=0.04)


def test_the_warm_up_trains_the_policys_turns_not_the_tools_answers():
  from streamrl.trainer import sft, warmstart  # pylint: disable=g-import-not-at-top
  from streamrl.trainer.config import Warmstart  # pylint: disable=g-import-not-at-top

  cfg = calc.CalcConfig(tool_fraction=0.25, tool_steps=30)
  examples = calc.make_examples(400, 0, cfg)
  phases = warmstart.warmup_phases(Warmstart(steps=50), examples, seed=0, calc=cfg)
  assert [n for n, _ in phases] == [30, 20]
  (_, tool_only), (_, mixture) = phases
  assert all(tok.decode(a).startswith("[calc ") for _, a, _ in tool_only)
  assert np.mean([tok.decode(a).startswith("[calc ") for _, a, _ in mixture]) == pytest.approx(
      0.25, abs=0.07
  )
  p, a, mask = tool_only[0]
  text = tok.decode(a)
  assert len(mask) == len(a) and mask[-1] == 1.0  # EOS is trained
  # Exactly the calculator's answers "(...)" are masked.
  masked = "".join(ch for ch, m in zip(text, mask) if not m)
  assert masked == "".join(
      t for t, policy in calc.tool_segments(calc.terms_of(examples[0].prompt)) if not policy
  )
  batch = sft.sft_arrays([(p, a, mask)], len(p) + len(a))
  # Position t predicts token t + 1: the loss mask is the answer mask shifted by the prompt.
  np.testing.assert_array_equal(batch["mask_bt"][0, len(p) - 1 : len(p) + len(a) - 1], mask)
  assert batch["mask_bt"][0, : len(p) - 1].sum() == 0
  with pytest.raises(ValueError, match="mask"):
    sft.sft_arrays([(p, a, mask[:-1])], len(p) + len(a))
  # A bare answer is trained whole.
  _, a, mask = next(x for x in mixture if tok.decode(x[1]).startswith("#"))
  assert mask == [1.0] * len(a)
  # Without tool steps: one phase, the mixture.
  only = warmstart.warmup_phases(Warmstart(steps=50), examples, seed=0, calc=calc.CalcConfig())
  assert [n for n, _ in only] == [50]


def test_env_settings_are_checked():
  c = settings.default_config()
  c.env.name = "calc"
  c.task.kind = "calc"
  c.pipeline.mode = "async"
  c.pipeline.partial = "auto"  # on in async mode, trajectories too
  s = settings.from_config(c)
  assert s.env.enabled and s.partial_rollouts
  c.env.name = "nope"
  with pytest.raises(UserError, match="env.name='nope' is unknown"):
    settings.from_config(c)
  c.env.name = "calc"
  c.env.max_tokens_per_turn = 10_000
  with pytest.raises(UserError, match="max_tokens_per_turn"):
    settings.from_config(c)
