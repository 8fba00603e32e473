"""The elastic run's set-up (experiments/bench/bench_elastic.py): its options,
the config overrides, a local Ray cluster whose nodes are pinned to cores,
the run through launch/main.py as a user starts it, and a monitor of the CPU
other jobs on the machine use meanwhile.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time

from experiments import harness
from streamrl.cluster import local as local_cluster

ROOT = harness.ROOT
CONFIG = os.path.join(ROOT, "configs", "ppo.py")
GEN_CPUS = 1  # the generation node's CPUs
TRAIN_CPUS = 1  # the training node's CPUs


@dataclasses.dataclass(frozen=True)
class Options:
  """What bench_elastic.py's flags set (the same names); see its docstring."""

  workdir: str = "/tmp/streamrl_bench_elastic"
  out: str = os.path.join(ROOT, "experiments", "out", "bench_elastic")
  iterations: int = 9
  prompts: int = 64
  mini_batch: int = 64
  max_num_seqs: int = 1
  max_tokens: int = 56
  warmstart_steps: int = 0
  observe: int = 3
  cooldown: int = 4
  min_gain: float = 0.5
  slots: int = 2
  warmup: int = 1
  pin_nodes: bool = True
  measure_reps: int = 5
  timeout_s: int = 1500
  overrides: dict = dataclasses.field(default_factory=dict)
  alone_reps: int = 3
  trainer_processes: int = 1
  trainer_alone_iterations: int = 5
  costs_from: str = ""

  @property
  def elastic(self) -> bool:
    """Whether the run is the elastic one (one trainer process): the multi-process
    trainer's run keeps one generator instance throughout."""
    return self.trainer_processes == 1


def now() -> float:
  return time.perf_counter()


def log(msg: str) -> None:
  print(msg, flush=True)


# ------------------------------------------------------------------ cluster
class PinnedCluster(local_cluster.LocalCluster):
  """A LocalCluster whose worker nodes each run on given cores: `ray start`
  runs under `taskset`, and its raylet and every worker it spawns inherit
  the mask."""

  def __init__(self, nodes, *, cores: dict[str, tuple[int, ...]], **kwargs):
    super().__init__(nodes, **kwargs)
    self.cores = cores

  def _command(self, node, head):
    cmd = super()._command(node, head)
    return harness.taskset(cmd, self.cores.get(node.name))


def node_cores(pin: bool) -> dict[str, tuple[int, ...]]:
  """{node name: cores}: generation node first cores, training node the next."""
  if not pin:
    return {}
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < (os.cpu_count() or 1):
    log(
        f"warning: this process may run on cores {cores} of the machine's {os.cpu_count()} "
        "(a parent pinned it); the nodes are pinned within those."
    )
  if len(cores) < GEN_CPUS + TRAIN_CPUS or shutil.which("taskset") is None:
    log(
        f"warning: cannot pin the nodes ({len(cores)} cores, taskset "
        f"{'found' if shutil.which('taskset') else 'missing'}); they share every core."
    )
    return {}
  return {
      "generator": tuple(cores[:GEN_CPUS]),
      "trainer": tuple(cores[GEN_CPUS : GEN_CPUS + TRAIN_CPUS]),
  }


