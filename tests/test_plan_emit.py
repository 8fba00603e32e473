"""Planner -> run: plan files (streamrl/planner/emit.py), launch/main.py --plan,
and measured costs (launch/measure.py, calibration.measured) in the planner.

Nothing here trains: the launch scripts run as subprocesses that stop at a
user error before any engine, Ray or JAX starts (launch/measure.py, which
starts one engine and one trainer for ~45 s, is the exception and is marked
slow).
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from streamrl import cluster, errors, experiment
from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.planner import emit
from streamrl.planner.allocation import StageEstimator, plan
from streamrl.planner.run import (
    load_measured,
    lengths_from_config,
    plan_with,
    pools_from_config,
    run_plan,
)

pytestmark = [pytest.mark.unit]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "plan", "*.py")))
MAIN = os.path.join(ROOT, "launch", "main.py")
PLAN = os.path.join(ROOT, "launch", "plan.py")
MEASURE = os.path.join(ROOT, "launch", "measure.py")


def _plan_config(path, **calibration):
  c = config_lib.load_config(path)
  c.batch_size = 128  # keep the tests fast
  c.lengths.max_output = 4096
  c.simulate_iterations = 2
  for k, v in calibration.items():
    c.calibration[k] = v
  return c


def _ppo():
  return config_lib.load_config(os.path.join(ROOT, "configs", "ppo.py"))


def _costs(*, ptl=(0.01, 0.012, 0.02), fwd=1e-6, upd=4e-6, tp=1, devices=1) -> dict:
  """A small synthetic launch/measure.py file."""
  return {
      "format": "streamrl.costs/1",
      "profile": {"batch_sizes": [1, 8, 64], "ptl_s": list(ptl), "prefill_s_per_token": 1e-5},
      "trainer": {"fwd_s_per_token": fwd, "upd_s_per_token": upd, "devices": devices, "name": "t"},
      "generation": {"device": "test", "tensor_parallel_size": tp, "max_num_seqs": 64},
  }


def _run(args, **env):
  full = {k: v for k, v in os.environ.items() if k not in (errors.DEBUG_ENV, "XLA_FLAGS")}
  full.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env)
  return subprocess.run(
      [sys.executable, *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300
  )


def _one_line_error(res, *needles):
  assert res.returncode == 2, (res.returncode, res.stdout, res.stderr[-2000:])
  lines = res.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
  for n in needles:
    assert n in lines[0], lines[0]


# ------------------------------------------------------------------ emitting


def test_plan_configs_are_all_covered():
  names = {os.path.basename(p)[:-3] for p in PLAN_CONFIGS}
  assert {"qwen7b_single_dc", "hetero_h20_h800", "qwen72b_128"} <= names
  for p in PLAN_CONFIGS:
    assert config_lib.load_config(p).calibration.measured == ""  # paper costs by default


@pytest.fixture(scope="module")
def reports():
  return {p: run_plan(_plan_config(p)) for p in PLAN_CONFIGS}


@pytest.mark.parametrize("target", emit.TARGETS)
@pytest.mark.parametrize("path", PLAN_CONFIGS, ids=lambda p: os.path.basename(p)[:-3])
def test_emitted_overrides_validate_on_ppo(path, target, reports, tmp_path, monkeypatch):
  monkeypatch.chdir(ROOT)  # ranker config paths are relative to the checkout
  report = reports[path]
  b = report.result.best
  out = emit.build_plan(report, target=target, max_instances=2, source=path)
  emit.write_plan(out, str(tmp_path / "plan.json"))
  loaded = emit.load_plan(str(tmp_path / "plan.json"))
  assert loaded == json.loads(json.dumps(out))
  assert set(loaded) == {"plan", "overrides"}
  o, p = loaded["overrides"], loaded["plan"]
  # Only existing settings keys, and the run config accepts every value.
  s = settings.from_config(config_lib.apply_overrides(_ppo(), o))
  # The readable part always describes the GPU plan.
  assert p["target"] == target and p["mode"] == report.mode == s.pipeline.mode
  assert p["generation"]["gpus"] == b.gen_gpus and p["training"]["gpus"] == b.train_gpus
  assert p["generation"]["gpu"] == b.gen_gpu and p["training"]["gpu"] == b.train_gpu
  assert p["generation"]["instances"] * p["generation"]["tensor_parallel_size"] == b.gen_gpus
  assert p["cross_dc"] == b.cross_dc and p["cost_model"] == "paper"
  assert p["predicted_samples_per_s"][report.mode] > 0
  lt = p["long_tail"]
  assert lt["long_tail_instances"] + lt["regular_instances"] == p["generation"]["instances"]
  mesh = p["training"]["mesh"]
  assert mesh["data"] * mesh["fsdp"] * mesh["tensor"] == b.train_gpus
  assert b.train_gpus % p["training"]["processes"] == 0
  assert s.scheduler.kind == "skew" and s.scheduler.long_tail_alpha == lt["alpha"]
  assert s.transfer.enabled and s.transfer.topology == p["transfer"]["topology"]
  assert s.transfer.delta_cross_dc == b.cross_dc
  if target == "gpu":
    e, c = s.engine, s.cluster
    assert e.num_instances == p["generation"]["instances"]
    assert e.gpus_per_instance == e.tensor_parallel_size == report.tp
    assert c.trainer_gpus == b.train_gpus and s.mesh.axes() == mesh
    assert s.gpus_needed == b.gen_gpus + b.train_gpus
    gen, train = cluster.parse_labels(c.generation_labels), cluster.parse_labels(c.training_labels)
    assert gen == {"datacenter": p["generation"]["datacenter"], "accelerator": b.gen_gpu}
    assert train == {"datacenter": p["training"]["datacenter"], "accelerator": b.train_gpu}
    assert "cpu_stand_in" not in p
  else:
    assert s.engine.gpus_per_instance == 0 and s.engine.tensor_parallel_size == 1
    assert s.cluster.trainer_gpus == 0 and s.cluster.trainer_processes == 1
    assert s.mesh.fsdp == -1 and s.gpus_needed == 0
    assert 1 <= s.engine.num_instances == min(2, p["generation"]["instances"])
    assert s.cluster.generation_labels == s.cluster.training_labels == ""
    scaled = p["cpu_stand_in"]["scaled"]
    assert scaled["engine.num_instances"]["plan"] == p["generation"]["instances"]
    assert scaled["cluster.trainer_gpus"] == {"plan": b.train_gpus, "emitted": 0}


def test_cpu_target_keeps_at_least_one_instance(reports):
  report = reports[PLAN_CONFIGS[0]]
  n = report.result.best.gen_gpus // report.tp
  for cap, want in ((1, 1), (3, min(3, n)), (10_000, n)):
    o = emit.build_plan(report, target="cpu", max_instances=cap)["overrides"]
    assert o["engine.num_instances"] == want
  with pytest.raises(errors.UserError, match="max_instances"):
    emit.build_plan(report, target="cpu", max_instances=0)
  with pytest.raises(errors.UserError, match="emit_target"):
    emit.build_plan(report, target="tpu")


def test_trainer_layout_rules():
  from streamrl.sim import hardware

  h800 = hardware.get_gpu("H800")
  assert emit.trainer_processes(16, 8) == 2 and emit.trainer_processes(8, 8) == 1
  assert emit.trainer_processes(20, 8) == 4  # 3 machines' worth, split evenly over 4
  m7 = hardware.get_model("qwen2.5-7b")
  assert emit.trainer_mesh(m7, h800, 16, 2) == {"data": 2, "fsdp": 8, "tensor": 1}
  # 72B: the state of actor + critic + reference needs FSDP over all 48 GPUs.
  m72 = hardware.get_model("qwen2.5-72b")
  assert emit.trainer_mesh(m72, h800, 48, 6) == {"data": 1, "fsdp": 48, "tensor": 1}


# ------------------------------------------------------------------ applying


def _plan_file(tmp_path, overrides, name="plan.json"):
  path = tmp_path / name
  path.write_text(json.dumps({"plan": {"note": "test"}, "overrides": overrides}))
  return str(path)


def test_command_line_overrides_win_over_the_plan(tmp_path):
  path = _plan_file(
      tmp_path,
      {"pipeline.mode": "async", "engine.num_instances": 2, "transfer.enabled": True},
  )
  p = emit.load_plan(path)
  for cli in (
      {"pipeline.mode": "sync", "optimizer.lr": 1e-4},
      ["pipeline.mode=sync", "optimizer.lr=1e-4"],
  ):
    merged = emit.apply_plan(_ppo(), p, cli, path=path)
    s = settings.from_config(merged, check_files=False)
    assert s.pipeline.mode == "sync"  # the command line's
    assert s.engine.num_instances == 2 and s.transfer.enabled  # the plan's
    assert s.optimizer.lr == 1e-4
  # Without command-line overrides the plan's values stand; the input is untouched.
  base = _ppo()
  base.pipeline.mode = "sync"
  merged = emit.apply_plan(base, p, path=path)
  assert merged.pipeline.mode == "async" and base.pipeline.mode == "sync"


def test_bad_plan_files(tmp_path):
  missing = str(tmp_path / "nope.json")
  with pytest.raises(errors.MissingFileError, match="does not exist; write one with"):
    emit.load_plan(missing)
  with pytest.raises(errors.UserError, match="is a directory"):
    emit.load_plan(str(tmp_path))
  cases = {
      "trunc.json": ('{"overrides": ', "not valid JSON"),
      "list.json": ("[1, 2]", 'no "overrides" object'),
      "no_overrides.json": ('{"plan": {}}', 'no "overrides" object'),
      "overrides_list.json": ('{"overrides": [["pipeline.mode", "async"]]}', 'no "overrides"'),
      "plan_str.json": ('{"plan": "x", "overrides": {}}', '"plan" part must be an object'),
  }
  for name, (text, message) in cases.items():
    (tmp_path / name).write_text(text)
    with pytest.raises(errors.UserError, match=message):
      emit.load_plan(str(tmp_path / name))
  unknown = emit.load_plan(_plan_file(tmp_path, {"optimizer.lrr": 1e-4}, "unknown.json"))
  with pytest.raises(
      errors.UserError, match=r"'optimizer.lrr', which is not a StreamRL .*optimizer.lr\?"
  ):
    emit.apply_plan(_ppo(), unknown, path="unknown.json")
  group = emit.load_plan(_plan_file(tmp_path, {"trainer": 1}, "group.json"))
  with pytest.raises(errors.UserError, match="not a StreamRL setting"):
    emit.apply_plan(_ppo(), group, path="group.json")
  typed = emit.load_plan(_plan_file(tmp_path, {"engine.num_instances": "two"}, "typed.json"))
  with pytest.raises(errors.UserError, match="engine.num_instances.*fix that value"):
    emit.apply_plan(_ppo(), typed, path="typed.json")


def test_record_plan_copies_the_file_and_validates(tmp_path, monkeypatch):
  path = _plan_file(tmp_path, {"pipeline.mode": "async", "engine.num_instances": 2}, "emitted.json")
  workdir = tmp_path / "w"
  workdir.mkdir()
  config = emit.apply_plan(_ppo(), emit.load_plan(path), {"optimizer.lr": 1e-4}, path=path)
  monkeypatch.chdir(ROOT)  # ranker config paths are relative to the checkout
  s = experiment.record_plan(path, str(workdir), config)
  assert s.pipeline.mode == "async" and s.engine.num_instances == 2 and s.optimizer.lr == 1e-4
  assert (workdir / "plan.json").read_bytes() == open(path, "rb").read()
  experiment.record_plan(str(workdir / "plan.json"), str(workdir), config)  # the same file: fine
  bad = config_lib.apply_overrides(config, {"pipeline.mode": "colocated"})
  os.remove(workdir / "plan.json")
  with pytest.raises(errors.UserError, match="num_instances"):
    experiment.record_plan(path, str(workdir), bad)
  assert not (workdir / "plan.json").exists()  # nothing copied for a refused config


@pytest.mark.e2e
def test_main_reports_plan_errors_in_one_line(tmp_path):
  wd = tmp_path / "wd"
  missing = str(tmp_path / "nope.json")
  _one_line_error(
      _run([MAIN, "--config=configs/ppo.py", f"--plan={missing}", f"--workdir={wd}"]),
      f"--plan={missing} does not exist",
      "launch/plan.py",
  )
  unknown = _plan_file(tmp_path, {"generation.num_instance": 2}, "unknown.json")
  _one_line_error(
      _run([MAIN, "--config=configs/ppo.py", f"--plan={unknown}", f"--workdir={wd}"]),
      "'generation.num_instance', which is not a StreamRL setting",
      "did you mean engine.num_instances?",
  )
  assert not wd.exists()
  # The plan's two instances and the command line's mode (it wins) meet in
  # settings' check, which fails before anything is written, the workdir too.
  two = _plan_file(tmp_path, {"pipeline.mode": "async", "engine.num_instances": 2}, "two.json")
  res = _run(
      [
          MAIN,
          "--config=configs/ppo.py",
          f"--plan={two}",
          f"--workdir={wd}",
          "--config.pipeline.mode=colocated",
      ]
  )
  _one_line_error(res, "pipeline.mode='colocated'", "engine.num_instances=1", "for 2")
  assert not wd.exists()


@pytest.mark.e2e
def test_plan_script_emits_both_targets(tmp_path):
  cfg = "configs/plan/qwen7b_single_dc.py"
  small = ["--config.batch_size=128", "--config.lengths.max_output=4096"]
  for target in emit.TARGETS:
    out = tmp_path / f"{target}.json"
    res = _run([PLAN, f"--config={cfg}", f"--emit={out}", f"--emit_target={target}", *small])
    assert res.returncode == 0, res.stderr[-2000:]
    assert "cost models: paper" in res.stdout and f"wrote {out}" in res.stdout
    p = json.loads(out.read_text())
    assert p["plan"]["source"] == cfg and p["plan"]["target"] == target
  res = _run([PLAN, f"--config={cfg}", f"--emit={tmp_path}", *small])
  _one_line_error(res, "is a directory")
  res = _run([PLAN, f"--config={cfg}", "--config.calibration.measured=/nonexistent/costs.json"])
  _one_line_error(res, "calibration.measured", "launch/measure.py")


# ------------------------------------------------------------- measured costs


def test_plan_with_chooses_as_allocation_plan():
  c = _plan_config(os.path.join(ROOT, "configs", "plan", "hetero_h20_h800.py"))
  report = run_plan(c)
  w, pools = report.workload, list(report.pools)
  budgets = dict(c.request)
  ours = plan_with(pools, StageEstimator(w), objective="throughput", unit=8, budgets=budgets)
  theirs = plan(pools, w, objective="throughput", unit=8, budgets=budgets)
  assert ours == theirs


def test_measured_costs_drive_the_planner(tmp_path):
  path = os.path.join(ROOT, "configs", "plan", "qwen7b_single_dc.py")
  fixed = dict(kind="fixed", prompt_len=64, output_len=256)

  def run(costs):
    f = tmp_path / "costs.json"
    f.write_text(json.dumps(costs))
    c = _plan_config(path, measured=str(f))
    c.lengths = fixed
    return run_plan(c)

  paper = _plan_config(path)
  paper.lengths = fixed
  paper = run_plan(paper)
  assert paper.cost_model == "paper" and "cost models: paper" in paper.text
  # Slow generation, cheap training: most GPUs generate, in TP2 instances.
  slow_gen = run(_costs(ptl=(0.05, 0.06, 0.1), fwd=1e-9, upd=1e-9, tp=2))
  b = slow_gen.result.best
  assert slow_gen.cost_model.startswith("measured") and "cost models: measured" in slow_gen.text
  assert b.gen_gpus > b.train_gpus and slow_gen.tp == 2
  o = emit.build_plan(slow_gen)["overrides"]
  assert o["engine.gpus_per_instance"] == 2 and o["engine.num_instances"] == b.gen_gpus // 2
  assert emit.build_plan(slow_gen)["plan"]["cost_model"] == slow_gen.cost_model
  # Fast generation, costly training: most GPUs train.
  slow_train = run(_costs(ptl=(1e-4, 1.2e-4, 2e-4), fwd=1e-3, upd=4e-3))
  b2 = slow_train.result.best
  assert b2.train_gpus > b2.gen_gpus
  # The measured trainer's devices: 4 devices measured = 4x the work per GPU.
  one = load_measured(_costs(devices=1)).train
  four = load_measured(_costs(devices=4)).train
  assert four.upd_s_per_token == pytest.approx(4 * one.upd_s_per_token)
  assert slow_train.result.best.t_train == pytest.approx(
      run(_costs(ptl=(1e-4, 1.2e-4, 2e-4), fwd=1e-3 / 4, upd=1e-3, devices=4)).result.best.t_train
  )


def test_bad_measured_costs(tmp_path):
  with pytest.raises(FileNotFoundError, match="launch/measure.py"):
    load_measured(str(tmp_path / "nope.json"))
  (tmp_path / "bad.json").write_text("{")
  with pytest.raises(ValueError, match="not valid JSON"):
    load_measured(str(tmp_path / "bad.json"))
  with pytest.raises(ValueError, match="'profile'"):
    load_measured({"trainer": {}})
  with pytest.raises(ValueError, match="missing"):
    load_measured({"profile": _costs()["profile"], "trainer": {"fwd_s_per_token": 1.0}})


@pytest.mark.e2e
@pytest.mark.slow
def test_measure_script_writes_costs_the_planner_reads(tmp_path):
  out = tmp_path / "costs.json"
  small = [
      "--config.warmstart.steps=0",
      "--config.warmstart.num_examples=100",
      "--config.task.num_eval=0",
      "--config.trainer.prompts_per_iteration=8",
      "--config.trainer.mini_batch_size=8",
      "--config.trainer.micro_batch_size=8",
      "--config.trainer.ppo_epochs=1",
      "--config.sampling.max_tokens=16",
      "--config.engine.max_num_seqs=4",
      "--config.engine.max_model_len=64",
  ]
  res = _run(
      [
          MEASURE,
          "--config=configs/ppo.py",
          f"--out={out}",
          f"--workdir={tmp_path / 'wd'}",
          "--reps=1",
          "--max_batch=2",
          *small,
      ]
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert "RESULT ptl_bs1_ms=" in res.stdout
  costs = json.loads(out.read_text())
  assert costs["profile"]["batch_sizes"] == [1, 2] and all(x > 0 for x in costs["profile"]["ptl_s"])
  t = costs["trainer"]
  assert t["fwd_s_per_token"] > 0 and t["upd_s_per_token"] > 0 and t["devices"] == 1
  assert costs["generation"]["device"] == "cpu" and costs["generation"]["max_num_seqs"] == 4
  # configs/ppo.py's skew scheduler refreshes its ranker after every round: timed too.
  assert costs["ranker"]["refresh_s"] > 0 and costs["ranker"]["steps"] > 0
  c = _plan_config(os.path.join(ROOT, "configs", "plan", "qwen7b_single_dc.py"), measured=str(out))
  c.lengths = dict(kind="fixed", prompt_len=16, output_len=32)
  report = run_plan(c)
  assert report.cost_model.startswith(f"measured ({out})") and report.predicted[report.mode] > 0


@pytest.mark.e2e
def test_a_planned_run_end_to_end(tmp_path):
  """plan.py --emit (CPU stand-in of the 7B plan) then main.py --plan: the
  run uses the planned split, and placement.json shows it."""
  plan_path = str(tmp_path / "plan.json")
  res = _run(
      [
          "launch/plan.py",
          "--config=configs/plan/qwen7b_single_dc.py",
          f"--emit={plan_path}",
          "--emit_target=cpu",
      ]
  )
  assert res.returncode == 0, res.stderr[-2000:]
  with open(plan_path) as f:
    planned = json.load(f)
  workdir = str(tmp_path / "run")
  tiny = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())
  tiny["trainer.num_iterations"] = 1  # The split is what is checked, not training.
  res = _run(
      [
          "launch/main.py",
          "--config=configs/ppo.py",
          f"--plan={plan_path}",
          f"--workdir={workdir}",
          # Flags win over the plan: leave the plan's keys to it.
          *[f"--config.{k}={v}" for k, v in tiny.items() if k not in planned["overrides"]],
      ]
  )
  assert res.returncode == 0, res.stderr[-3000:]
  with open(os.path.join(workdir, "placement.json")) as f:
    placement = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  o = planned["overrides"]
  assert len(placement["generators"]) == o["engine.num_instances"] >= 1
  assert placement["plan"] == planned["plan"]
  assert config["pipeline"]["mode"] == o["pipeline.mode"]
  assert config["scheduler"]["kind"] == o["scheduler.kind"] == "skew"
  assert config["transfer"]["enabled"] is True
