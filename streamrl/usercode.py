"""Users' code: loading a function by name, and calling it in worker processes
with a deadline.

A function is named `package.module:function` (importable),
`path/to/file.py:function`, or `path/to/file.py` for its `compute_score`
(verl's default name). A relative path resolves against `base_dir`, the
config file's directory when the caller knows it, else the current
directory. Rewards use it (`task.reward`), and so will tools.

`WorkerPool` runs the calls in `workers` child processes, not threads: a
call that hangs is cut at its deadline by killing its process (a thread
cannot be killed), and libraries that time themselves out with signals
(`math-verify`) need a process's main thread. Each call either returns the
function's result or a `Failure` naming what went wrong (raised, timed out,
the worker died, the result would not pickle); the pool never raises for a
call, and a dead or killed worker is replaced before the next call. The
children are plain `python -m streamrl.usercode` processes talking over
pipes (no fork of a multithreaded JAX process, no re-import of the parent's
main script); each exits when its parent does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import importlib.util
import inspect
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from streamrl.errors import UserError

_HEADER = struct.Struct("<Q")
_MAX_MESSAGE = 64 << 20  # A result over 64 MiB is garbage, not a reward.


DEFAULT_FUNCTION = "compute_score"  # A `file.py` named alone means this function (verl's name).


def split_spec(spec: str) -> tuple[str, str]:
  """`module:function`, `file.py:function` or `file.py` (its `compute_score`)
  -> (where, function name)."""
  if spec.endswith(".py"):
    return spec, DEFAULT_FUNCTION
  where, sep, name = spec.rpartition(":")
  if not sep or not where or not name.isidentifier():
    raise UserError(
        f"{spec!r} does not name a function; write `package.module:function`, "
        "`path/to/file.py:function` or `path/to/file.py` (its compute_score)."
    )
  return where, name


def is_spec(name: str) -> bool:
  """Whether `name` names a user's function (has a `:`, or is a `.py` file)
  rather than a built-in."""
  return ":" in name or name.endswith(".py")


def resolve_spec(spec: str, base_dir: str | None = None) -> str:
  """The spec with a relative `file.py` path made absolute against `base_dir`."""
  where, name = split_spec(spec)
  if where.endswith(".py") and not os.path.isabs(where):
    where = os.path.abspath(os.path.join(base_dir or os.getcwd(), where))
  return f"{where}:{name}"


def load_function(spec: str, *, base_dir: str | None = None, what: str = "function") -> Callable:
  """The callable `spec` names; UserError with the fix when it cannot be loaded."""
  where, name = split_spec(resolve_spec(spec, base_dir))
  if where.endswith(".py"):
    if not os.path.isfile(where):
      raise UserError(f"The {what} file {where!r} does not exist; fix the path in {spec!r}.")
    module_name = f"_streamrl_user_{abs(hash(where)):x}"
    loader_spec = importlib.util.spec_from_file_location(module_name, where)
    module = importlib.util.module_from_spec(loader_spec)
    try:
      loader_spec.loader.exec_module(module)
    except Exception as err:  # pylint: disable=broad-except
      raise UserError(
          f"Importing the {what} file {where!r} raised {type(err).__name__}: {err}; fix the file."
      ) from err
  else:
    try:
      module = importlib.import_module(where)
    except ImportError as err:
      raise UserError(
          f"Cannot import module {where!r} for the {what} {spec!r} ({err}); install it or give "
          "a file path (`path/to/file.py:function`)."
      ) from err
  fn = getattr(module, name, None)
  if not callable(fn):
    raise UserError(f"{where!r} has no function {name!r}; fix the {what} name {spec!r}.")
  return fn


def call_with_fields(fn: Callable, args: tuple, fields: dict) -> Any:
  """`fn(*args, **fields)`, passing only the fields it names (all of them when
  it takes `**kwargs`): a function reads the columns it wants."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return fn(*args)
  if any(p.kind is p.VAR_KEYWORD for p in params):
    return fn(*args, **fields)
  named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  return fn(*args, **{k: v for k, v in fields.items() if k in named})


