"""No orphans: the processes a run starts die with the process that started them.

  from streamrl import lifecycle
  lifecycle.guard_children()   # early, in every process that starts engines or Ray

Mechanism: a watchdog process. `guard_children` starts one small process (this
file run as a script: it imports nothing but psutil) that watches the calling
process. Every `poll_s` it records the caller's descendants (pid and creation
time). If the caller dies without exiting normally (`kill -9`, any fatal
signal, `os._exit`, a crash), the watchdog ends (SIGTERM, then SIGKILL for
what is still there 2 s later):

- every process it last saw among the caller's descendants, and their own
  descendants now (once the caller is dead its children are re-parented to
  init, so its tree can no longer be walked: the watchdog remembers it);
- every process whose environment carries this guard's token (the
  `STREAMRL_GUARD` variable, set in the caller before anything starts, is
  inherited by all it starts): a process started after the last look, or one
  that left the tree (a daemon, or the child of a process that died), is
  still found. (`SPT_NOENV=1`, set along with it, keeps the processes that
  retitle themselves, as Ray's and vLLM's do, from erasing it.)

A process is known by its pid and creation time, so a reused pid is never
hit. multiprocessing's resource tracker is ended last, so that it can first
unlink what its dead users left in /dev/shm (vLLM's message queues); then the
watchdog removes the transfer service's /dev/shm files of dead processes
that no tracker lived to unlink (`sweep_shm`) and exits. On a normal exit
of the caller (`atexit`, which also runs after an uncaught exception or
Ctrl-C) the guard tells the watchdog to stand down: nothing is killed, and
the caller waits for the watchdog to exit, so none is left behind.

Why a watchdog rather than the alternatives:
- `prctl(PR_SET_PDEATHSIG)` is set by each child on itself, after fork. vLLM
  starts its EngineCore and worker processes, and Ray its daemons and
  workers, with code we do not control; and the signal follows the death of
  the *thread* that forked the child, not of the process.
- A process group or session: after `kill -9` no one is left to signal the
  group, and Ray puts each of its workers in a process group of its own.
A watchdog outside the guarded process needs no one's cooperation.

Ray, as observed (Ray 2.60, vLLM CPU, `kill -9` of the driver):
- Local Ray (the driver started it): gcs_server, raylet and the actors'
  worker processes die by themselves (Ray's fate sharing), but
  `ray::DashboardAgent` and `ray::RuntimeEnvAgent` are re-parented to init
  and keep running; without a Ray, in the colocated mode, vLLM's EngineCore
  and its worker keep running. All of them are the
  driver's descendants and carry its token: its watchdog kills them.
- Joined cluster (`cluster.address`): the driver starts no Ray process; the
  daemons are neither its descendants nor tagged, so they are left alone
  (checked: all still up after the kill). Ray kills our non-detached actors
  when their owner dies (the TrainerActor with the driver, the generator
  actors with the TrainerActor), and kills an exiting worker's child
  processes and process group; each actor's own guard (`TrainerActor`,
  `GeneratorActor`) covers the engine processes it started wherever that
  does not reach (a worker killed outright, a process in a group of its own).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import secrets
import select
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid

import psutil

ENV_VAR = "STREAMRL_GUARD"
POLL_S = 0.5
GRACE_S = 2.0  # From SIGTERM to SIGKILL.
_STOP = b"stop\n"


class Guard:
  """The watchdog of one process (see `guard_children`)."""

  def __init__(self, proc: subprocess.Popen, token: str):
    self._proc = proc
    self.token = token
    self.owner_pid = os.getpid()

  @property
  def watchdog_pid(self) -> int:
    return self._proc.pid

  def running(self) -> bool:
    return self._proc.poll() is None

  def stop(self, timeout_s: float = 5.0) -> None:
    """Stands the watchdog down, killing nothing, and waits for it to exit."""
    global _guard
    if os.getpid() != self.owner_pid:
      return  # A forked child's copy: the watchdog is its parent's.
    try:
      self._proc.stdin.write(_STOP)
      self._proc.stdin.flush()
    except (OSError, ValueError):
      pass  # Already stopped, or the watchdog is gone.
    try:
      self._proc.stdin.close()
    except OSError:
      pass
    try:
      self._proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()
    with _lock:
      if _guard is self:
        _guard = None
      if os.environ.get(ENV_VAR) == self.token:
        del os.environ[ENV_VAR]


_guard: Guard | None = None
_lock = threading.Lock()


def guard_children(poll_s: float = POLL_S) -> Guard:
  """Makes every process this one starts from now on die with it.

  Starts this process's watchdog, once: later calls return the same `Guard`.
  It stands down by itself when this process exits normally; `Guard.stop()`
  does it sooner.
  """
  global _guard
  with _lock:
    if _guard is not None and _guard.owner_pid == os.getpid() and _guard.running():
      return _guard
    me = psutil.Process()
    token = f"{me.pid}-{uuid.uuid4().hex}"
    # Before anything else starts: whatever this process starts inherits it.
    os.environ[ENV_VAR] = token
    # Ray's and vLLM's processes set their titles with setproctitle, which by
    # default overwrites the environment block that /proc shows (and the token
    # with it); SPT_NOENV keeps the title within the command line's space.
    os.environ.setdefault("SPT_NOENV", "1")
    proc = subprocess.Popen(
        # -I: no PYTHONPATH, no script folder on sys.path; this file needs
        # only psutil.
        [sys.executable, "-I", os.path.abspath(__file__)]
        + [str(me.pid), str(start_ticks(me.pid)), token, str(poll_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        # Out of the terminal's process group: Ctrl-C reaches only the run,
        # which then exits normally and stands the watchdog down.
        start_new_session=True,
    )
    _guard = Guard(proc, token)
    atexit.register(_guard.stop)
    return _guard


# ------------------------------------------------------ the watchdog process


def start_ticks(pid: int) -> int | None:
  """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat).

  Unlike psutil's create_time (boot time + ticks, in wall-clock seconds) it
  does not move when the wall clock is stepped (NTP, a VM snapshot or
  migration), so a live process is never taken for a new one.
  """
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      data = f.read()
  except OSError:
    return None
  return int(data[data.rindex(b")") + 2 :].split()[19])  # field 22: starttime


def _same(p: psutil.Process) -> bool:
  """Whether `p` still runs: same pid and start time as when first seen, not a zombie."""
  first = getattr(p, "_streamrl_ticks", None)
  if first is None:
    first = p._streamrl_ticks = start_ticks(p.pid)  # pylint: disable=protected-access
  if first is None or start_ticks(p.pid) != first:
    return False
  try:
    return p.status() != psutil.STATUS_ZOMBIE
  except psutil.Error:
    return False


def _owner(pid: int, ticks: int) -> psutil.Process | None:
  if start_ticks(pid) != ticks:
    return None
  try:
    p = psutil.Process(pid)
  except psutil.Error:
    return None
  p._streamrl_ticks = ticks  # pylint: disable=protected-access
  return p if _same(p) else None


def started_with(pid: int, entry: str) -> bool:
  """Whether process `pid` started with `entry` ("NAME=value") in its environment.

  Read raw from /proc: when a process sets its title without SPT_NOENV, part
  of that block is zeroed and psutil's `environ()` returns nothing at all,
  while the entries after the zeroed part can still be read.
  """
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      return entry.encode() in f.read().split(b"\0")
  except OSError:
    return False  # Gone, or another user's.


def _tagged(token: str, since: int) -> set[psutil.Process]:
  """Processes whose environment carries `token` (started at `since` ticks or later)."""
  found = set()
  for p in psutil.process_iter():
    ticks = start_ticks(p.pid)
    if ticks is not None and ticks >= since and started_with(p.pid, f"{ENV_VAR}={token}"):
      p._streamrl_ticks = ticks  # pylint: disable=protected-access
      found.add(p)
  return found


def _leftovers(known: set[psutil.Process], token: str, since: int) -> set[psutil.Process]:
  """`known` and their descendants now, and the processes tagged `token`:
  those that still run, but this one."""
  found = set()
  for p in known | _tagged(token, since):
    if _same(p):
      found.add(p)
      try:
        found.update(p.children(recursive=True))
      except psutil.Error:
        pass
  return {p for p in found if p.pid != os.getpid() and _same(p)}


def _is_resource_tracker(p: psutil.Process) -> bool:
  try:
    return any("multiprocessing.resource_tracker" in arg for arg in p.cmdline())
  except psutil.Error:
    return False


def _signal(procs: set[psutil.Process], sig: int, timeout_s: float) -> None:
  """Sends `sig` to `procs`, then waits at most `timeout_s` for them to end."""
  for p in procs:
    if not _same(p):  # never a pid that now names another process
      continue
    try:
      os.kill(p.pid, sig)
    except OSError:
      pass
  deadline = time.monotonic() + timeout_s
  while any(_same(p) for p in procs) and time.monotonic() < deadline:
    time.sleep(0.05)


def _kill_leftovers(known: set[psutil.Process], token: str, since: int) -> dict:
  """Ends `known`, their descendants and the processes tagged `token`:
  SIGTERM, then SIGKILL for those still there after GRACE_S. Returns the
  processes it signalled, with their names.

  multiprocessing's resource tracker goes last: it ignores SIGTERM, and once
  its users are gone it unlinks the shared memory and semaphores they left in
  /dev/shm (vLLM's message queues) and exits by itself.
  """
  names, trackers, sig = {}, set(), signal.SIGTERM
  for _ in range(5):  # A process may start another while we stop it.
    targets = _leftovers(known, token, since)
    trackers |= {p for p in targets if _is_resource_tracker(p)}
    targets -= trackers
    if not targets:
      break
    for p in targets:
      try:
        names.setdefault(p, p.name())
      except psutil.Error:
        pass
    _signal(targets, sig, GRACE_S)
    known, sig = known | targets, signal.SIGKILL
  trackers = {p for p in trackers if _same(p)}
  if trackers:
    _signal(trackers, 0, 3.0)  # Signal 0: only wait for them.
    trackers = {p for p in trackers if _same(p)}
    names.update((p, "resource_tracker") for p in trackers)
    _signal(trackers, signal.SIGKILL, GRACE_S)
  return names


# ------------------------------------------ shared-memory files of dead processes
#
# The transfer service's files in /dev/shm (streamrl/transfer/payload.py) are
# named after the process that made them. multiprocessing's resource tracker
# unlinks them when that process dies, unless the tracker dies with it (a
# whole process group killed: Ray, systemd and docker do that); then they
# would hold model-sized tmpfs memory until reboot. `sweep_shm` removes them:
# a Publisher or Receiver runs it at start and when it makes a file, and the
# watchdog once its owner died. Here, not in payload.py, because the watchdog
# imports nothing but psutil.

SHM_DIR = "/dev/shm"
# srl_<pid>_<start ticks>_<pid namespace>_<random>: the start time tells the
# creator from a later process with its pid, the namespace keeps a container
# that shares /dev/shm from taking another one's pids for its own.
_SHM_NAME = re.compile(r"srl_(\d+)_(\d+)_(\d+)_[0-9a-f]{12}")
_OLD_SHM_NAME = re.compile(r"srl_(\d+)_[0-9a-f]{12}")  # Made before the name said more.


def _pid_namespace() -> int:
  try:
    return os.stat("/proc/self/ns/pid").st_ino
  except OSError:
    return 0  # Unknown: then `sweep_shm` takes no file of ours for an orphan.


def shm_name() -> str:
  """A fresh name for a /dev/shm file of this process (see `sweep_shm`)."""
  pid = os.getpid()
  return f"srl_{pid}_{start_ticks(pid) or 0}_{_pid_namespace()}_{secrets.token_hex(6)}"


def is_shm_name(name: str) -> bool:
  """Whether `name` is one `shm_name` makes."""
  return _SHM_NAME.fullmatch(name) is not None


def _orphaned(name: str, namespace: int) -> bool:
  """Whether the process that made /dev/shm/`name` is gone (False when unsure)."""
  m = _SHM_NAME.fullmatch(name)
  if m is not None:
    pid, ticks, ns = (int(g) for g in m.groups())
    # A zero: the creator did not know who it was, so nobody can tell it is gone.
    return ns == namespace != 0 and ticks != 0 and start_ticks(pid) != ticks
  m = _OLD_SHM_NAME.fullmatch(name)
  # An old name has only the pid: its creator is gone only if nobody has that pid now.
  return m is not None and not os.path.exists(f"/proc/{m.group(1)}")


def sweep_shm() -> list[str]:
  """Removes the transfer service's /dev/shm files whose creating process is gone.

  Only regular files of this user (a symlink is never followed) that nobody
  pins (`streamrl.transfer.Pin`: a generator still to load one keeps it);
  processes that map one keep their mapping. Returns the names removed.
  """
  try:
    names = os.listdir(SHM_DIR)
  except OSError:
    return []
  namespace, removed = _pid_namespace(), []
  for name in names:
    if not name.startswith("srl_") or not _orphaned(name, namespace):
      continue
    path = os.path.join(SHM_DIR, name)
    try:
      fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
      continue  # Gone already, a symlink, or another user's.
    try:
      st = os.fstat(fd)
      if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        continue
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Raises while someone pins it.
      if os.path.samestat(st, os.lstat(path)):  # Still the file we checked.
        os.unlink(path)
        removed.append(name)
    except OSError:
      continue
    finally:
      os.close(fd)
  return removed


def _watch(pid: int, ticks: int, token: str, poll_s: float) -> int:
  """The watchdog's loop: see the module docstring."""
  known: set[psutil.Process] = set()
  stdin_open, quick_until, next_prune = True, 0.0, time.monotonic() + 30
  while True:
    if stdin_open:
      ready, _, _ = select.select([0], [], [], poll_s)
      if ready:
        if os.read(0, 64):
          return 0  # Stood down: a normal exit.
        # EOF: the owner closed its end, most likely by dying; it may take a
        # moment more to become a zombie.
        stdin_open, quick_until = False, time.monotonic() + 2.0
    else:
      time.sleep(0.02 if time.monotonic() < quick_until else poll_s)
    owner = _owner(pid, ticks)
    if owner is None:
      stopped = _kill_leftovers(known, token, ticks)
      if stopped:
        names = ", ".join(sorted(set(stopped.values())))
        try:
          print(
              f"streamrl.lifecycle: process {pid} died without a normal exit; stopped the "
              f"{len(stopped)} processes it had started ({names}).",
              file=sys.stderr,
              flush=True,
          )
        except OSError:
          pass  # Nobody reads our stderr any more.
      try:
        sweep_shm()  # The dead ones' files, if their resource tracker died with them.
      except Exception:  # pylint: disable=broad-except
        pass  # A watchdog that is done must exit all the same.
      return 0
    try:
      for child in owner.children(recursive=True):
        if _same(child):  # records when it started, to tell it from a later reuse of its pid
          known.add(child)
    except psutil.Error:
      pass
    if time.monotonic() > next_prune:
      known = {p for p in known if _same(p)}
      next_prune = time.monotonic() + 30


if __name__ == "__main__":
  sys.exit(_watch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
