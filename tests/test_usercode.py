"""Users' functions: loading by name, and the worker pool's deadlines."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from streamrl import usercode
from streamrl.errors import UserError

pytestmark = [pytest.mark.unit]

FUNCS = textwrap.dedent("""
    import os, time
    def echo(x, y=None, **kw):
      return (x, y, sorted(kw))
    def named(x, y):
      return x + y
    def sleep(x):
      time.sleep(x)
      return x
    def die(x):
      os._exit(3)
    def noisy(x):
      print("hello from the user's function")
      return x
    def lam(x):
      return lambda: x
    def pid(x):
      return os.getpid()
    """)


@pytest.fixture
def funcs(tmp_path):
  (tmp_path / "funcs.py").write_text(FUNCS)
  return tmp_path


def test_functions_load_by_module_or_file_name(funcs):
  assert usercode.load_function("os.path:join")("a", "b") == os.path.join("a", "b")
  assert usercode.load_function(f"{funcs}/funcs.py:named")(1, 2) == 3
  # A relative file path resolves against base_dir.
  assert usercode.load_function("funcs.py:named", base_dir=str(funcs))(2, 2) == 4


@pytest.mark.parametrize(
    "spec,match",
    [
        ("nocolon", "does not name a function"),
        ("mod:", "does not name a function"),
        ("no_such_module_xyz:f", "Cannot import module"),
        ("{d}/missing.py:f", "does not exist"),
        ("{d}/funcs.py:absent", "has no function 'absent'"),
        ("{d}/broken.py:f", "raised ZeroDivisionError"),
    ],
)
def test_a_bad_name_is_one_clear_user_error(funcs, spec, match):
  (funcs / "broken.py").write_text("1 / 0\n")
  with pytest.raises(UserError, match=match):
    usercode.load_function(spec.format(d=funcs))


def test_fields_reach_only_the_parameters_a_function_names():
  def two(response, answer, level):
    return level

  def any_(response, answer, **kw):
    return sorted(kw)

  fields = {"level": 3, "source": "gsm"}
  assert usercode.call_with_fields(two, ("r", "a"), fields) == 3
  assert usercode.call_with_fields(any_, ("r", "a"), fields) == ["level", "source"]


def test_the_pool_cuts_hangs_survives_deaths_and_keeps_answering(funcs):
  with usercode.WorkerPool(f"{funcs}/funcs.py:sleep", workers=1, timeout_s=0.5) as pool:
    first = pool.submit(0).result()
    t0 = time.monotonic()
    hung = pool.submit(30).result()
    assert hung == usercode.Failure("Timeout", "no result within 0.5 s")
    assert time.monotonic() - t0 < 5
    assert pool.submit(0.01).result() == 0.01  # A fresh worker took over.
    assert first == 0
  with usercode.WorkerPool(f"{funcs}/funcs.py:die", workers=1, timeout_s=5) as pool:
    died = pool.submit(1).result()
    assert died.kind == "WorkerDied" and "3" in died.message
    assert pool.submit(1).result().kind == "WorkerDied"  # Each call, never a hang.


def test_prints_unpicklable_results_and_in_process_calls(funcs):
  with usercode.WorkerPool(f"{funcs}/funcs.py:noisy", workers=2) as pool:
    assert pool.map([((i,), {}) for i in range(20)]) == list(range(20))
  with usercode.WorkerPool(f"{funcs}/funcs.py:lam") as pool:
    assert pool.submit(1).result().kind == "Unpicklable"
  with usercode.WorkerPool(f"{funcs}/funcs.py:echo", workers=0) as pool:
    assert pool.submit(1, z=2).result() == (1, None, ["z"])
    assert pool.submit().result().kind == "TypeError"
  with pytest.raises(UserError, match="has no function"):
    usercode.WorkerPool(f"{funcs}/funcs.py:absent")


def test_workers_exit_with_their_parent(funcs):
  """A killed run leaves no reward worker behind, even one mid-call."""
  code = textwrap.dedent(f"""
      import sys, time
      from streamrl import usercode
      pool = usercode.WorkerPool({str(funcs / "funcs.py")!r} + ":pid", workers=1)
      print(pool.submit(0).result(), flush=True)
      pool.submit(0)
      time.sleep(60)
      """)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  parent = subprocess.Popen(
      [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=root
  )
  worker = int(parent.stdout.readline())
  parent.send_signal(signal.SIGKILL)
  parent.wait()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    try:
      os.kill(worker, 0)
    except ProcessLookupError:
      break
    time.sleep(0.2)
  else:
    os.kill(worker, signal.SIGKILL)
    pytest.fail(f"worker {worker} outlived its parent")
