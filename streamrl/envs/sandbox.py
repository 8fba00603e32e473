"""Running model-written code: a sandbox of its own per call.

The code a `python` tool runs is written by the policy being trained, which
RL pushes toward whatever raises its reward, so it is treated as an
adversary's. `run` (a command) and `python` (Python source) run it in one of
two modes (`env.sandbox`):

- `isolated` (the default) puts each call in new user, mount, PID, network,
  IPC, UTS and cgroup namespaces (unprivileged user namespaces, so it needs
  neither root nor docker; the program that sets them up is `jail.py`):
  * it runs as an unprivileged uid with no capabilities and
    `PR_SET_NO_NEW_PRIVS`; when the host runs as root, that uid is mapped to
    the outer `nobody`, so a write that escaped would not be root's;
  * it sees a read-only view of what the interpreter needs (the system's
    `/usr`, `/bin`, `/lib*`, the interpreter's prefix, and the paths a caller
    names), a few devices, a `/proc` of its own namespace, and a private
    size-capped tmpfs at `/tmp`, its working directory; nothing else of the
    host's files, its home directory included;
  * it is PID 1's child in its own PID namespace: it cannot see or signal the
    host's processes, and when it exits or its deadline passes, every process
    it started is killed before the call returns;
  * its network namespace has no interface up, not even loopback;
  * CPU time, address space, file size, open files and processes are limited,
    and it may create no user namespace of its own;
  * not bounded: memory of all its processes together (each has the
    address-space limit; a whole bound needs a cgroup, which an unprivileged
    user is seldom given).
  Where the kernel refuses user namespaces (or mounts in them), the call
  raises `SandboxUnavailable`, one sentence naming `env.sandbox=unsafe`;
  nothing falls back silently.
- `unsafe`, chosen explicitly, is the older subprocess: the same resource
  limits (but the process count), an empty temporary directory, a new
  session killed whole at the end, a network namespace where the kernel gives
  one (else the host's network); the code can read and write whatever the
  run's user can, and see and signal its processes.

Either way the call returns by its deadline whatever the code's children do:
output goes to files, not pipes a stray child could hold open.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import select
import signal
import subprocess
import sys
import tempfile
from typing import Mapping, Sequence

from streamrl.errors import UserError

MODES = ("isolated", "unsafe")
MEMORY_BYTES = 512 << 20
FILE_BYTES = 1 << 20
OPEN_FILES = 64
PROCESSES = 64
TMP_BYTES = 64 << 20
OUTPUT_BYTES = 64 << 10  # read back from each of stdout and stderr
SANDBOX_UID = 65534  # inside; and outside too when the host runs as root
# What a command needs to run, read-only, where the system has it.
SYSTEM_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/alternatives",
)
_JAIL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail.py")
_GRACE_S = 5.0  # past the deadline, the supervisor itself is killed

_default_mode = "isolated"
_checked: set[str] = set()


class SandboxUnavailable(UserError):
  """The kernel refuses what the isolated sandbox needs."""


@dataclasses.dataclass(frozen=True)
class Result:
  """How a sandboxed call ended.

  `returncode` is the exit status, negative for a signal (as subprocess's), None when the
  call was cut at its deadline (`timed_out`); `stdout` and `stderr` are the first
  `OUTPUT_BYTES` of each, decoded as UTF-8.
  """

  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool = False


def check_mode(mode: str) -> None:
  if mode not in MODES:
    raise UserError(
        f"env.sandbox={mode!r} is unknown; use 'isolated' (the default) or 'unsafe' "
        "(no isolation, resource limits only)."
    )


def set_default_mode(mode: str) -> None:
  """The mode of calls that name none (a tool worker sets the run's `env.sandbox`)."""
  global _default_mode
  check_mode(mode)
  _default_mode = mode


def interpreter() -> str:
  """This Python's real executable (a virtualenv's `python` is a link to it)."""
  return os.path.realpath(sys.executable)


def python(code: str, **kwargs) -> Result:
  """`run` of Python source `code` with this interpreter, isolated (`-I -S`: no site
  packages, no environment variables read)."""
  return run([interpreter(), "-I", "-S", "-c", code], **kwargs)


def run(
    argv: Sequence[str],
    *,
    timeout_s: float = 5.0,
    files: Mapping[str, str] | None = None,
    read_only: Sequence[str] = (),
    mode: str | None = None,
) -> Result:
  """Runs the command `argv` in a sandbox (see the module docstring) and returns how it ended.

  Args:
    argv: the command and its arguments; a bare name is looked up in `/usr/bin:/bin`.
    timeout_s: wall-clock deadline of the whole call; past it every process of the call is
      killed and the result says `timed_out`. CPU time is limited to it as well.
    files: text files (name -> content) written into the working directory first.
    read_only: host paths the command may read besides the system's (a data directory,
      a virtualenv's site-packages), at the same path inside.
    mode: "isolated" or "unsafe"; None is the process's default (`env.sandbox` in a
      tool worker, else "isolated").
  """
  mode = mode or _default_mode
  check_mode(mode)
  if not argv or not all(isinstance(a, str) for a in argv):
    raise ValueError("argv must be a non-empty sequence of strings")
  files = dict(files or {})
  for name in files:
    if not name or "/" in name or name in (".", ".."):
      raise ValueError(f"file name {name!r} must be a plain name in the working directory")
  timeout_s = float(timeout_s)
  if mode == "unsafe":
    return _run_unsafe(list(argv), timeout_s, files)
  return _run_isolated(list(argv), timeout_s, files, read_only)


def check(mode: str | None = None) -> None:
  """Raises `SandboxUnavailable` unless the sandbox of `mode` can run here (once per process)."""
  mode = mode or _default_mode
  check_mode(mode)
  if mode in _checked:
    return
  result = python("pass", timeout_s=30.0, mode=mode)
  if result.returncode != 0:
    raise SandboxUnavailable(
        f"The {mode} sandbox ran no code here (exit status {result.returncode}, "
        f"{result.stderr.strip()[-200:]!r}); fix the interpreter or set env.sandbox."
    )
  _checked.add(mode)


def _unavailable(why: str) -> SandboxUnavailable:
  return SandboxUnavailable(
      f"The sandbox for model-written code cannot be made on this machine ({why}): the "
      "kernel refuses unprivileged user namespaces or mounts in them, so allow them "
      "(sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone=1, "
      "kernel.apparmor_restrict_unprivileged_userns=0) or set env.sandbox=unsafe to run "
      "that code without isolation (resource limits only)."
  )


# ------------------------------------------------------------- isolated
def _read_only_paths(extra: Sequence[str]) -> list[str]:
  """The host paths bound read-only, outermost first, none inside another."""
  paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)]
  for path in (sys.base_prefix, os.path.dirname(interpreter()), *extra):
    real = os.path.realpath(path)
    if not os.path.exists(real):
      raise UserError(f"The sandbox's read-only path {path!r} does not exist; fix it.")
    if real == "/" or real.split("/")[1] in ("proc", "dev", "sys"):
      raise UserError(
          f"The sandbox's read-only path {path!r} would show it the host's system; name the "
          "directories it needs instead."
      )
    paths.append(real)
  kept: list[str] = []
  for path in sorted(set(paths), key=len):
    if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
      kept.append(path)
  return kept


