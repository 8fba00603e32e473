r"""`configs/ppo.py` on two generator instances, per scheduler, run after run.

  python experiments/bench/bench_pool_runs.py [--reps=3] [--iterations=100]
      [--arms=default,fifo,pool,ranker_on_trainer] [--workdir=/tmp/streamrl_pool_runs]

Each arm is the StreamRL default run (`launch/main.py --config=configs/ppo.py`,
async with partial rollouts, transfer service) with
`--config.engine.num_instances=2` and the arm's scheduler overrides:

  default: configs/ppo.py's `scheduler.*` as they are (ranker + skew dispatch);
  fifo:    `scheduler.kind=fifo`;
  pool:    the default plus `scheduler.pool=shared` (one pending pool);
  ranker_on_trainer: the default with the ranker in the trainer's process
           (`scheduler.ranker_side=trainer`) instead of beside the generators.

The arms run interleaved (default, fifo, pool, default, ...) so a slow spell
of the machine hits each about equally; the warm-started policy is trained
once and shared. From each run's metrics.jsonl, over iterations >= --skip:

  makespan: median `time/generation_s` (the round's generation time);
  idle: mean over instances of the median `bubble/generator<i>` (the share
    of an iteration the instance generated nothing);
  acc: the last `eval/accuracy`.

Ends with `RESULT <arm>_makespan=<mean over runs> <arm>_makespan_spread=<max
- min> <arm>_idle=<mean> ...`. About 5 minutes per run on 2 cores at 100
iterations. Results: experiments/RESULTS.md.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import statistics
import subprocess
import time

from absl import app, flags

from experiments import harness

ARMS = {
    "default": {},
    "fifo": {"scheduler.kind": "fifo"},
    "pool": {"scheduler.pool": "shared"},
    "ranker_on_trainer": {"scheduler.ranker_side": "trainer"},
}

_ITERATIONS = flags.DEFINE_integer("iterations", 100, "trainer.num_iterations of each run.")
_ARMS = flags.DEFINE_list("arms", ["default", "fifo", "pool"], f"Arms to run, of {sorted(ARMS)}.")
_SKIP = flags.DEFINE_integer("skip", 5, "Leading iterations left out (compiles, first rounds).")


def summarize(metrics_path: str, skip: int) -> dict:
  """The run's median round makespan, generators' idle share and last eval accuracy."""
  rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
  its = [r for r in rows if "time/generation_s" in r and r.get("step", 0) >= skip]
  if not its:
    raise ValueError(f"{metrics_path} has no iteration after {skip}; did the run finish?")
  idle_keys = sorted({k for r in its for k in r if k.startswith("bubble/generator")})
  evals = [r["eval/accuracy"] for r in rows if r.get("eval/accuracy") is not None]
  return {
      "makespan": statistics.median(r["time/generation_s"] for r in its),
      "idle": statistics.mean(
          statistics.median(r[k] for r in its if r.get(k) is not None) for k in idle_keys
      )
      if idle_keys
      else float("nan"),
      "acc": evals[-1] if evals else float("nan"),
      "iterations": len(its),
  }


def main(argv):
  del argv
  unknown = set(_ARMS.value) - set(ARMS)
  if unknown:
    raise app.UsageError(f"--arms has {sorted(unknown)}; pick from {sorted(ARMS)}.")
  root = harness.workdir("/tmp/streamrl_pool_runs")  # a fresh directory per run below it
  warm = None  # the first run's warm-started policy, shared with the others
  results: dict[str, list[dict]] = {a: [] for a in _ARMS.value}
  for rep in range(harness.reps(3)):  # runs per arm
    for arm in _ARMS.value:
      wd = os.path.join(root, f"{arm}{rep}")
      shutil.rmtree(wd, ignore_errors=True)
      os.makedirs(wd)
      if warm:
        os.symlink(warm, os.path.join(wd, os.path.basename(warm)))
      cmd = harness.main_command(
          wd,
          {
              "engine.num_instances": 2,
              "trainer.num_iterations": _ITERATIONS.value,
              "log.eval_every": _ITERATIONS.value,
              **ARMS[arm],
          },
      )
      t0 = time.time()
      with open(os.path.join(wd, "run.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=harness.ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
      if rc:
        raise RuntimeError(f"{arm} run {rep} exited {rc}; its log: {wd}/run.log")
      if warm is None:
        warm = next(iter(glob.glob(os.path.join(wd, "warmstart-*"))), None)
      found = glob.glob(os.path.join(wd, "**", "metrics.jsonl"), recursive=True)
      if not found:
        raise RuntimeError(f"{arm} run {rep} wrote no metrics.jsonl under {wd}.")
      r = summarize(found[0], _SKIP.value) | {"wall_s": time.time() - t0}
      results[arm].append(r)
      print(
          f"{arm} run {rep}: makespan {r['makespan']:.3f} s  idle {r['idle']:.3f}  "
          f"acc {r['acc']:.3f}  wall {r['wall_s']:.0f} s",
          flush=True,
      )
  out = {}
  for arm, rs in results.items():
    ms = [r["makespan"] for r in rs]
    out[f"{arm}_makespan"] = f"{statistics.mean(ms):.3f}"
    out[f"{arm}_makespan_spread"] = f"{max(ms) - min(ms):.3f}"
    out[f"{arm}_idle"] = f"{statistics.mean(r['idle'] for r in rs):.3f}"
    out[f"{arm}_acc"] = f"{statistics.mean(r['acc'] for r in rs):.3f}"
  harness.report(summary={"runs": results}, **out)


if __name__ == "__main__":
  app.run(main)
