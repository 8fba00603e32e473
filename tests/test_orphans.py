"""No orphans: every process of a run dies with its main job, `kill -9` included
(streamrl/lifecycle.py).

The first tests check the watchdog alone on plain processes (a second each).
The `slow` ones run `launch/main.py` for real (vLLM, Ray, JAX; one to two
minutes per mode on 2 cores), colocated and sync: each kills the main job
with `kill -9` once it has a live engine and a checkpoint, checks that no
process of the run is left, then runs the same command again and checks that
it resumes and finishes.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

from streamrl import lifecycle

pytestmark = [pytest.mark.e2e]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAIN = os.path.join(REPO, "launch", "main.py")
TAG = "STREAMRL_TEST_RUN_TAG"  # Marks every process a test's run starts.

# Two iterations of the tiny run, a checkpoint after each (shared by the run tests).
TINY = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())


def _env(tag: str, **extra) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in (lifecycle.ENV_VAR, "XLA_FLAGS")}
  env.update(PYTHONPATH=REPO, JAX_PLATFORMS="cpu", **{TAG: tag}, **extra)
  return env


def _tagged(tag: str) -> set[psutil.Process]:
  return {p for p in psutil.process_iter() if lifecycle.started_with(p.pid, f"{TAG}={tag}")}


def _alive(p: psutil.Process) -> bool:
  try:
    return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
  except psutil.Error:
    return False


def _survivors(procs: set[psutil.Process], tag: str, within_s: float) -> list[str]:
  """What is left of `procs` and of the processes tagged `tag` after at most
  `within_s` seconds; kills the survivors so that no test leaves any."""
  deadline = time.monotonic() + within_s
  while True:
    left = {p for p in procs | _tagged(tag) if _alive(p)}
    if not left or time.monotonic() > deadline:
      break
    time.sleep(0.2)
  names = []
  for p in left:
    try:
      names.append(f"{p.pid} {p.name()} (parent {p.ppid()})")
      p.kill()
    except psutil.Error:
      pass
  return sorted(names)


def _run_set(pid: int, tag: str) -> set[psutil.Process]:
  """The processes of the run whose main job is `pid`: its descendants and
  everything carrying the run's tag."""
  return set(psutil.Process(pid).children(recursive=True)) | _tagged(tag)


@pytest.fixture
def tag():
  """A tag for the processes of one test's runs; kills what a failure left."""
  tag = uuid.uuid4().hex
  yield tag
  _survivors(set(), tag, within_s=10)


# ----------------------------------------------------------- the watchdog alone

PARENT_PY = textwrap.dedent("""
    import subprocess, sys, time
    from streamrl import lifecycle

    guard = lifecycle.guard_children(poll_s=float(sys.argv[2]))
    # A child with a child of its own; and a process that leaves the tree at
    # once (its parent exits), retitles itself as Ray's and vLLM's do (so
    # only its tag can find it) and ignores SIGTERM (so only SIGKILL ends it).
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep', '600']).wait()"])
    escapee = (
        "import setproctitle, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "setproctitle.setproctitle('ray::Escapee'); time.sleep(600)")
    subprocess.run(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {escapee!r}])"])
    print(guard.watchdog_pid, flush=True)
    if sys.argv[1] == "exit":
      sys.exit(0)
    time.sleep(600)
    """)


def _start_parent(tmp_path, how: str, tag: str, poll_s=0.5) -> tuple[subprocess.Popen, int]:
  script = tmp_path / "parent.py"
  script.write_text(PARENT_PY)
  p = subprocess.Popen(
      [sys.executable, str(script), how, str(poll_s)],
      env=_env(tag),
      stdout=subprocess.PIPE,
      text=True,
  )
  watchdog = int(p.stdout.readline())
  # Until the sleep and the escapee (retitled) are up.
  deadline = time.monotonic() + 10
  while not {"sleep", "ray::Escapee"} <= {q.name() for q in _tagged(tag) if _alive(q)}:
    assert time.monotonic() < deadline, [q.name() for q in _tagged(tag)]
    time.sleep(0.05)
  return p, watchdog


# poll_s=60: the watchdog never looks at the tree before the parent dies (it
# learns of the death from its closed stdin), so only the tags find the rest.
@pytest.mark.parametrize("poll_s", [0.5, 60])
def test_a_killed_process_takes_its_descendants_and_watchdog_with_it(tmp_path, tag, poll_s):
  parent, watchdog = _start_parent(tmp_path, "sleep", tag, poll_s)
  procs = _run_set(parent.pid, tag)
  assert watchdog in {p.pid for p in procs}
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  assert _survivors(procs, tag, within_s=10) == []