@dataclasses.dataclass(frozen=True)
class Failure:
  """Why a call gave no result: `kind` is the exception's class name, or
  `Timeout`, `WorkerDied`, `Unpicklable`; `message` says more."""

  kind: str
  message: str


# ------------------------------------------------------------- the worker
def _read_exact(stream, n: int) -> bytes:
  data = b""
  while len(data) < n:
    chunk = stream.read(n - len(data))
    if not chunk:
      raise EOFError
    data += chunk
  return data


def _send(stream, obj) -> None:
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  stream.write(_HEADER.pack(len(data)) + data)
  stream.flush()


def _watch_parent(parent: int) -> None:
  """Exits this worker when its parent is gone, even mid-call."""
  while True:
    time.sleep(1.0)
    if os.getppid() != parent:
      os._exit(0)  # pylint: disable=protected-access


def _worker_main(spec: str, parent: int) -> None:
  """The child: loads `spec`, then answers (args, fields) calls until EOF."""
  threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
  stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
  # The user's prints must not corrupt the reply stream.
  sys.stdout = sys.stderr
  try:
    fn = load_function(spec)
  except Exception as err:  # pylint: disable=broad-except
    _send(stdout, ("load_error", f"{type(err).__name__}: {err}"))
    return
  _send(stdout, ("ready", None))
  while True:
    try:
      (size,) = _HEADER.unpack(_read_exact(stdin, _HEADER.size))
      args, fields = pickle.loads(_read_exact(stdin, size))
    except EOFError:
      return
    try:
      reply = ("ok", call_with_fields(fn, args, fields))
    except BaseException as err:  # pylint: disable=broad-except
      reply = ("error", (type(err).__name__, str(err)[:500]))
    try:
      _send(stdout, reply)
    except Exception as err:  # pylint: disable=broad-except
      _send(stdout, ("error", ("Unpicklable", f"the result would not pickle: {err}")))


# --------------------------------------------------------------- the pool
class _Worker:
  """One child process and its pipes."""

  def __init__(self, spec: str, start_timeout_s: float):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "streamrl.usercode", spec, str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    status, detail = self.receive(start_timeout_s)
    if status == "load_error":
      self.kill()
      raise UserError(f"Loading {spec!r} in a worker process failed ({detail}); fix it.")
    if status != "ready":
      self.kill()
      raise UserError(f"The worker process for {spec!r} did not start ({detail}).")

  def receive(self, timeout_s: float | None) -> tuple[str, Any]:
    """The next reply, or ("timeout", None) / ("died", why)."""
    out = self.proc.stdout
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    buf = b""
    need = _HEADER.size
    size = None
    while len(buf) < need:
      left = None if deadline is None else deadline - time.monotonic()
      if left is not None and left <= 0:
        return "timeout", None
      ready, _, _ = select.select([out], [], [], left)
      if not ready:
        return "timeout", None
      chunk = os.read(out.fileno(), need - len(buf))
      if not chunk:
        try:
          code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
          code = None
        return "died", f"exit code {code}"
      buf += chunk
      if size is None and len(buf) == _HEADER.size:
        (size,) = _HEADER.unpack(buf)
        if size > _MAX_MESSAGE:
          return "died", f"a reply of {size} bytes"
        buf, need = b"", size
    try:
      return pickle.loads(buf)
    except Exception as err:  # pylint: disable=broad-except
      return "died", f"an unreadable reply ({err})"

  def call(self, args: tuple, fields: dict, timeout_s: float | None) -> Any:
    try:
      _send(self.proc.stdin, (args, fields))
    except (BrokenPipeError, OSError):
      return Failure("WorkerDied", f"exit code {self.proc.poll()}")
    except Exception as err:  # pylint: disable=broad-except
      return Failure("Unpicklable", f"the arguments would not pickle: {err}")
    status, value = self.receive(timeout_s)
    if status == "ok":
      return value
    if status == "error":
      return Failure(*value)
    if status == "timeout":
      return Failure("Timeout", f"no result within {timeout_s} s")
    return Failure("WorkerDied", str(value))

  def alive(self) -> bool:
    return self.proc.poll() is None

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait()
    for f in (self.proc.stdin, self.proc.stdout):
      try:
        f.close()
      except OSError:
        pass


