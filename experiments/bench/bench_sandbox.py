"""What the isolated sandbox costs per `python` tool call, against the older subprocess.

  python experiments/bench/bench_sandbox.py [--reps=N] [--code=SOURCE]

Calls `streamrl.envs.tools.python_sandbox` as a tool worker does, alternating
the two modes of `env.sandbox` call by call (so both see the same machine
load): `isolated`, new user, mount, PID, network and IPC namespaces per call
(streamrl/envs/sandbox.py), and `unsafe`, a plain subprocess with resource
limits. Each call's wall-clock time, from the call to its answer, includes the
interpreter's start in both; a few warm-up calls of each are left out.

Ends with `RESULT isolated_median_ms=.. isolated_p99_ms=.. unsafe_median_ms=..
unsafe_p99_ms=.. added_median_ms=..` (added: the isolated median minus the
unsafe one); --reps timed calls per mode (--quick: 10).
"""

import time

from absl import app, flags
import numpy as np

from experiments import harness
from streamrl.envs import sandbox, tools

_WARMUP = flags.DEFINE_integer("warmup", 5, "Untimed calls per mode first.")
_CODE = flags.DEFINE_string("code", "print(6*7)", "The Python each call runs.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 5.0, "Each call's env.tool_timeout_s.")

MODES = ("isolated", "unsafe")


def _call(mode: str) -> float:
  sandbox.set_default_mode(mode)
  t0 = time.perf_counter()
  tools.python_sandbox(_CODE.value, _TIMEOUT.value)
  return time.perf_counter() - t0


def main(argv):
  del argv
  sandbox.check("isolated")
  calls = harness.reps(10 if harness.QUICK.value else 200)
  for _ in range(_WARMUP.value):
    for mode in MODES:
      _call(mode)
  seconds = {mode: [] for mode in MODES}
  for i in range(calls):
    for mode in MODES if i % 2 == 0 else MODES[::-1]:
      seconds[mode].append(_call(mode))
  result = {}
  for mode in MODES:
    ms = np.array(seconds[mode]) * 1e3
    result[f"{mode}_median_ms"] = round(float(np.median(ms)), 2)
    result[f"{mode}_p99_ms"] = round(float(np.percentile(ms, 99)), 2)
  result["added_median_ms"] = round(result["isolated_median_ms"] - result["unsafe_median_ms"], 2)
  harness.report(summary={"calls": calls}, **result)


if __name__ == "__main__":
  app.run(main)
