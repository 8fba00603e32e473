"""Test-wide setup: 8 fake CPU devices for sharding tests, in-process vLLM, the test tiers."""

import atexit
import functools
import importlib.abc
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

# Must happen before JAX initialises its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Keeps the vLLM engine in the test process: it starts several times faster.
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
# Every test file declares its tier with a module-level `pytestmark`:
#   unit    runs in this process and starts nothing heavy (sandboxed tool calls, reward
#           workers and other short subprocesses are fine): the fast lane.
#   engine  starts a real vLLM engine.
#   ray     starts or joins a Ray cluster.
#   e2e     runs launch/ scripts or the library in other processes (`slow` means the same).
# A `unit` file may mark single tests `engine`, `ray` or `e2e`; a test's tier is the heaviest
# it carries. A file without a declaration fails collection (`pytest_make_collect_report`),
# and a test outside the heavy tiers that starts an engine, a Ray node or launch/main.py fails
# (`_HeavyGuard`). The fast lane for local iteration leaves the heavy tiers out:
#   pytest -q -n 2 tests -m "not engine and not ray and not e2e"
# The README's command (what CI runs) is the whole suite on both cores:
#   pytest -q -n 2 --dist loadgroup tests
# Every test of a heavy tier (but those of BESIDE) runs on one xdist worker, one after the
# other (the "heavy" group: each starts engines, Ray or runs that want the machine's cores,
# and two at once would double each other's deadlines), while the other worker runs the unit
# tests beside them.
TIER_MARKERS = {
    "unit": "runs in the test process; starts no engine, Ray node or launch/ run",
    "engine": "starts a real vLLM engine",
    "ray": "starts or joins a Ray cluster",
    "e2e": "runs launch/ scripts or the library in other processes",
}
HEAVY = ("engine", "ray", "e2e")
# e2e files whose processes are short and start no engine, Ray or training run (main.py only
# up to its input errors): they stay out of the fast lane but run beside the heavy group, on
# the worker that is idle once the unit tests are done.
BESIDE = (
    "tests/test_launch.py",
    "tests/transfer/test_processes.py",
    "tests/trainer/test_gpu_check.py",
)


def pytest_configure(config):
  for name, what in TIER_MARKERS.items():
    config.addinivalue_line("markers", f"{name}: {what}")
  _HeavyGuard.install()


def _declared_tiers(module) -> set[str]:
  marks = getattr(module, "pytestmark", [])
  marks = marks if isinstance(marks, (list, tuple)) else [marks]
  return {getattr(m, "name", None) for m in marks} & set(TIER_MARKERS)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
  """Fails the collection of a test file that declares no tier."""
  report = yield
  if isinstance(collector, pytest.Module) and report.passed:
    if not _declared_tiers(collector.obj):
      report.outcome = "failed"
      report.longrepr = (
          f"{collector.nodeid} declares no tier: add a module-level `pytestmark = "
          f"[pytest.mark.unit]` (or engine / ray / e2e; see tests/conftest.py)."
      )
  return report


def _is_heavy(item) -> bool:
  return any(item.get_closest_marker(name) for name in HEAVY)


def pytest_collection_modifyitems(config, items):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for item in items:
    rel = os.path.relpath(str(item.path), root)
    if item.get_closest_marker("slow"):
      item.add_marker(pytest.mark.e2e)
    if (
        config.getoption("loadgroup", False)  # an xdist worker of --dist loadgroup
        and rel not in BESIDE
        and _is_heavy(item)
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


class _HeavyGuard:
  """Fails a test outside the heavy tiers that starts a vLLM engine (`LLMEngine.__init__`,
  wrapped when vLLM's module is first imported, so the guard imports nothing itself), a Ray
  node (a `gcs_server`, `raylet` or `ray start` process) or a run of a launch/ entry point
  that trains (`launch/main.py`, `launch/sweep.py`), seen through the `subprocess.Popen`
  audit event. The start is refused with an error and the test's report says why."""

  ENGINE_MODULE = "vllm.v1.engine.llm_engine"
  PROCESSES = ("gcs_server", "raylet", "launch/main.py", "launch/sweep.py")
  current = None  # the unit test running now, in this process
  seen: dict[str, list[str]] = {}  # nodeid -> what it started

  @classmethod
  def install(cls) -> None:
    if getattr(sys, "_streamrl_heavy_guard", False):
      return
    sys._streamrl_heavy_guard = True  # pylint: disable=protected-access
    sys.addaudithook(cls._audit)
    if cls.ENGINE_MODULE in sys.modules:
      cls._wrap_engine(sys.modules[cls.ENGINE_MODULE])
    else:
      sys.meta_path.insert(0, _AfterImport(cls.ENGINE_MODULE, cls._wrap_engine))

  @classmethod
  def _refuse(cls, what: str) -> None:
    item = cls.current
    if item is None:
      return
    cls.seen.setdefault(item.nodeid, []).append(what)
    raise RuntimeError(
        f"{item.nodeid} is in the fast lane but started {what}: mark its file (or the test) "
        "engine, ray or e2e (tests/conftest.py)."
    )

  @classmethod
  def _audit(cls, event: str, args) -> None:
    if event != "subprocess.Popen" or cls.current is None:
      return
    argv = args[1]
    argv = [argv] if isinstance(argv, (str, bytes)) else list(argv or ())
    words = [os.fsdecode(a) for a in argv]
    line = " ".join(words)
    for name in cls.PROCESSES:
      if name in line:
        cls._refuse(f"a process running {name}")
    ray_cli = "streamrl.cluster.local" in words or any(os.path.basename(w) == "ray" for w in words)
    if ray_cli and "start" in words:
      cls._refuse("a Ray node (ray start)")

  @classmethod
  def _wrap_engine(cls, module) -> None:
    engine = module.LLMEngine
    init = engine.__init__

    @functools.wraps(init)
    def guarded_init(self, *args, **kwargs):
      cls._refuse("a vLLM engine")
      return init(self, *args, **kwargs)

    engine.__init__ = guarded_init


class _AfterImport(importlib.abc.MetaPathFinder):
  """Calls `then(module)` once module `name` has been imported for the first time."""

  def __init__(self, name: str, then):
    self.name, self.then = name, then

  def find_spec(self, fullname, path, target=None):
    if fullname != self.name:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is None or spec.loader is None:
      return spec
    exec_module = spec.loader.exec_module

    def exec_then(module):
      exec_module(module)
      self.then(module)

    spec.loader.exec_module = exec_then
    return spec


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
  _HeavyGuard.current = None if _is_heavy(item) else item
  try:
    return (yield)
  finally:
    _HeavyGuard.current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  started = _HeavyGuard.seen.get(item.nodeid)
  if started and (report.when == "call" or report.failed):
    report.outcome = "failed"
    report.longrepr = (
        f"{item.nodeid} is in the fast lane but started {', '.join(started)}: mark its file "
        "(or the test) engine, ray or e2e (tests/conftest.py).\n\n" + str(report.longrepr or "")
    )
  return report


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
