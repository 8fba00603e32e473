"""A process of the run killed for memory, said in one sentence.

Two things kill a process for memory on a host: Ray's memory monitor (once the
node's memory use passes `RAY_memory_usage_threshold` it kills a worker, and
the actor's death error says so), and the kernel's out-of-memory killer (a
SIGKILL: Ray only sees the worker vanish, so the kernel's own count of such
kills, `oom_kill` in /proc/vmstat, is read when the watch starts and when a
process dies). `Watch` samples the resident memory of the run's processes on
this host, so that the sentence can say how much the dead one held;
`Watch.explain` turns a death into that sentence (a `RunStopped`), or None
when nothing points at memory.

A local Ray is started with `ray_env()` in its environment: its monitor's
threshold is raised to `RAY_THRESHOLD` (unless the user set one), so that the
memory plan (streamrl/trainer/memory_plan.py), checked before the run starts,
decides what fits, and Ray's monitor only acts at the edge of the machine's
memory, before the kernel would.
"""

from __future__ import annotations

import os
import re
import socket
import threading

from streamrl.errors import RunStopped

THRESHOLD_VAR = "RAY_memory_usage_threshold"
RAY_THRESHOLD = "0.98"
_GB = 1e9

# What to change, in the order the plan's advice tries them (memory_plan.advice).
ADVICE = (
    "set trainer.remat=full, a smaller trainer.micro_batch_size, LoRA (trainer.lora_rank=16) "
    "or a smaller engine.kv_cache_gib"
)

# Ray's memory monitor: its report on the killed worker ("... pid=N, actual memory
# used=X.XXGB ...", "Memory on the node ... was X GB used / Y GB limit").
_RAY_KILL = re.compile(r"low on memory|OUT_OF_MEMORY|OutOfMemoryError|memory usage threshold")
_RAY_USED = re.compile(r"actual memory used=([0-9.]+)\s*GB")
_RAY_NODE = re.compile(r"was ([0-9.]+)\s*GB used / ([0-9.]+)\s*GB limit")


def ray_env(env: dict | None = None) -> dict:
  """`env` (default os.environ, changed in place) with Ray's monitor threshold
  raised to RAY_THRESHOLD unless it is set."""
  env = os.environ if env is None else env
  env.setdefault(THRESHOLD_VAR, RAY_THRESHOLD)
  return env


def kernel_kills() -> int | None:
  """The kernel's count of out-of-memory kills since boot (None where unreadable)."""
  try:
    with open("/proc/vmstat") as f:
      for line in f:
        if line.startswith("oom_kill "):
          return int(line.split()[1])
  except (OSError, ValueError):
    pass
  return None


class Watch:
  """Samples, every `every_s` seconds, the resident memory of named processes
  of this host; `explain` says whether one that died was killed for memory.

  `log_hint` is where the run's memory plan was logged (named in the sentence).
  """

  def __init__(self, log_hint: str = "", every_s: float = 1.0):
    self.log_hint, self.every_s = log_hint, every_s
    self.kills_at_start = kernel_kills()
    self._pids: dict[str, int] = {}
    self._rss: dict[str, int] = {}
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def add(self, name: str, pid: int | None, host: str | None = None) -> None:
    """Watches process `pid` as `name` (one on another host is not watched)."""
    if not pid or (host and host != socket.gethostname()):
      return
    with self._lock:
      self._pids[name] = int(pid)
    self._sample_one(name, int(pid))
    if self._thread is None:
      self._thread = threading.Thread(target=self._loop, name="oom-watch", daemon=True)
      self._thread.start()

  def close(self) -> None:
    self._stop.set()

  def last_rss(self, name: str) -> int | None:
    with self._lock:
      return self._rss.get(name)

  def _sample_one(self, name: str, pid: int) -> None:
    import psutil  # pylint: disable=g-import-not-at-top

    try:
      rss = psutil.Process(pid).memory_info().rss
    except psutil.Error:
      return
    if not rss:  # A process on its way out (a zombie) holds nothing: keep what it held.
      return
    with self._lock:
      self._rss[name] = rss

  def _loop(self) -> None:
    while not self._stop.wait(self.every_s):
      with self._lock:
        pids = dict(self._pids)
      for name, pid in pids.items():
        self._sample_one(name, pid)

  def explain(self, name: str, error_text: str, *, resumes: bool = True) -> RunStopped | None:
    """One sentence (as a RunStopped) when the death of `name`, whose Ray error
    reads `error_text`, was a memory kill; None otherwise."""
    text = " ".join(str(error_text).split())
    used = None
    if _RAY_KILL.search(text):
      how = "Ray's memory monitor"
      found = _RAY_USED.search(text)
      used = float(found.group(1)) * _GB if found else None
      node = _RAY_NODE.search(text)
      if node:
        how += f" (the machine was at {node.group(1)} of {node.group(2)} GB)"
    else:
      now = kernel_kills()
      if now is None or self.kills_at_start is None or now <= self.kills_at_start:
        return None
      how = "the kernel's out-of-memory killer"
    if used is None:
      used = self.last_rss(name)
    held = f" holding {used / _GB:.1f} GB" if used else ""
    where = f" against the memory plan in {self.log_hint}" if self.log_hint else ""
    resume = " and rerun the same command to resume from the last checkpoint" if resumes else ""
    return RunStopped(f"The {name} was killed for memory by {how}{held}; {ADVICE}{where}{resume}.")
