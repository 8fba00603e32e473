"""Launch scripts: one-line user errors (and --debug tracebacks), the sweep's closing table,
and the user-input errors of the library modules being UserErrors.

The launch scripts run as subprocesses, and every case here fails (or
finishes) before any engine, Ray or JAX starts.
"""

import ast
import json
import os
import socket
import subprocess
import sys

import pytest

from streamrl import errors

pytestmark = [pytest.mark.e2e]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "launch", "main.py")
SWEEP = os.path.join(REPO, "launch", "sweep.py")


def _run(args, cwd=REPO, extra_path=(), **env):
  full_env = {k: v for k, v in os.environ.items() if k != errors.DEBUG_ENV}
  full_env.update(PYTHONPATH=os.pathsep.join([REPO, *extra_path]), JAX_PLATFORMS="cpu", **env)
  return subprocess.run(
      [sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=120
  )


def _assert_one_line(res, prefix):
  assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
  lines = res.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(prefix), res.stderr
  assert "Traceback" not in res.stderr


# ------------------------------------------------------------ launch/main.py


def test_main_reports_input_errors_in_one_line(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("not a directory")
  wd = f"--workdir={tmp_path / 'wd'}"
  cases = [
      (
          ["--config=configs/ppo.py", "--config.trainer.lrr=1", wd],
          "error: --config: unknown config key 'trainer.lrr'; did you mean optimizer.lr, warmstart.lr?",
      ),
      (
          ["--config=configs/nope.py", wd],
          "error: config file 'configs/nope.py' (--config) does not exist",
      ),
      (
          ["--config=configs/ppo.py", f"--workdir={a_file}"],
          f"error: --workdir={a_file} is a file, not a directory",
      ),
      (
          ["--config=configs/ppo.py", f"--workdir={a_file}/run"],
          f"error: --workdir={a_file}/run cannot be created because {a_file} is a file",
      ),
  ]
  for args, prefix in cases:
    _assert_one_line(_run([MAIN, *args]), prefix)
  assert not (tmp_path / "wd").exists()


def test_main_reports_a_bad_setting_in_one_line(tmp_path):
  # streamrl.config.settings checks values when the config is read, before anything starts;
  # from another directory, the relative config path is found in the checkout.
  args = [MAIN, "--config=configs/ppo.py", "--workdir=wd", "--config.optimizer.lr=-1"]
  res = _run(args, cwd=tmp_path)
  _assert_one_line(res, "error: optimizer.lr=-1.0 ")
  assert not os.listdir(tmp_path)  # A refused run leaves no workdir behind.


LAUNCH_SCRIPTS = sorted(f for f in os.listdir(os.path.join(REPO, "launch")) if f.endswith(".py"))


@pytest.mark.parametrize("script", LAUNCH_SCRIPTS)
def test_help_exits_0(tmp_path, script):
  path = os.path.join(REPO, "launch", script)
  with open(path) as f:
    doc = ast.get_docstring(ast.parse(f.read()))
  res = _run([path, "--help"], cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  # The script's docstring, then its own flags (--debug comes with run_main).
  assert doc.splitlines()[0] in res.stdout and "--[no]debug" in res.stdout, res.stdout


def test_main_help_shows_the_config_flag_and_starts_nothing_heavy(tmp_path):
  code = (
      "import atexit, runpy, sys\n"
      "atexit.register(lambda: print('IMPORTED', sorted({'jax', 'ray', 'torch', 'vllm'}"
      " & set(sys.modules))))\n"
      f"sys.argv = [{MAIN!r}, '-h']\n"
      f"runpy.run_path({MAIN!r}, run_name='__main__')\n"
  )
  res = _run(["-c", code], cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  assert "--config: " in res.stdout
  assert "--config=configs/ppo.py --config.trainer.num_iterations=2" in res.stdout
  assert res.stdout.splitlines()[-1] == "IMPORTED []"
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("how", ["env", "flag"])
def test_debug_shows_the_traceback(tmp_path, how):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  args = [MAIN, "--config=configs/ppo.py", f"--workdir={a_file}"]
  res = _run(args, STREAMRL_DEBUG="1") if how == "env" else _run(args + ["--debug"])
  assert res.returncode not in (0, 2), res.stderr
  assert "Traceback (most recent call last)" in res.stderr
  assert "streamrl.errors.UserError: --workdir=" in res.stderr


RUN_MAIN_PY = """
import sys
import ray.exceptions
from streamrl import cli
from streamrl.errors import UserError

def main(argv):
  try:
    if argv[1] == "user":
      raise UserError("optimizer.lr=-1 must be positive; set --config.optimizer.lr to a value > 0.")
    raise RuntimeError("a bug")
  except Exception as cause:  # What experiment.run re-raises for an error in the trainer actor.
    remote = ray.exceptions.RayTaskError("TrainerActor.run", "Traceback (most recent call last):\\n  ...", cause)
    raise remote.as_instanceof_cause() from None

cli.run_main(main)
"""


def test_run_main_reports_a_user_error_from_a_ray_actor_in_one_line(tmp_path):
  script = tmp_path / "launch.py"
  script.write_text(RUN_MAIN_PY)
  res = _run([str(script), "user"], cwd=tmp_path)
  _assert_one_line(
      res, "error: optimizer.lr=-1 must be positive; set --config.optimizer.lr to a value > 0."
  )
  assert res.stderr.strip().endswith("> 0.")  # The sentence only, not Ray's remote traceback.
  bug = _run([str(script), "bug"], cwd=tmp_path)
  assert bug.returncode == 1 and "Traceback" in bug.stderr and "RuntimeError" in bug.stderr


# ----------------------------------------------------------- launch/sweep.py

SWEEP_CONFIG_PY = """
import ml_collections
def get_config():
  c = ml_collections.ConfigDict()
  c.trainer = ml_collections.ConfigDict()
  c.trainer.lr = 1e-6
  return c
def get_sweep():
  return [{"trainer.lr": [1e-6, 3e-6, 1e-5, 1e-2]}]
"""

FAKE_TRAIN_PY = """
import json, os
from absl import logging as absl_logging
from streamrl.errors import UserError

def run(config, workdir):
  lr = config.trainer.lr
  absl_logging.info("Saving checkpoint at step 1")  # Orbax's way of logging.
  if lr > 1e-3:
    raise UserError(f"trainer.lr={lr} is too large; use at most 1e-3.")
  acc = {1e-6: 0.3, 3e-6: 0.6, 1e-5: 0.45}[lr]
  final = {"eval/accuracy": acc, "eval/accuracy_greedy": acc + 0.1, "reward/mean": acc / 2}
  with open(os.path.join(workdir, "final_metrics.json"), "w") as f:
    json.dump(final, f)
  return final
"""


def _table(stdout):
  lines = stdout.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("sweep: results"))
  return [l.split() for l in lines[start + 2 :]]


@pytest.mark.parametrize("keep_going", [False, True])
def test_sweep_ends_with_a_table_best_first(tmp_path, keep_going):
  (tmp_path / "cfg.py").write_text(SWEEP_CONFIG_PY)
  (tmp_path / "fake_train.py").write_text(FAKE_TRAIN_PY)
  wd = tmp_path / "wd"
  args = [SWEEP, "--config=cfg.py", f"--workdir={wd}", "--run_fn=fake_train:run"]
  res = _run(
      args + (["--keep_going"] if keep_going else []), cwd=tmp_path, extra_path=[str(tmp_path)]
  )
  assert _table(res.stdout) == [
      ["1", "trainer.lr=3e-06", "0.6000", "0.7000", "0.3000"],
      ["2", "trainer.lr=1e-05", "0.4500", "0.5500", "0.2250"],
      ["3", "trainer.lr=1e-06", "0.3000", "0.4000", "0.1500"],
      ["-", "trainer.lr=0.01", "(failed)", "-", "-", "-"],
  ], res.stdout
  message = "trainer.lr=0.01 is too large; use at most 1e-3."
  if keep_going:
    assert res.returncode == 1
    assert res.stderr.splitlines() == [
        f"error: trainer.lr=0.01: {message}",
        "error: 1 of 4 sweep runs failed: trainer.lr=0.01",
    ]
  else:
    _assert_one_line(res, f"error: {message}")
  # absl's (Orbax's) INFO lines went to each run's library log, not the console.
  assert "Saving checkpoint" not in res.stdout + res.stderr
  assert "Saving checkpoint" in (wd / "trainer.lr=1e-06" / "libraries.log").read_text()


def test_sweep_refuses_a_workdir_that_is_a_file(tmp_path):
  (tmp_path / "cfg.py").write_text(SWEEP_CONFIG_PY)
  (tmp_path / "wd").write_text("")
  res = _run([SWEEP, "--config=cfg.py", f"--workdir={tmp_path / 'wd'}", "--dry_run"], cwd=tmp_path)
  _assert_one_line(res, f"error: --workdir={tmp_path / 'wd'} is a file")


# ------------------------------------------------- user errors in the library


def test_check_workdir(tmp_path):
  assert errors.check_workdir(str(tmp_path / "new" / "run")) == str(tmp_path / "new" / "run")
  assert errors.check_workdir("gs://bucket/run") == "gs://bucket/run"
  (tmp_path / "f").write_text("")
  for path, match in [
      (str(tmp_path / "f"), "is a file"),
      (str(tmp_path / "f" / "x"), "because .* is a file"),
      ("", "is empty"),
  ]:
    with pytest.raises(errors.UserError, match=match):
      errors.check_workdir(path)
  assert not (tmp_path / "new").exists()  # Checking creates nothing.


def test_user_message_unwraps_and_folds_lines():
  class Wrapped(errors.UserError):  # Shaped like Ray's RayTaskError(UserError).

    def __init__(self, cause):
      super().__init__("ray::Actor.run()\nTraceback ...\nUserError: fix it.")
      self.cause = cause

  assert errors.user_message(Wrapped(errors.UserError("fix\n it."))) == "fix it."
  assert errors.find_user_error(RuntimeError("bug")) is None


def test_debug_requested(monkeypatch):
  monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
  assert not errors.debug_requested(["main.py", "--config=c.py"])
  assert errors.debug_requested(["main.py", "--debug"])
  assert not errors.debug_requested(["main.py", "--debug", "--nodebug"])
  monkeypatch.setenv(errors.DEBUG_ENV, "1")
  assert errors.debug_requested([])


def test_unreachable_cluster_is_a_user_error():
  from streamrl import cluster  # pylint: disable=g-import-not-at-top

  with socket.socket() as s:  # A port that was free a moment ago: nothing listens.
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with pytest.raises(errors.UnreachableClusterError, match="cluster.address") as e:
    cluster.check_reachable(f"127.0.0.1:{port}", timeout_s=3)
  assert isinstance(e.value, ConnectionError)
  with pytest.raises(errors.UserError, match="host:port"):
    cluster.check_reachable("127.0.0.1:notaport", timeout_s=3)


def test_jsonl_file_errors_are_user_errors(tmp_path):
  from streamrl.data import dataset  # pylint: disable=g-import-not-at-top

  with pytest.raises(errors.MissingFileError):
    dataset.load_file(tmp_path / "missing.jsonl")
  # A directory is a set of shards (task.train_path): an empty one is its own error.
  with pytest.raises(errors.UserError, match="has no .parquet or .jsonl files"):
    dataset.load_file(tmp_path)
  (tmp_path / "bad.jsonl").write_text("not json\n")
  with pytest.raises(errors.UserError, match="malformed rows"):
    dataset.load_file(tmp_path / "bad.jsonl")
  (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n')
  with pytest.raises(errors.UserError, match="not UTF-8"):
    dataset.load_file(tmp_path / "latin1.jsonl")


def test_model_path_errors_are_user_errors(tmp_path):
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top

  with pytest.raises(errors.MissingFileError, match="does not exist"):
    hf.read_config(str(tmp_path / "nope"))
  with pytest.raises(errors.MissingFileError, match="no config.json"):
    hf.read_config(str(tmp_path))
  (tmp_path / "config.json").write_text("{")
  with pytest.raises(errors.UserError, match="not valid JSON"):
    hf.read_config(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(errors.UserError, match="Unsupported architecture"):
    hf.read_config(str(tmp_path))


def test_checkpoint_dir_under_a_file_is_a_user_error(tmp_path):
  from streamrl.trainer.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top

  (tmp_path / "wd").write_text("")
  with pytest.raises(errors.UserError, match="is a file"):
    Checkpointer(str(tmp_path / "wd" / "checkpoints"), fingerprint={"a": 1})
  assert (tmp_path / "wd").read_text() == ""
