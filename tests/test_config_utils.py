"""Config overrides, one-line flag errors, sweep expansion, run names and launch/sweep.py."""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from streamrl.config import (
    apply_overrides,
    check_run_names,
    expand_sweep,
    find_config_file,
    load_config,
    load_sweep,
    resolve_paths,
    run_name,
)
from streamrl.errors import MissingFileError, UserError

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIG_PY = """
import ml_collections
def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.trainer = ml_collections.ConfigDict()
  c.trainer.lr = 1e-6
  c.trainer.num_iterations = 10
  c.trainer.mesh = (1, 8)
  c.algo = ml_collections.ConfigDict()
  c.algo.name = "ppo"
  c.algo.kl_coef = 0.0
  c.algo.use_critic = True
  c.data = ml_collections.ConfigDict()
  c.data.path = ml_collections.FieldReference(None, field_type=str)
  if arg == "tiny":
    c.trainer.num_iterations = 2
  elif arg:
    raise ValueError(f"unknown variant {arg!r}; use cfg.py or cfg.py:tiny.")
  return c
"""

SWEEP_PY = """
def get_sweep(arg=None):
  return [{"trainer.lr": [1e-6, 3e-6], "algo.kl_coef": [0.0, 0.01]}, {"algo.name": "grpo", "trainer.mesh": (2, 4)}]
"""


def _config():
  ns = {}
  exec(CONFIG_PY, ns)  # pylint: disable=exec-used
  return ns["get_config"]()


# ---------------------------------------------------------------- overrides


def test_apply_overrides_parses_by_field_type_and_copies():
  base = _config()
  base.lock()
  c = apply_overrides(
      base,
      [
          "trainer.lr=3e-6",
          "trainer.num_iterations=4",
          "trainer.mesh=(2, 4)",
          "algo.use_critic=false",
          "algo.name=grpo",
          "data.path=/tmp/x.jsonl",
          "seed=7",
      ],
  )
  assert (c.trainer.lr, c.trainer.num_iterations, c.trainer.mesh) == (3e-6, 4, (2, 4))
  assert (c.algo.use_critic, c.algo.name, c.data.path, c.seed) == (False, "grpo", "/tmp/x.jsonl", 7)
  assert isinstance(c.trainer.lr, float)
  assert base.trainer.lr == 1e-6 and base.data.path is None  # Untouched.
  assert apply_overrides(base, ["trainer.lr=1"]).trainer.lr == 1.0  # An int is a fine float.
  assert apply_overrides(base, ["trainer.mesh=8"]).trainer.mesh == (8,)  # Like config_flags.
  # Mappings carry Python values (sweeps); strings for non-string fields are parsed.
  c = apply_overrides(base, {"trainer.lr": 2e-6, "trainer.mesh": [4, 2], "algo.kl_coef": "0.05"})
  assert (c.trainer.lr, c.trainer.mesh, c.algo.kl_coef) == (2e-6, (4, 2), 0.05)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.lrr=1", "unknown config key 'trainer.lrr'; did you mean trainer.lr?"),
        ("traner.lr=1", "unknown config key 'traner.lr'; did you mean trainer.lr?"),
        (
            "num_iterations=1",
            "unknown config key 'num_iterations'; did you mean trainer.num_iterations?",
        ),
        (
            "trainer.zzz=1",
            "unknown config key 'trainer.zzz'; the keys under trainer are: lr, mesh, num_iterations.",
        ),
        (
            "trainer.lr.x=1",
            "unknown config key 'trainer.lr.x'; trainer.lr is a value, not a group of keys.",
        ),
        ("trainer.lr=abc", "cannot set trainer.lr to 'abc': it expects a float (currently 1e-06)."),
        (
            "trainer.num_iterations=1.5",
            "cannot set trainer.num_iterations to '1.5': it expects an int (currently 10).",
        ),
        ("algo.use_critic=maybe", "cannot set algo.use_critic to 'maybe': it expects a bool"),
        ("trainer.lr", "override 'trainer.lr' must look like key=value"),
    ],
)
def test_apply_overrides_rejects_with_one_sentence(override, message):
  with pytest.raises(UserError) as e:
    apply_overrides(_config(), [override])
  assert str(e.value).startswith(message)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"trainer.num_iterations": 1.5}, "it expects an int"),
        ({"trainer.lr": True}, "it expects a float"),
        ({"algo.use_critic": 1}, "it expects a bool"),
        ({"algo.name": 3}, "it expects a string"),
        ({"trainer.mesh": 3}, "it expects a tuple"),
    ],
)
def test_typed_overrides_are_strict(overrides, message):
  with pytest.raises(UserError, match=message):
    apply_overrides(_config(), overrides)


# -------------------------------------------------------------- sweep names


def test_expand_sweep_grid_order_and_fixed_values():
  points = expand_sweep([{"a": [1, 2], "b": ["x", "y"], "mesh": (2, 4)}, {"a": 3}])
  assert points == [
      {"a": 1, "b": "x", "mesh": (2, 4)},
      {"a": 1, "b": "y", "mesh": (2, 4)},
      {"a": 2, "b": "x", "mesh": (2, 4)},
      {"a": 2, "b": "y", "mesh": (2, 4)},
      {"a": 3},
  ]
  assert expand_sweep({"a": [1, 2]}) == [{"a": 1}, {"a": 2}]
  for bad, message in [
      ([], "non-empty list"),
      ([{"a": []}], "empty list"),
      ([3], "must be a dict"),
      ([{1: 2}], "dotted config names"),
  ]:
    with pytest.raises(UserError, match=message):
      expand_sweep(bad)


