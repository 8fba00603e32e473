"""Plan configs end to end (launch/plan.py's library path)."""

import importlib.util
import os

import pytest

from streamrl.planner.run import run_plan

pytestmark = [pytest.mark.unit]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(name):
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(ROOT, "configs", "plan", f"{name}.py")
  )
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  c = mod.get_config()
  c.batch_size = 128  # keep the test fast
  c.lengths.max_output = 4096
  c.simulate_iterations = 2
  return c


@pytest.mark.parametrize("name", ["qwen7b_single_dc", "hetero_h20_h800", "qwen72b_128"])
def test_configs_plan_and_predict(name):
  r = run_plan(_config(name))
  assert "chosen:" in r.text and "runner-up options:" in r.text
  assert r.mode in ("stream", "async")
  assert r.predicted["async"] >= r.predicted["stream"] > 0
  best = r.result.best
  assert best.gen_gpus + best.train_gpus <= sum(p["num_gpus"] for p in _config(name).cluster.pools)


def test_bad_configs():
  c = _config("qwen7b_single_dc")
  c.request.main = 64
  with pytest.raises(ValueError, match="only 32 exist"):
    run_plan(c)
  c = _config("qwen7b_single_dc")
  c.cluster.pools = (dict(name="main", gpu="B300", num_gpus=32),)
  with pytest.raises(ValueError, match="no cost model"):
    run_plan(c)
  for outs in ([], [100, -5]):
    c = _config("qwen7b_single_dc")
    c.lengths = dict(kind="empirical", output_lens=outs, prompt_len=64)
    with pytest.raises(ValueError, match="length"):
      run_plan(c)


def test_a_plan_for_an_agentic_workload_counts_its_tool_calls():
  import ml_collections  # pylint: disable=g-import-not-at-top

  plain = run_plan(_config("qwen7b_single_dc"))
  c = _config("qwen7b_single_dc")
  c.tools = ml_collections.ConfigDict(
      {"latency_s": 2.0, "turn_tokens": 256, "observation_tokens": 64}
  )
  agentic = run_plan(c)
  # Every trajectory longer than a turn waits on tools: less throughput in every mode.
  for mode in ("stream", "async"):
    assert 0 < agentic.predicted[mode] < plain.predicted[mode]


def test_a_plan_with_a_shared_work_pool_simulates_it():
  fixed = run_plan(_config("qwen7b_single_dc"))
  c = _config("qwen7b_single_dc")
  c.pool = "shared"
  shared = run_plan(c)
  for mode in ("stream", "async"):
    assert shared.predicted[mode] > 0
  assert shared.predicted != fixed.predicted
  c.migrate = True
  moved = run_plan(c)
  assert moved.predicted != shared.predicted
  c.pool = "fixed"
  with pytest.raises(ValueError, match="shared pool"):
    run_plan(c)
  c.pool, c.migrate = "bogus", False
  with pytest.raises(ValueError, match="pool must be one of"):
    run_plan(c)
