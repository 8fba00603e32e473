"""A process of the run killed for memory ends the run with one sentence
(streamrl/oom.py): which process, what it held, what to change; the last
checkpoint stays valid.

The unit tests read Ray's memory-monitor report and the kernel's kill count;
the e2e one starts a tiny sync run through launch/main.py and, once its
first checkpoint is written, moves the generator's process into a memory
cgroup of its own with a tiny limit, so that the kernel's out-of-memory
killer ends it as it would on a full machine.
"""

import json
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from streamrl import errors, lifecycle, oom

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())
TAG = "STREAMRL_TEST_RUN_TAG"

# What Ray 2.x puts in an actor's death error when its memory monitor killed it.
RAY_REPORT = (
    "The actor is dead because its worker process has died. Worker exit type: "
    "USER_ERROR Worker exit detail: Task was killed due to the node running low on memory.\n"
    "Memory on the node (IP: 127.0.0.1, ID: 8e6f) where the task (actor ID: 51ab, name="
    "GeneratorActor.__init__, pid=4242, memory used=3.21GB) was running was 22.80GB used / "
    "23.40GB limit (0.974). The top 10 memory consumers are:\nPID MEM(GB) COMMAND\n"
    "4242 3.21 ray::GeneratorActor\nRay killed this worker (ID: 77c1, pid=4242, actual "
    "memory used=3.21GB, worker ID=77c1) because it was the most recently scheduled task."
)


def test_rays_memory_monitor_report_becomes_one_sentence():
  watch = oom.Watch("W/trainer.log")
  killed = watch.explain("generator (instance 0, pid 4242)", RAY_REPORT)
  assert isinstance(killed, errors.RunStopped)
  text = str(killed)
  assert "\n" not in text and text.count(". ") == 0, text
  assert text.startswith("The generator (instance 0, pid 4242) was killed for memory by Ray's")
  assert "holding 3.2 GB" in text and "22.80 of 23.40 GB" in text
  for knob in ("trainer.remat", "trainer.micro_batch_size", "trainer.lora_rank"):
    assert knob in text
  assert "engine.kv_cache_gib" in text and "W/trainer.log" in text


def test_a_death_without_a_memory_kill_is_left_to_the_caller(monkeypatch):
  monkeypatch.setattr(oom, "kernel_kills", lambda: 7)
  watch = oom.Watch()
  crash = "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits."
  assert watch.explain("generator (instance 0)", crash) is None
  # The kernel killed something meanwhile: the same death is a memory kill,
  # with the memory the watch last saw.
  monkeypatch.setattr(oom, "kernel_kills", lambda: 8)
  watch.add("trainer actor", os.getpid())
  text = str(watch.explain("trainer actor", crash))
  assert "killed for memory by the kernel's out-of-memory killer holding" in text
  watch.close()


def test_a_local_ray_gets_a_monitor_threshold_the_plan_stays_under():
  env = oom.ray_env({})
  assert float(env[oom.THRESHOLD_VAR]) > 0.9
  assert oom.ray_env({oom.THRESHOLD_VAR: "0.5"})[oom.THRESHOLD_VAR] == "0.5"  # the user's wins


def _memory_cgroup() -> str | None:
  """A memory cgroup directory (v1) this process may create children in."""
  try:
    with open("/proc/self/cgroup") as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in lines:
    _, controllers, path = line.split(":", 2)
    if "memory" in controllers.split(","):
      root = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))
      if os.access(root, os.W_OK) and os.path.isfile(os.path.join(root, "memory.limit_in_bytes")):
        return root
  return None


def _tagged(tag: str, name: str) -> list[psutil.Process]:
  out = []
  for p in psutil.process_iter(["name"]):
    if (p.info["name"] or "").startswith(name) and lifecycle.started_with(p.pid, f"{TAG}={tag}"):
      out.append(p)
  return out


@pytest.mark.e2e
def test_a_generator_killed_for_memory_stops_the_run_with_one_sentence(tmp_path):
  parent = _memory_cgroup()
  if parent is None or oom.kernel_kills() is None:
    pytest.skip("needs a writable cgroup v1 memory controller and /proc/vmstat's oom_kill")
  tag, workdir = uuid.uuid4().hex, tmp_path / "run"
  overrides = {**TINY, "pipeline.mode": "sync", "trainer.num_iterations": 50, "warmstart.steps": 0}
  cmd = [sys.executable, "launch/main.py", "--config=configs/ppo.py", f"--workdir={workdir}"]
  cmd += [f"--config.{k}={v}" for k, v in overrides.items()]
  env = {k: v for k, v in os.environ.items() if k not in (lifecycle.ENV_VAR, "XLA_FLAGS")}
  env.update(JAX_PLATFORMS="cpu", **{TAG: tag})
  log = tmp_path / "main.log"
  with open(log, "w") as out:
    main = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
  cgroup = os.path.join(parent, f"streamrl-test-{tag[:8]}")
  try:
    deadline = time.monotonic() + 240
    while not (workdir / "checkpoints" / "1").is_dir() or not _tagged(tag, "ray::GeneratorActor"):
      assert main.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
      time.sleep(0.2)
    (generator,) = _tagged(tag, "ray::GeneratorActor")
    os.mkdir(cgroup)
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as f:
      f.write(str(1 << 20))  # A megabyte more and the kernel kills it.
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
      f.write(str(generator.pid))
    main.wait(timeout=120)
  finally:
    if main.poll() is None:
      main.kill()
      main.wait()
    if os.path.isdir(cgroup):
      deadline = time.monotonic() + 10
      while time.monotonic() < deadline:
        try:
          os.rmdir(cgroup)
          break
        except OSError:  # Still holds a dying process.
          time.sleep(0.2)
  stderr = log.read_text()
  assert main.returncode == 1, stderr[-3000:]
  last = stderr.strip().splitlines()[-1]
  assert last.startswith(
      f"error: The generator (instance 0, pid {generator.pid}) was killed for memory by the "
      "kernel's out-of-memory killer holding "
  ), stderr[-3000:]
  assert "trainer.micro_batch_size" in last and "trainer.log" in last
  assert "Traceback" not in stderr and "Worker exit type" not in stderr, stderr[-3000:]
  # The last checkpoint is whole: its step is listed (Orbax lists finished ones only).
  from streamrl import config as config_lib
  from streamrl.config import settings
  from streamrl.trainer import setup

  config = config_lib.apply_overrides(
      config_lib.load_config(os.path.join(REPO, "configs", "ppo.py")), overrides
  )
  ckpt = setup.open_checkpoints(settings.from_config(config), str(workdir))
  try:
    assert ckpt.latest_step() >= 1
  finally:
    ckpt.close()