def test_run_name_is_readable_safe_and_deterministic():
  assert (
      run_name({"trainer.lr": 3e-6, "algo.kl_coef": 0.01}) == "trainer.lr=3e-06,algo.kl_coef=0.01"
  )
  assert (
      run_name({"trainer.mesh": (2, 4), "algo.use_critic": False})
      == "trainer.mesh=2_4,algo.use_critic=False"
  )
  assert run_name({}) == "base"
  # Unsafe characters are replaced, and a hash keeps the names distinct.
  a, b = run_name({"data.path": "/a/b c"}), run_name({"data.path": "_a_b_c"})
  assert a.startswith("data.path=_a_b_c-") and b == "data.path=_a_b_c" and a != b
  assert "/" not in a and " " not in a
  long = {f"group.key_{i}": 1e-6 * i for i in range(40)}
  name = run_name(long)
  assert len(name) == 120 and name == run_name(dict(long))
  assert name != run_name({**long, "group.key_39": 1.0})  # Differs only past the cut.
  with pytest.raises(UserError, match="same point twice"):
    check_run_names([{"a": 1}, {"a": 1}])


def test_config_files_are_found_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  ppo = os.path.join(REPO, "configs", "ppo.py")
  assert find_config_file("configs/ppo.py") == ppo
  assert find_config_file("configs/ranker.py:tiny") == os.path.join(
      REPO, "configs", "ranker.py:tiny"
  )
  for unchanged in (ppo, "configs/nope.py", "nope.py:arg", ""):
    assert find_config_file(unchanged) == unchanged
  assert load_config("configs/grpo.py").advantage.estimator == "grpo"  # It loads configs/ppo.py.
  assert load_sweep("configs/ppo.py")
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "ppo.py").write_text(CONFIG_PY)
  assert find_config_file("configs/ppo.py") == "configs/ppo.py"  # The working directory's wins.


def test_load_sweep_from_file(tmp_path):
  path = tmp_path / "cfg.py"
  path.write_text(CONFIG_PY + SWEEP_PY)
  points = load_sweep(f"{path}:tiny")
  assert len(points) == 5 and points[-1] == {"algo.name": "grpo", "trainer.mesh": (2, 4)}
  (tmp_path / "nosweep.py").write_text(CONFIG_PY)
  with pytest.raises(UserError, match="defines no get_sweep"):
    load_sweep(str(tmp_path / "nosweep.py"))
  with pytest.raises(MissingFileError, match="does not exist") as e:
    load_sweep(str(tmp_path / "missing.py"))
  assert isinstance(
      e.value, FileNotFoundError
  )  # Still caught by callers that expect the built-in type.


# -------------------------------------------------------- launch scripts


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
  from streamrl import cli

  env = {"HOME_IS_NOT_READ": "1"}
  path = cli.use_compile_cache(env)
  assert env[cli.COMPILE_CACHE_ENV] == path
  assert path == os.path.join(os.path.expanduser("~"), ".cache", "streamrl", "xla")
  assert cli.use_compile_cache({cli.COMPILE_CACHE_ENV: "/x"}) == "/x"
  assert cli.use_compile_cache({cli.COMPILE_CACHE_ENV: ""}) == ""  # off


def test_relative_paths_resolve_against_the_config_file_then_the_checkout(tmp_path, monkeypatch):
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "train.jsonl").write_text("{}\n")
  (tmp_path / "rw.py").write_text("def f(r, a): return 0.0\n")
  cfg = ml_collections.ConfigDict(
      {
          "task": {"train_path": "data/train.jsonl", "eval_path": "", "reward": "rw.py:f"},
          "scheduler": {"ranker_config": "configs/ranker.py:tiny"},
          "model": {"path": "/abs/model"},
          "other": {"name": "data/train.jsonl"},
      }
  )
  monkeypatch.chdir("/")
  out = resolve_paths(cfg, str(tmp_path))
  assert out.task.train_path == str(tmp_path / "data" / "train.jsonl")
  assert out.task.reward == f"{tmp_path / 'rw.py'}:f"
  assert out.task.eval_path == "" and out.model.path == "/abs/model"
  assert out.other.name == "data/train.jsonl"  # not a path key
  assert cfg.task.train_path == "data/train.jsonl"  # the input is left as it was


def test_one_strict_type_check_serves_the_settings_and_the_overrides():
  from streamrl.config.checks import coerce

  assert coerce(1, float) == 1.0 and isinstance(coerce(1, "float"), float)
  assert coerce([1, 8], "tuple") == (1, 8)
  assert coerce({"a": 1}, dict) == {"a": 1}  # other types: ConfigDict's own check decides
  for value, want in [(True, int), (True, float), (1.5, int), (1, bool), (3, str), (3, tuple)]:
    with pytest.raises(TypeError):
      coerce(value, want)