def test_a_normal_exit_kills_nothing_and_stops_the_watchdog(tmp_path, tag):
  parent, watchdog = _start_parent(tmp_path, "exit", tag)
  assert parent.wait(30) == 0
  assert not psutil.pid_exists(watchdog) or not _alive(psutil.Process(watchdog))
  # The child, its sleep and the escapee outlived the parent: the guard stood down.
  left = _survivors(set(), tag, within_s=0)
  assert sorted(n.split()[1] for n in left) == ["python", "ray::Escapee", "sleep"], left


def test_guard_children_is_one_watchdog_per_process():
  first = lifecycle.guard_children()
  assert lifecycle.guard_children() is first and first.running()
  assert os.environ[lifecycle.ENV_VAR] == first.token
  first.stop()
  assert not first.running()
  assert lifecycle.ENV_VAR not in os.environ
  # A watchdog that died is replaced; stopping it is harmless.
  second = lifecycle.guard_children()
  assert second is not first and second.token != first.token
  os.kill(second.watchdog_pid, signal.SIGKILL)
  while second.running():
    time.sleep(0.01)
  third = lifecycle.guard_children()
  assert third is not second and third.running()
  second.stop()
  third.stop()


# ------------------------------------------------------------- real runs (slow)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "sync"])
def test_kill_9_of_the_main_job_leaves_no_process_and_the_rerun_resumes(tmp_path, tag, mode):
  """kill -9 of a run with a live engine leaves no process behind. In sync
  mode (Ray actors) the kill comes after a checkpoint and the same command
  resumes and finishes; the colocated run (the engine in a child process) is
  killed as soon as its engine is up (resuming is the same code as sync's,
  and tests/test_train.py checks a resume is exact)."""
  workdir, log = tmp_path / mode, tmp_path / "main.log"
  cmd = [sys.executable, MAIN, "--config=configs/ppo.py", f"--workdir={workdir}"]
  cmd += [f"--config.{k}={v}" for k, v in {**TINY, "pipeline.mode": mode}.items()]
  # Engine processes of their own, as in a real run (conftest keeps vLLM's
  # engine in the test process).
  env = _env(tag, VLLM_ENABLE_V1_MULTIPROCESSING="1")
  engine = {"colocated": "VLLM::EngineCore", "sync": "ray::GeneratorActor"}[mode]

  def start() -> subprocess.Popen:
    with open(log, "a") as out:
      return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

  main = start()
  try:
    deadline = time.monotonic() + 300
    while True:
      assert main.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
      procs = _run_set(main.pid, tag)
      names = sorted(p.name() for p in procs if _alive(p))
      engine_up = any(n.startswith(engine) for n in names)
      if engine_up and (mode == "colocated" or (workdir / "checkpoints" / "1").is_dir()):
        break  # A live engine (and, in sync mode, a checkpoint): kill -9 the main job.
      time.sleep(0.2)
  finally:
    main.send_signal(signal.SIGKILL)
    main.wait()
  assert _survivors(procs, tag, within_s=10) == [], names
  if mode == "colocated":
    return

  # The same command again resumes from the checkpoint and finishes.
  main = start()
  try:
    assert main.wait(300) == 0, log.read_text()[-3000:]
  finally:
    if main.poll() is None:
      main.kill()
  assert "Resumed from iteration 1" in log.read_text(), log.read_text()[-3000:]
  assert (workdir / "checkpoints" / "2").is_dir()
  assert (workdir / "final_metrics.json").is_file()
  # A normal exit leaves nothing either (no watchdog, no Ray, no engine).
  assert _survivors(set(), tag, within_s=10) == []


def test_a_wall_clock_step_does_not_make_a_live_owner_look_dead(monkeypatch):
  # A VM snapshot or an NTP step moves psutil's create_time (boot time +
  # ticks) of every process; the watchdog identifies processes by their
  # start ticks instead. (A step once made it kill a live run's Ray.)
  child = subprocess.Popen(["sleep", "30"])
  try:
    ticks = lifecycle.start_ticks(child.pid)
    assert ticks is not None and ticks >= lifecycle.start_ticks(os.getpid())
    owner = lifecycle._owner(child.pid, ticks)  # pylint: disable=protected-access
    assert owner is not None
    real = psutil.Process.create_time
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 3600.0)
    assert lifecycle._owner(child.pid, ticks) is not None  # pylint: disable=protected-access
    assert lifecycle._same(owner)  # pylint: disable=protected-access
    assert lifecycle._owner(child.pid, ticks + 1) is None  # pylint: disable=protected-access
  finally:
    child.kill()
    child.wait()
  assert not lifecycle._same(owner)  # pylint: disable=protected-access