# ------------------------------------------------------------- other jobs
class CpuMonitor(threading.Thread):
  """Samples once a second the machine's busy CPU seconds (/proc/stat) and
  the CPU seconds of this process's descendants (the cluster, the run, the
  measurements); the difference is what other jobs on the machine used."""

  def __init__(self, period_s: float = 1.0):
    super().__init__(daemon=True)
    self.period_s = period_s
    self.samples: list[tuple[float, float, float]] = []  # (unix time, busy s, ours s)
    self._ours: dict[int, float] = {}  # pid -> its last CPU seconds
    self._stop_event = threading.Event()
    self._tick = os.sysconf("SC_CLK_TCK")

  def _busy(self) -> float:
    with open("/proc/stat") as f:
      v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(v[:8]) - v[3] - v[4]) / self._tick

  def _descendants(self) -> None:
    procs = {}
    for name in os.listdir("/proc"):
      if not name.isdigit():
        continue
      try:
        with open(f"/proc/{name}/stat") as f:
          rest = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      procs[int(name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / self._tick)
    mine = {os.getpid()}
    children = collections.defaultdict(list)
    for pid, (ppid, _) in procs.items():
      children[ppid].append(pid)
    todo = [os.getpid()]
    while todo:
      for c in children.get(todo.pop(), []):
        if c not in mine:
          mine.add(c)
          todo.append(c)
    for pid in mine:
      self._ours[pid] = procs[pid][1] if pid in procs else self._ours.get(pid, 0.0)

  def sample(self) -> None:
    self._descendants()
    self.samples.append((time.time(), self._busy(), sum(self._ours.values())))

  def run(self) -> None:
    while not self._stop_event.is_set():
      self.sample()
      self._stop_event.wait(self.period_s)

  def stop(self) -> None:
    self._stop_event.set()
    self.join()
    self.sample()

  def others(self, t0: float, t1: float) -> float | None:
    """Cores other jobs kept busy on average between unix times t0 and t1."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    if len(self.samples) < 2 or t1 - t0 < 2 * self.period_s:
      return None
    if t0 < self.samples[0][0] - self.period_s or t1 > self.samples[-1][0] + self.period_s:
      return None
    t, busy, ours = (np.asarray(x) for x in zip(*self.samples))
    b = np.interp([t0, t1], t, busy)
    o = np.interp([t0, t1], t, ours)
    return max(0.0, float((b[1] - b[0]) - (o[1] - o[0])) / (t1 - t0))


# ---------------------------------------------------------------- overrides
def workload_overrides(o: Options) -> dict:
  """The config overrides of the run (and of the measurement, minus the cluster)."""
  out = {
      "pipeline.mode": "sync",
      "warmstart.steps": o.warmstart_steps,
      "trainer.num_iterations": o.iterations,
      "trainer.prompts_per_iteration": o.prompts,
      "trainer.mini_batch_size": o.mini_batch,
      "trainer.micro_batch_size": o.mini_batch,
      "trainer.ppo_epochs": 1,
      "engine.max_num_seqs": o.max_num_seqs,
      "sampling.max_tokens": o.max_tokens,
      "engine.num_instances": 1,
      "transfer.enabled": True,
      "elastic.enabled": o.trainer_processes == 1,
      "elastic.min_instances": 1,
      "elastic.max_instances": o.slots,
      "elastic.observe_iterations": o.observe,
      "elastic.cooldown_iterations": o.cooldown,
      "elastic.min_gain": o.min_gain,
      "task.num_eval": 8,
      "log.eval_every": 0,
      "log.progress": False,
  }
  if o.trainer_processes > 1:
    out["cluster.trainer_processes"] = o.trainer_processes
  return {**out, **o.overrides}


def as_flags(overrides: dict) -> list[str]:
  return [
      f"--config.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in overrides.items()
  ]


def typed_settings(overrides: dict):
  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top

  config = config_lib.load_config(CONFIG)
  return settings.from_config(config_lib.apply_overrides(config, overrides))


# ---------------------------------------------------------------- the run
def run_elastic(c, run_dir: str, overrides: dict, log_path: str, timeout_s: float) -> int:
  """launch/main.py against the cluster; its output goes to `log_path`."""
  args = [sys.executable, os.path.join(ROOT, "launch", "main.py")]
  args += [f"--config={CONFIG}", f"--workdir={run_dir}"]
  args += as_flags({**overrides, "cluster.address": c.address})
  with open(log_path, "w") as out:
    try:
      res = subprocess.run(
          args,
          env={**os.environ, **c.env()},
          stdout=out,
          stderr=subprocess.STDOUT,
          timeout=timeout_s,
          cwd=ROOT,
      )
    except subprocess.TimeoutExpired:
      log(f"the run took longer than --timeout_s={timeout_s}; stopped it.")
      return 124
  return res.returncode


def read_jsonl(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