def _run_isolated(argv, timeout_s, files, read_only) -> Result:
  with (
      tempfile.TemporaryFile() as spec_file,
      tempfile.TemporaryFile() as out,
      tempfile.TemporaryFile() as err,
      tempfile.TemporaryFile() as diagnostics,
  ):
    spec = {
        "argv": argv,
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp"},
        "files": files,
        "timeout_s": timeout_s,
        "parent": os.getpid(),
        "uid": SANDBOX_UID,
        "root_maps_to": SANDBOX_UID,
        "ro_paths": _read_only_paths(read_only),
        "tmp_bytes": TMP_BYTES,
        "limits": {
            "RLIMIT_CPU": max(1, int(timeout_s) + 1),
            "RLIMIT_AS": MEMORY_BYTES,
            "RLIMIT_FSIZE": FILE_BYTES,
            "RLIMIT_NOFILE": OPEN_FILES,
            "RLIMIT_NPROC": PROCESSES,
            "RLIMIT_CORE": 0,
        },
        "stdout_fd": out.fileno(),
        "stderr_fd": err.fileno(),
    }
    spec_file.write(marshal.dumps(spec))
    spec_file.seek(0)
    with subprocess.Popen(
        [interpreter(), "-I", "-S", _JAIL],
        stdin=spec_file,
        stdout=subprocess.PIPE,
        stderr=diagnostics,
        pass_fds=(out.fileno(), err.fileno()),
    ) as supervisor:
      try:
        answer, _ = supervisor.communicate(timeout=timeout_s + _GRACE_S)
      except subprocess.TimeoutExpired:
        # Never seen: the supervisor keeps the deadline. Its init dies with it.
        supervisor.kill()
        supervisor.wait()
        answer = marshal.dumps({"timed_out": True})
    try:
      reply = marshal.loads(answer)
    except (EOFError, ValueError, TypeError):
      diagnostics.seek(0)
      raise RuntimeError(
          "the sandbox's supervisor died: " + diagnostics.read().decode(errors="replace")[-500:]
      ) from None
    if "unavailable" in reply:
      raise _unavailable(reply["unavailable"])
    if "exec_error" in reply:
      return Result(127, "", reply["exec_error"])
    stdout, stderr = _read(out), _read(err)
    if reply.get("timed_out"):
      return Result(None, stdout, stderr, timed_out=True)
    return Result(os.waitstatus_to_exitcode(reply["status"]), stdout, stderr)


def _read(f) -> str:
  f.seek(0)
  return f.read(OUTPUT_BYTES).decode("utf-8", "replace")


# --------------------------------------------------------------- unsafe
def _unsafe_preexec(cpu_s: int) -> None:
  """In the child before exec: dies with its parent, a session of its own, limits, and a
  network namespace where the kernel gives one (else it keeps the host's network)."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import resource  # pylint: disable=g-import-not-at-top

  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
  os.setsid()
  if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET, else with a user namespace
    libc.unshare(0x10000000 | 0x40000000)
  resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
  resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
  resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
  resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run_unsafe(argv, timeout_s, files) -> Result:
  with (
      tempfile.TemporaryDirectory(prefix="streamrl-sandbox-") as work,
      tempfile.TemporaryFile() as out,
      tempfile.TemporaryFile() as err,
  ):
    for name, text in files.items():
      with open(os.path.join(work, name), "w") as f:
        f.write(text)
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        argv,
        cwd=work,
        env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work},
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        preexec_fn=lambda: _unsafe_preexec(max(1, int(timeout_s) + 1)),
    )
    # Waited on without reaping, so its process group is still its own when killed.
    pidfd = os.pidfd_open(proc.pid)
    try:
      exited = bool(select.select([pidfd], [], [], timeout_s)[0])
    finally:
      os.close(pidfd)
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    code = proc.wait()
    stdout, stderr = _read(out), _read(err)
  if not exited:
    return Result(None, stdout, stderr, timed_out=True)
  return Result(code, stdout, stderr)
