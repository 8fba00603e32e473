"""A trainer over 2 processes (jax.distributed, gloo, real Ray actors, real vLLM).

The test runs `launch/main.py` as a user would, on the tiny run in sync mode
with a 2-device fsdp mesh: one process with 2 faked CPU devices, or 2
processes with one each (the 8-device fsdp x tensor meshes are tested in
one process, tests/trainer; on 2 cores every faked device more slows each
step, so the runs here keep to two). The pieces that run in one process are
in tests/trainer/test_multihost.py.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from streamrl.trainer.checkpoint import read_arrays

pytestmark = [pytest.mark.e2e]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "launch", "main.py")
TINY = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())
MESH = {"pipeline.mode": "sync", "mesh.fsdp": 2, "mesh.tensor": 1}
# Fewer programs to compile (no reference model, one epoch): compiling sharded
# programs is most of these runs. Four micro-batches of 2 per mini-batch of 8:
# length-sorted, they fall in different length buckets, so the step takes the
# ragged path (micro-batches cut to their own length, gradients accumulated in
# a jitted buffer), which must agree across processes (asserted below).
LEAN = {
    "kl.use_reference": False,
    "kl.coef": 0.0,
    "trainer.ppo_epochs": 1,
    "trainer.micro_batch_size": 2,
}


def command(workdir, processes: int, **overrides) -> list[str]:
  cmd = [sys.executable, MAIN, "--config=configs/ppo.py", f"--workdir={workdir}"]
  settings = {**TINY, **MESH, **LEAN, "cluster.trainer_processes": processes, **overrides}
  return cmd + [f"--config.{k}={v}" for k, v in settings.items()]


def env() -> dict:
  # 2 CPU devices for a 1-process trainer; each of 2 processes sets its own 1.
  return dict(
      os.environ,
      PYTHONPATH=REPO,
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="--xla_force_host_platform_device_count=2",
  )


def run(workdir, processes: int, **overrides) -> str:
  out = subprocess.run(
      command(workdir, processes, **overrides),
      cwd=REPO,
      env=env(),
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stderr


@pytest.mark.slow
def test_two_trainer_processes_survive_a_kill_by_resuming_to_the_parameters_of_one(tmp_path):
  """One process trains 2 iterations straight. Two processes train to the
  first checkpoint; process 1 is killed with SIGKILL, the run stops with one
  sentence, and the same command resumes and finishes. The resumed 2-process
  parameters equal the straight 1-process ones (a resume is exact:
  tests/test_train.py)."""
  one, two, log = tmp_path / "one", tmp_path / "two", tmp_path / "main.log"
  run(one, 1)
  # The 2-process export goes through the transfer service (its file becomes
  # the publisher's payload), the 1-process one through Ray.
  via_transfer = {"transfer.enabled": True}
  with open(log, "w") as out:
    main = subprocess.Popen(
        command(two, 2, **via_transfer), cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT
    )
  try:
    deadline = time.monotonic() + 400
    while not (two / "checkpoints" / "1").is_dir():
      assert main.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
      time.sleep(0.2)
    procs = json.loads((two / "placement.json").read_text())["trainer_processes"]
    os.kill(procs[1]["pid"], signal.SIGKILL)
    killed = time.monotonic()
    rc = main.wait(120)
  finally:
    if main.poll() is None:
      main.kill()
  stopped_s = time.monotonic() - killed
  text = log.read_text()
  assert rc != 0 and stopped_s < 120
  error = [line for line in text.splitlines() if "Trainer process 1 died" in line]
  assert error, text[-3000:]
  assert "trainer.1.log" in error[0] and "resumes" in error[0]
  assert not psutil_alive(procs[0]["pid"])  # process 0 was stopped too, not left in a collective

  # The same command again resumes from the checkpoint and finishes.
  out = run(two, 2, **via_transfer)
  assert "Resumed from iteration 1" in out + (two / "trainer.0.log").read_text()
  assert (two / "final_metrics.json").is_file()
  a = read_arrays(str(one / "checkpoints"), step=2)
  b = read_arrays(str(two / "checkpoints"), step=2)
  assert a.keys() == b.keys() and len(a) > 100  # parameters and optimizer state
  worst = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
  assert worst <= 1e-5, worst
  # The exported model: gathered from both processes, equal to the 1-process one.
  hf_one = load_file(str(one / "hf" / "model.safetensors"))
  hf_two = load_file(str(two / "hf" / "model.safetensors"))
  assert hf_one.keys() == hf_two.keys() and hf_one
  assert max(float(np.max(np.abs(hf_one[k] - hf_two[k]))) for k in hf_one) <= 1e-5
  # Every process is in placement.json, with its own pid and devices.
  placement = json.loads((two / "placement.json").read_text())
  procs = placement["trainer_processes"]
  assert [p["process_index"] for p in procs] == [0, 1]
  assert procs[0]["pid"] != procs[1]["pid"]
  assert len(procs[0]["devices"]) == len(procs[1]["devices"]) == 1
  assert not set(procs[0]["devices"]) & set(procs[1]["devices"])
  assert placement["trainer"] == procs[0]
  # A log per process (appended to by the rerun); metrics and events from
  # process 0 only: one events file per launch, each step logged once.
  assert (two / "trainer.0.log").is_file() and (two / "trainer.1.log").is_file()
  assert "Warm-start eval" in (two / "trainer.0.log").read_text()
  assert "Warm-start eval" not in (two / "trainer.1.log").read_text()
  assert len(glob.glob(str(two / "events.out.tfevents.*"))) == 2
  rows = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in rows if "reward/mean" in r]
  assert steps.count(2) == 1 and steps.count(1) <= 1 and set(steps) <= {1, 2}, steps
  # Both runs trained on ragged micro-batches (and the parameters above agree).
  for workdir in (one, two):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    ragged = [json.loads(l).get("train/ragged_micro_batches", 0) for l in lines]
    assert max(ragged) > 0, workdir


def psutil_alive(pid: int, within_s: float = 15) -> bool:
  import psutil  # pylint: disable=g-import-not-at-top

  deadline = time.monotonic() + within_s
  while time.monotonic() < deadline:
    try:
      if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
        return False
    except psutil.NoSuchProcess:
      return False
    time.sleep(0.2)
  return True
