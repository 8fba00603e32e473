"""Runs every point of a config's sweep, one after another, each in its own run directory.

  python launch/sweep.py --config=configs/ppo.py --workdir=workdirs/sweep
  python launch/sweep.py --config=configs/ppo.py --workdir=workdirs/sweep --dry_run   # just the plan

The config file defines `get_sweep()` next to `get_config()`: a list of
override dicts where a list value is a grid axis (see
`streamrl.config.expand_sweep`). Each point's overrides go onto
`get_config()` plus any `--config.x=y` given here (a key set by both is
refused), and the run goes to `<workdir>/<run_name(overrides)>/` — e.g.
`workdirs/sweep/optimizer.lr=3e-06,kl.coef=0.01/` — so TensorBoard pointed
at `<workdir>` shows the points side by side. Every point is validated before
the first one starts. Starting the same sweep again resumes each run from its
own checkpoints (the run function resumes from its workdir).

The terminal shows progress and StreamRL's own lines; each run's library logs
(vLLM, Ray, Orbax, ...) go to `<workdir>/<run name>/libraries.log`. At the end
a table ranks the runs by their final `eval/accuracy`, read from each run's
`final_metrics.json`. A mistake in the input prints one `error: ...` line and
exits with status 2 (--debug shows the traceback).
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

from streamrl import cli, errors, metrics
from streamrl import config as config_lib
from streamrl.config import renames

_CONFIG = cli.define_config_file(
    "config", None, "Config file defining get_config() and get_sweep()."
)
flags.mark_flag_as_required("config")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Each point runs in <workdir>/<run name>.", required=True
)
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Print the planned run directories and overrides; run nothing."
)
_KEEP_GOING = flags.DEFINE_bool(
    "keep_going", False, "After a failed point, go on with the next one."
)
_RUN_FN = flags.DEFINE_string(
    "run_fn",
    None,
    "module:function called as fn(config, workdir) for each point; "
    "default: streamrl's training entry point.",
)

# The training entry point, found by name at run time so that planning
# (--dry_run) works without importing JAX.
_DEFAULT_RUN_FNS = ("streamrl.experiment:run",)


def _resolve_run_fn(spec: str | None):
  candidates = [spec] if spec else list(_DEFAULT_RUN_FNS)
  for candidate in candidates:
    module_name, _, fn_name = candidate.partition(":")
    if not fn_name:
      raise errors.UserError(f"--run_fn={candidate!r} must look like module:function.")
    try:
      module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
      # Only "this module does not exist" means try the next one (or, for
      # --run_fn, is the user's mistake); a missing dependency inside it is
      # a real error.
      if not (e.name and module_name.startswith(e.name)):
        raise
      if spec:
        raise errors.UserError(
            f"--run_fn: no module named {module_name!r}; check the name and " "PYTHONPATH."
        ) from e
      continue
    fn = getattr(module, fn_name, None)
    if callable(fn):
      return fn
    if spec:
      raise errors.UserError(f"--run_fn: module {module_name} has no function {fn_name!r}.")
  raise errors.UserError(
      f"no training entry point found (tried {', '.join(candidates)}); pass --run_fn=module:function."
  )


def _plan():
  """[(run name, overrides, config)] for every point, all validated."""
  flag = flags.FLAGS["config"]
  given = config_lib.load_sweep(config_flags.get_config_filename(flag))
  # Keys renamed in 0.1 under their new names (streamrl/config/renames.py).
  points = [{config_lib.renamed(_CONFIG.value, k): v for k, v in p.items()} for p in given]
  names = config_lib.check_run_names(points)
  # A point started before the rename resumes in the directory it was named then.
  workdir = _WORKDIR.value
  for i, (old, point) in enumerate(zip(given, points)):
    if os.path.exists(os.path.join(workdir, names[i])):
      continue
    for old_name in (config_lib.run_name(old), config_lib.run_name(renames.legacy_name(point))):
      if old_name != names[i] and os.path.isdir(os.path.join(workdir, old_name)):
        print(f"sweep: resuming {old_name} (named before the 0.1 key rename)", flush=True)
        names[i] = old_name
        break
  command_line = config_flags.get_override_values(flag)
  plan = []
  for name, point in zip(names, points):
    clash = [
        k
        for k in point
        if k in command_line
        or any(k.startswith(c + ".") or c.startswith(k + ".") for c in command_line)
    ]
    if clash:
      raise errors.UserError(
          f"--config.{clash[0]} is set both on the command line and by the sweep; drop one of them."
      )
    plan.append((name, point, config_lib.apply_overrides(_CONFIG.value, point)))
  return plan


def _summary(plan, workdir: str, results: dict) -> str:
  """The closing table: every point, best final eval/accuracy first."""
  rows = []
  for name, _, _ in plan:
    status, returned = results.get(name, ("not run", None))
    values = metrics.read_final_metrics(os.path.join(workdir, name))
    if values is None and isinstance(returned, dict):
      values = returned  # A --run_fn that writes no final_metrics.json.
    rows.append((name if status == "done" else f"{name} ({status})", values))
  return metrics.results_table(rows)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --name=value.")
  workdir = errors.check_workdir(_WORKDIR.value)
  plan = _plan()
  run_fn = None if _DRY_RUN.value else _resolve_run_fn(_RUN_FN.value)
  print(f"sweep: {len(plan)} run(s) under {workdir}", flush=True)
  for i, (name, point, _) in enumerate(plan):
    print(f"  [{i + 1}/{len(plan)}] {os.path.join(workdir, name)}  {json.dumps(point)}", flush=True)
  if _DRY_RUN.value:
    return 0
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "sweep.json"), "w", encoding="utf-8") as f:
    json.dump([{"run": name, "overrides": point} for name, point, _ in plan], f, indent=2)
  failed = []
  results: dict = {}  # run name -> (status, what run_fn returned)
  try:
    for i, (name, point, config) in enumerate(plan):
      run_dir = os.path.join(workdir, name)
      print(f"sweep: starting [{i + 1}/{len(plan)}] {run_dir}", flush=True)
      # Each run's library chatter into its own directory.
      metrics.configure_logging(run_dir)
      try:
        results[name] = ("done", run_fn(config, run_dir))
      except Exception as e:  # pylint: disable=broad-except
        results[name] = ("failed", None)
        if not _KEEP_GOING.value:
          raise
        if errors.find_user_error(e) is not None and not errors.debug_requested(sys.argv):
          sys.stderr.write(f"error: {name}: {errors.user_message(e)}\n")
        else:
          traceback.print_exc()
        failed.append(name)
  finally:
    if results:
      print(
          f"sweep: results (best {metrics.SUMMARY_METRICS[0]} first)\n{_summary(plan, workdir, results)}",
          flush=True,
      )
  if failed:
    sys.stderr.write(
        f"error: {len(failed)} of {len(plan)} sweep runs failed: {', '.join(failed)}\n"
    )
    return 1
  return 0


if __name__ == "__main__":
  cli.run_main(main)
