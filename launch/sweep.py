"""Runs every point of a config's sweep, one after another, each in its own run directory.

  python launch/sweep.py --config=configs/ppo.py --workdir=workdirs/sweep
  python launch/sweep.py --config=configs/ppo.py --workdir=workdirs/sweep --dry_run   # just the plan

The config file defines `get_sweep()` next to `get_config()`: a list of
override dicts where a list value is a grid axis (see
`streamrl.config_utils.expand_sweep`). Each point's overrides go onto
`get_config()` plus any `--config.x=y` given here (a key set by both is
refused), and the run goes to `<workdir>/<run_name(overrides)>/` — e.g.
`workdirs/sweep/trainer.lr=3e-06,algo.kl_coef=0.01/` — so TensorBoard pointed
at `<workdir>` shows the points side by side. Every point is validated before
the first one starts. Starting the same sweep again resumes each run from its
own checkpoints (the run function resumes from its workdir).
"""

import importlib
import json
import os
import sys
import traceback

# Runnable as `python launch/sweep.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
from ml_collections import config_flags

from streamrl import config_utils

_CONFIG = config_utils.define_config_file("config", None, "Config file defining get_config() and get_sweep().")
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string("workdir", None, "Each point runs in <workdir>/<run name>.", required=True)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the planned run directories and overrides; run nothing.")
_KEEP_GOING = flags.DEFINE_bool("keep_going", False, "After a failed point, go on with the next one.")
_RUN_FN = flags.DEFINE_string("run_fn", None, "module:function called as fn(config, workdir) for each point; "
                              "default: streamrl's training entry point.")

# The training entry point, found by name at run time so that planning
# (--dry_run) works without importing JAX.
_DEFAULT_RUN_FNS = ("streamrl.train:run", "streamrl.trainer.train:run")


def _resolve_run_fn(spec: str | None):
  candidates = [spec] if spec else list(_DEFAULT_RUN_FNS)
  for candidate in candidates:
    module_name, _, fn_name = candidate.partition(":")
    if not fn_name:
      raise ValueError(f"--run_fn={candidate!r} must look like module:function.")
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      # Only "this module does not exist" means try the next one; a missing
      # dependency inside it is a real error.
      if spec or not (e.name and module_name.startswith(e.name)):
        raise
      continue
    fn = getattr(module, fn_name, None)
    if callable(fn):
      return fn
    if spec:
      raise ValueError(f"--run_fn: module {module_name} has no function {fn_name!r}.")
  raise ValueError(f"no training entry point found (tried {', '.join(candidates)}); pass --run_fn=module:function.")


def _plan():
  """[(run name, overrides, config)] for every point, all validated."""
  flag = flags.FLAGS["config"]
  points = config_utils.load_sweep(config_flags.get_config_filename(flag))
  names = config_utils.check_run_names(points)
  cli = config_flags.get_override_values(flag)
  plan = []
  for name, point in zip(names, points):
    clash = [k for k in point if k in cli or any(k.startswith(c + ".") or c.startswith(k + ".") for c in cli)]
    if clash:
      raise ValueError(f"--config.{clash[0]} is set both on the command line and by the sweep; drop one of them.")
    plan.append((name, point, config_utils.apply_overrides(_CONFIG.value, point)))
  return plan


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --name=value.")
  try:
    plan = _plan()
    run_fn = None if _DRY_RUN.value else _resolve_run_fn(_RUN_FN.value)
  except (ValueError, FileNotFoundError) as e:
    sys.stderr.write(f"error: {e}\n")
    return 1
  workdir = _WORKDIR.value
  print(f"sweep: {len(plan)} run(s) under {workdir}", flush=True)
  for i, (name, point, _) in enumerate(plan):
    print(f"  [{i + 1}/{len(plan)}] {os.path.join(workdir, name)}  {json.dumps(point)}", flush=True)
  if _DRY_RUN.value:
    return 0
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "sweep.json"), "w", encoding="utf-8") as f:
    json.dump([{"run": name, "overrides": point} for name, point, _ in plan], f, indent=2)
  failed = []
  for i, (name, point, config) in enumerate(plan):
    run_dir = os.path.join(workdir, name)
    print(f"sweep: starting [{i + 1}/{len(plan)}] {run_dir}", flush=True)
    try:
      run_fn(config, run_dir)
    except Exception:  # pylint: disable=broad-except
      if not _KEEP_GOING.value:
        raise
      traceback.print_exc()
      failed.append(name)
  if failed:
    sys.stderr.write(f"error: {len(failed)} of {len(plan)} sweep runs failed: {', '.join(failed)}\n")
    return 1
  return 0


if __name__ == "__main__":
  app.run(main, flags_parser=config_utils.parse_flags_or_exit)