class WorkerPool:
  """Calls the function `spec` names in `workers` processes, each call with a
  deadline. `submit` returns a Future of the result or a `Failure`; `workers=0`
  calls it in this process instead (no deadline: for trusted, fast code).

  The first worker starts (and loads the function) in the constructor, so a
  function that cannot be loaded is refused before the run begins.
  """

  def __init__(
      self,
      spec: str,
      *,
      workers: int = 1,
      timeout_s: float | None = 10.0,
      base_dir: str | None = None,
      start_timeout_s: float = 60.0,
  ):
    if workers < 0:
      raise UserError(f"workers={workers} must be >= 0 (0: in this process).")
    self.spec = resolve_spec(spec, base_dir) if is_spec(spec) else spec
    self.timeout_s = timeout_s
    self._start_timeout_s = start_timeout_s
    self._queue: queue.Queue = queue.Queue()
    self._closed = False
    self._threads: list[threading.Thread] = []
    self._local: Callable | None = None
    self._live: set[_Worker] = set()
    if workers == 0:
      self._local = load_function(self.spec)
      return
    first = _Worker(self.spec, start_timeout_s)
    self._live.add(first)
    for k in range(workers):
      t = threading.Thread(
          target=self._serve, args=(first if k == 0 else None,), daemon=True, name=f"usercode-{k}"
      )
      t.start()
      self._threads.append(t)

  def submit(self, *args, **fields) -> concurrent.futures.Future:
    return self.call_async(args, fields)

  def call_async(
      self, args: tuple, fields: dict, *, timeout_s: float | None = None
  ) -> concurrent.futures.Future:
    """`submit` with the call's own deadline (None: the pool's `timeout_s`)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if self._local is not None:
      try:
        future.set_result(call_with_fields(self._local, args, fields))
      except Exception as err:  # pylint: disable=broad-except
        future.set_result(Failure(type(err).__name__, str(err)[:500]))
      return future
    if self._closed:
      raise RuntimeError("submit() after close()")
    self._queue.put((future, args, fields, self.timeout_s if timeout_s is None else timeout_s))
    return future

  def map(self, calls: list[tuple[tuple, dict]]) -> list[Any]:
    """Results (or Failures) of [(args, fields), ...], in order."""
    futures = [self.submit(*a, **f) for a, f in calls]
    return [f.result() for f in futures]

  def _serve(self, worker: _Worker | None) -> None:
    while True:
      item = self._queue.get()
      if item is None:
        break
      future, args, fields, timeout_s = item
      if worker is None or not worker.alive():
        try:
          worker = _Worker(self.spec, self._start_timeout_s)
        except Exception as err:  # pylint: disable=broad-except
          future.set_result(Failure("WorkerDied", f"could not restart the worker: {err}"))
          worker = None
          continue
        self._live.add(worker)
      try:
        result = worker.call(args, fields, timeout_s)
      except Exception as err:  # pylint: disable=broad-except  (close() killed it mid-call)
        result = Failure("WorkerDied", str(err))
      if isinstance(result, Failure) and result.kind in ("Timeout", "WorkerDied"):
        worker.kill()  # A hung call is cut here; the next call gets a fresh worker.
        self._live.discard(worker)
        worker = None
      future.set_result(result)
    if worker is not None:
      worker.kill()
      self._live.discard(worker)

  def close(self) -> None:
    """Stops the workers (a call still running is killed)."""
    if self._closed:
      return
    self._closed = True
    for _ in self._threads:
      self._queue.put(None)
    for t in self._threads:
      t.join(timeout=1.0)
    for worker in list(self._live):  # Still in a call: killed, its thread returns.
      worker.kill()
    for t in self._threads:
      t.join(timeout=5.0)

  def __enter__(self) -> "WorkerPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


if __name__ == "__main__":
  _worker_main(sys.argv[1], int(sys.argv[2]))
