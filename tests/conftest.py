"""Test-wide setup: 8 fake CPU devices for sharding tests, in-process vLLM."""

import atexit
import os
import shutil
import tempfile

import pytest

# Must happen before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Keeps the vLLM engine in the test process: ~2 s start-up instead of ~15 s.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Converted tokenizers (streamrl/data/tokenizer.py) built once per session.
if "STREAMRL_CACHE" not in os.environ:
  os.environ["STREAMRL_CACHE"] = tempfile.mkdtemp(prefix="streamrl-test-cache-")
  atexit.register(shutil.rmtree, os.environ["STREAMRL_CACHE"], ignore_errors=True)
# One persistent XLA compilation cache for the whole session, inherited by the
# runs tests start (subprocesses, Ray actors): the tiny model's train and
# logprob steps compile once per shape instead of once per test.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="streamrl-test-xla-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# ------------------------------------------------------------------ tiers
# What each module starts beyond this process: a vLLM engine (`engine`), a
# Ray cluster (`ray`), a whole run of launch/main.py or the library in other
# processes (`e2e`; the old `slow` marker means the same). The fast lane for
# local iteration leaves them out:
#   pytest -q -n 2 tests -m "not engine and not ray and not e2e"
# The README's command (what CI runs) is the whole suite on both cores:
#   pytest -q -n 2 --dist loadgroup tests
# Every test of a tier (but those of BESIDE) runs on one xdist worker, one after the other (the
# "heavy" group: each starts engines, Ray or runs that want the machine's
# cores, and two at once would double each other's deadlines), while the
# other worker runs the unit tests beside them.
HEAVY = ("engine", "ray", "e2e")
# e2e files whose processes are short and start no engine, Ray or training
# run (main.py only up to its input errors): they stay out of the fast lane
# but run beside the heavy group, on the worker that is idle once the unit
# tests are done.
BESIDE = (
    "tests/test_launch.py",
    "tests/transfer/test_processes.py",
    "tests/trainer/test_gpu_check.py",
)
TIERS = {
    "tests/generator/test_vllm_engine.py": ("engine",),
    "tests/scheduling/test_profiler.py": ("engine",),
    "tests/generator/test_service.py": ("engine", "ray"),
    "tests/generator/test_service_transfer.py": ("engine", "ray"),
    "tests/generator/test_placement.py": ("ray",),
    "tests/elastic/test_controller.py": ("engine", "ray"),
    "tests/scheduling/test_ranker_actor.py": ("ray",),
    "tests/test_experiment.py": ("engine", "ray", "e2e"),
    "tests/test_train.py": ("engine",),
    "tests/test_launch.py": ("e2e",),
    "tests/test_multihost.py": ("e2e",),
    "tests/test_multinode.py": ("ray", "e2e"),
    "tests/transfer/test_processes.py": ("e2e",),
    "tests/trainer/test_gpu_check.py": ("e2e",),
    "tests/trainer/test_export_launch.py": ("engine", "e2e"),
    "tests/test_orphans.py": ("e2e",),
    "tests/test_loopback.py": ("ray",),
    "tests/envs/test_trajectories.py": ("engine",),
    "tests/data/test_user_jobs.py": ("engine", "e2e"),
}


def pytest_configure(config):
  for name, what in (
      ("engine", "starts a real vLLM engine"),
      ("ray", "starts or joins a Ray cluster"),
      ("e2e", "runs launch/ scripts or the library in other processes"),
  ):
    config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config, items):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for item in items:
    rel = os.path.relpath(str(item.path), root)
    for name in TIERS.get(rel, ()):
      item.add_marker(getattr(pytest.mark, name))
    if item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.e2e)
    if (
        config.getoption("loadgroup", False)  # an xdist worker of --dist loadgroup
        and rel not in BESIDE
        and any(item.get_closest_marker(name) for name in HEAVY)
    ):
      _into_group(item, "heavy")


def _into_group(item, group: str) -> None:
  """Puts `item` in xdist group `group`: `--dist loadgroup` schedules by a `@group` suffix of
  the node id. pytest-xdist 3.8 writes that suffix into `item._nodeid`, which pytest 9.2 no
  longer reads (its ids are structured, `item._id`), so the group is set here."""
  from _pytest.nodeid import NodeId  # pylint: disable=g-import-not-at-top

  item._id = NodeId.parse(f"{item.nodeid}@{group}")  # pylint: disable=protected-access
  if not item.nodeid.endswith(f"@{group}"):
    raise pytest.UsageError(
        "Cannot group the engine/ray/e2e tests on one xdist worker with this pytest; run the "
        "suite without -n (pytest -q tests)."
    )


@pytest.fixture(scope="session", autouse=True)
def _no_dead_processes_files_in_dev_shm():
  """At the end of the session, removes the /dev/shm files of processes that died without
  unlinking them (tests kill receivers, runs and their resource trackers): the next session,
  and whatever else runs on this machine, would otherwise find model-sized leftovers there.

  It sweeps rather than asserts: files of this process and of live ones are left alone.
  """
  yield
  from streamrl import lifecycle  # pylint: disable=g-import-not-at-top

  lifecycle.sweep_shm()
