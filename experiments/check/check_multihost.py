"""A trainer over 2 processes against 1 process, on the same 8-device mesh.

  python experiments/check/check_multihost.py [--iterations=8] [--mode=sync] [--workdir=DIR]

Runs the tiny PPO job twice through `launch/main.py`, as a user would, with
real Ray actors, a real vLLM generator and real collectives:

  --config.pipeline.mode=sync --config.mesh.fsdp=4 --config.mesh.tensor=2
  --config.cluster.trainer_processes=1   (one process, 8 faked CPU devices)
  --config.cluster.trainer_processes=2   (two processes x 4 devices, gloo)

then compares every array of the two final checkpoints (parameters and
optimizer state) and the training time per iteration (`time/training_s`,
median over the second half of the run: each new padded mini-batch length
compiles once, so early iterations mostly measure compilation). Ends with
`RESULT processes=2 devices=8 param_max_abs_diff=.. step_time_ratio=..`,
where step_time_ratio is the 2-process training time over the 1-process
one. On 2 shared cores it measures the cost of crossing processes (gloo
over loopback, the leader's command queue), not a speedup.
"""

import json
import os
import subprocess
import tempfile
import time

import numpy as np
from absl import app, flags

from experiments import harness

_ITERATIONS = flags.DEFINE_integer("iterations", 8, "RL iterations of each run.")
_MODE = flags.DEFINE_string("mode", "sync", "pipeline.mode of both runs (not colocated).")


def run(workdir: str, processes: int, iterations: int, mode: str) -> float:
  """One run through launch/main.py; returns its wall time."""
  cmd = harness.main_command(
      workdir,
      {
          "pipeline.mode": mode,
          "mesh.fsdp": 4,
          "mesh.tensor": 2,
          "cluster.trainer_processes": processes,
          "trainer.num_iterations": iterations,
          "log.progress": False,
      },
  )
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  t0 = time.time()
  subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
  return time.time() - t0


def training_times(workdir: str) -> list[float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r["time/training_s"] for r in rows if "time/training_s" in r]


def main(_):
  from streamrl.trainer.checkpoint import read_arrays  # pylint: disable=g-import-not-at-top

  root = tempfile.mkdtemp(prefix="check_multihost_", dir=harness.workdir())
  out = {}
  for n in (1, 2):
    workdir = os.path.join(root, f"p{n}")
    wall = run(workdir, n, _ITERATIONS.value, _MODE.value)
    times = training_times(workdir)
    with open(os.path.join(workdir, "final_metrics.json")) as f:
      acc = json.load(f).get("eval/accuracy")
    out[n] = dict(
        arrays=read_arrays(os.path.join(workdir, "checkpoints")),
        step=float(np.median(times[len(times) // 2 :])),
        wall=wall,
        acc=acc,
    )
    print(
        f"processes={n}: wall {wall:.0f} s, training per iteration "
        f"{' '.join(f'{t:.2f}' for t in times)} s, eval/accuracy {acc}"
    )
  a, b = out[1]["arrays"], out[2]["arrays"]
  assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
  diffs = {k: float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) for k in a}
  worst = max(diffs, key=diffs.get)
  print(f"{len(diffs)} arrays compared; largest difference {diffs[worst]:.3g} at {worst}")
  harness.report(
      processes=2,
      devices=8,
      param_max_abs_diff=f"{diffs[worst]:.3g}",
      step_time_ratio=f"{out[2]['step'] / out[1]['step']:.3f}",
  )


if __name__ == "__main__":
  app.run(main)
