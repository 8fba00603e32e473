"""The launch scripts' command line: one-line flag errors, launch/sweep.py, the compile cache."""

import json
import os
import subprocess
import sys

import pytest

from streamrl import cli
from tests.config.test_overrides import CONFIG_PY, SWEEP_PY

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


LAUNCHER_PY = """
import json, sys
from absl import app
from streamrl.cli import define_config_file, parse_flags_or_exit

CONFIG = define_config_file("config", {default!r}, "config file")

def main(argv):
  c = CONFIG.value
  print(json.dumps({{"lr": c.trainer.lr, "mesh": list(c.trainer.mesh), "critic": c.algo.use_critic}}))

app.run(main, flags_parser=parse_flags_or_exit)
"""


def _run(args, cwd, extra_path=()):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, *extra_path]), JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
  )


@pytest.mark.e2e
@pytest.mark.parametrize("default", [None, "cfg.py"])
def test_launcher_reports_bad_overrides_in_one_line(tmp_path, default):
  (tmp_path / "cfg.py").write_text(CONFIG_PY)
  (tmp_path / "launch.py").write_text(LAUNCHER_PY.format(default=default))
  cfg = [] if default else ["--config=cfg.py"]
  ok = _run(
      [
          "launch.py",
          *cfg,
          "--config.trainer.lr=3e-6",
          "--config.trainer.mesh=(2, 4)",
          "--noconfig.algo.use_critic",
      ],
      tmp_path,
  )
  assert ok.returncode == 0, ok.stderr
  assert json.loads(ok.stdout) == {"lr": 3e-6, "mesh": [2, 4], "critic": False}
  cases = [
      (
          [*cfg, "--config.trainer.nope=1"],
          "error: --config: unknown config key 'trainer.nope'; the keys under "
          "trainer are: lr, mesh, num_iterations.",
      ),
      (
          [*cfg, "--config.traner.lr=1"],
          "error: --config: unknown config key 'traner.lr'; did you mean trainer.lr?",
      ),
      (
          [*cfg, "--config.trainer.lr=abc"],
          "error: --config: cannot set trainer.lr to 'abc': it expects a float",
      ),
      (
          [*cfg, "--config.trainer.num_iterations=1.5"],
          "error: --config: cannot set trainer.num_iterations to " "'1.5': it expects an int",
      ),
      (["--config=missing.py"], "error: config file 'missing.py' (--config) does not exist"),
      (
          ["--config=cfg.py:huge"],
          "error: config cfg.py:huge failed to build: ValueError: unknown variant 'huge'",
      ),
  ]
  for args, message in cases:
    res = _run(["launch.py", *args], tmp_path)
    assert res.returncode == 2, (args, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), (args, res.stderr)


def _sweep(tmp_path, *args):
  return _run(
      [os.path.join(REPO, "launch", "sweep.py"), *args], tmp_path, extra_path=[str(tmp_path)]
  )


@pytest.mark.e2e
def test_sweep_dry_run_plans_run_dirs(tmp_path):
  (tmp_path / "cfg.py").write_text(CONFIG_PY + SWEEP_PY)
  wd = tmp_path / "wd"
  res = _sweep(
      tmp_path,
      "--config=cfg.py",
      f"--workdir={wd}",
      "--dry_run",
      "--config.trainer.num_iterations=2",
  )
  assert res.returncode == 0, res.stderr
  planned = [l.split()[1:] for l in res.stdout.splitlines() if l.startswith("  [")]
  assert [os.path.relpath(d, wd) for d, *_ in planned] == [
      "trainer.lr=1e-06,algo.kl_coef=0.0",
      "trainer.lr=1e-06,algo.kl_coef=0.01",
      "trainer.lr=3e-06,algo.kl_coef=0.0",
      "trainer.lr=3e-06,algo.kl_coef=0.01",
      "algo.name=grpo,trainer.mesh=2_4",
  ]
  assert json.loads(" ".join(planned[1][1:])) == {"trainer.lr": 1e-6, "algo.kl_coef": 0.01}
  assert not wd.exists()  # A dry run writes nothing.


RUN_FN_PY = """
import json, os
def run(config, workdir):
  os.makedirs(workdir, exist_ok=True)  # The sweep already made it (for its libraries.log).
  with open(os.path.join(workdir, "seen.json"), "w") as f:
    json.dump({"lr": config.trainer.lr, "kl": config.algo.kl_coef, "algo": config.algo.name,
               "iters": config.trainer.num_iterations, "mesh": list(config.trainer.mesh)}, f)
  with open(os.path.join(os.path.dirname(workdir), "order.txt"), "a") as f:
    f.write(os.path.basename(workdir) + "\\n")
"""


@pytest.mark.e2e
def test_sweep_runs_each_point_in_its_dir(tmp_path):
  (tmp_path / "cfg.py").write_text(CONFIG_PY + SWEEP_PY)
  (tmp_path / "fake_train.py").write_text(RUN_FN_PY)
  wd = tmp_path / "wd"
  res = _sweep(
      tmp_path,
      "--config=cfg.py:tiny",
      f"--workdir={wd}",
      "--run_fn=fake_train:run",
      "--config.seed=3",
  )
  assert res.returncode == 0, res.stderr
  order = (wd / "order.txt").read_text().split()
  assert order == [p["run"] for p in json.loads((wd / "sweep.json").read_text())]
  assert len(order) == 5
  seen = json.loads((wd / "trainer.lr=3e-06,algo.kl_coef=0.01" / "seen.json").read_text())
  assert seen == {"lr": 3e-6, "kl": 0.01, "algo": "ppo", "iters": 2, "mesh": [1, 8]}
  seen = json.loads((wd / "algo.name=grpo,trainer.mesh=2_4" / "seen.json").read_text())
  assert seen == {"lr": 1e-6, "kl": 0.0, "algo": "grpo", "iters": 2, "mesh": [2, 4]}


@pytest.mark.e2e
def test_sweep_refuses_bad_sweeps_before_running_anything(tmp_path):
  (tmp_path / "fake_train.py").write_text(RUN_FN_PY)
  (tmp_path / "nosweep.py").write_text(CONFIG_PY)
  (tmp_path / "badkey.py").write_text(
      CONFIG_PY + "\ndef get_sweep():\n  return [{'trainer.lr': [1e-6]}, " "{'trainer.lrr': 1.0}]\n"
  )
  (tmp_path / "cfg.py").write_text(CONFIG_PY + SWEEP_PY)
  wd = tmp_path / "wd"
  for args, message in [
      (["--config=nosweep.py"], "defines no get_sweep()"),
      (["--config=badkey.py"], "unknown config key 'trainer.lrr'; did you mean trainer.lr?"),
      (
          ["--config=cfg.py", "--config.trainer.lr=1e-5"],
          "--config.trainer.lr is set both on the command line " "and by the sweep",
      ),
  ]:
    res = _sweep(tmp_path, *args, f"--workdir={wd}", "--run_fn=fake_train:run")
    assert res.returncode == 2, (args, res.stdout, res.stderr)
    assert message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not wd.exists()


def test_the_compile_cache_defaults_to_the_user_cache_and_keeps_a_set_value():
  env = {"HOME_IS_NOT_READ": "1"}
  path = cli.use_compile_cache(env)
  assert env[cli.COMPILE_CACHE_ENV] == path
  assert path == os.path.join(os.path.expanduser("~"), ".cache", "streamrl", "xla")
  assert cli.use_compile_cache({cli.COMPILE_CACHE_ENV: "/x"}) == "/x"
  assert cli.use_compile_cache({cli.COMPILE_CACHE_ENV: ""}) == ""  # off
