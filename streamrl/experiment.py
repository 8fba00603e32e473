"""Where the run goes: this process, or a trainer actor on the training pool.

  experiment.run(config, workdir)   # what launch/main.py calls

`run` maps the config onto typed settings (every check happens there, before
anything starts), refuses an incompatible workdir, and then runs
`streamrl.train.run` either here (colocated, or `cluster.trainer_actor=False`
for debugging with pdb) or, for the disaggregated modes (`sync`, `stream`,
`async`), on one `TrainerActor`: it is placed by the `training_pool`
resource label (a training node on a real cluster; the local node
otherwise), pins itself to the trainer's cores before JAX starts (so XLA
sizes its thread pool to the trainer's share), and runs the loop, which
starts the generator actors on the `generation_pool` and streams their
samples straight into this actor. The launching process only waits, and
copies the actor's log (`<workdir>/trainer.log`) to its own output as it
grows.

The launcher imports this module and never loads JAX (nor the trainer's other
libraries): what runs in the trainer's process (`streamrl.train`, the
multi-process protocol, the checkpoints) is imported where it runs.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import sys

import ray

from streamrl import allocator
from streamrl import cluster as cluster_lib
from streamrl import errors
from streamrl import lifecycle
from streamrl import metrics
from streamrl import oom
from streamrl.config import settings as settings_lib
from streamrl.trainer import runtime

log = logging.getLogger(__name__)

LOG_NAME = "trainer.log"


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the experiment of `config` (a ConfigDict or Settings)."""
  s = config if isinstance(config, settings_lib.Settings) else settings_lib.from_config(config)
  # Before Ray or an engine starts: if this process dies, even by kill -9, so
  # does every process the run started (a local Ray's daemons included).
  lifecycle.guard_children()
  disaggregated = s.pipeline.mode != "colocated"
  if disaggregated and s.cluster.trainer_actor:
    # Refuse an incompatible workdir here too, before Ray or an actor starts.
    refuse_incompatible_checkpoints(s, workdir)
    return run_on_actor(s, workdir)
  if not disaggregated:
    share_gpu_memory(s.engine, os.environ)
  if disaggregated and not s.cluster.address:
    # Local Ray: keep this process's threads off the generators' cores.
    shares = cluster_lib.plan_cpu_shares(s.cluster.generator_cpus, s.cluster.trainer_cpus)
    cluster_lib.bound_trainer_threads(shares.trainer_cores)
  allocator.cap_arenas()  # before the trainer's weights and buffers
  # The trainer runs in this process: only now is JAX loaded (module docstring).
  from streamrl import train  # pylint: disable=g-import-not-at-top

  return train.run(s, workdir)


def refuse_incompatible_checkpoints(s: settings_lib.Settings, workdir: str) -> None:
  """UserError if `workdir` holds checkpoints another config wrote; nothing is
  written. Reading them loads Orbax and JAX into this process, so a workdir
  without checkpoints (nothing to refuse) is left unread."""
  directory = os.path.join(workdir, "checkpoints")
  empty = not os.path.exists(directory) or os.path.isdir(directory) and not os.listdir(directory)
  if empty and "://" not in directory:
    return
  from streamrl.trainer import setup  # pylint: disable=g-import-not-at-top

  setup.open_checkpoints(s, workdir).close()


def share_gpu_memory(engine: settings_lib.Engine, env) -> None:
  """Colocated on a GPU, JAX and the vLLM engine share each device: JAX
  would otherwise preallocate 75 % of it before vLLM takes its
  `gpu_memory_utilization`. JAX gets what vLLM leaves, less a margin for
  CUDA contexts, unless XLA_PYTHON_CLIENT_MEM_FRACTION is already set."""
  if engine.gpus_per_instance and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env:
    fraction = max(0.05, 1.0 - engine.gpu_memory_utilization - 0.05)
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.2f}"
    log.info(
        "Colocated on GPU: JAX may use %.0f %% of each GPU, vLLM %.0f %%.",
        100 * fraction,
        100 * engine.gpu_memory_utilization,
    )


def log_name(process_index: int, num_processes: int) -> str:
  """Trainer process k's log in the workdir: trainer.log, or trainer.<k>.log
  when the trainer spans several processes."""
  return LOG_NAME if num_processes == 1 else f"trainer.{process_index}.log"


TRAINER_GPU_MEMORY_FRACTION = "0.90"


class TrainerActor:
  """One trainer process, on the trainer's cores (or GPUs).

  Process 0 runs the experiment (`run`); with `cluster.trainer_processes` > 1
  the others `follow` it, on one JAX runtime (streamrl/trainer/multihost.py).
  Its methods import the trainer's modules when they run, in the actor.
  """

  def __init__(
      self,
      cores: tuple[int, ...] | None,
      num_threads: int | None,
      process_index: int = 0,
      num_processes: int = 1,
      cpu_devices: int | None = None,
  ):
    # If this actor dies (its driver died, or ray.kill), so do the engine
    # processes it started.
    lifecycle.guard_children()
    allocator.cap_arenas()  # before the trainer's weights and buffers
    if cores:
      # Before JAX exists in this process: XLA sizes its pool from the mask.
      cluster_lib.bound_trainer_threads(cores)
    elif num_threads:
      for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(num_threads)
    if cpu_devices and not os.environ.get("CUDA_VISIBLE_DEVICES"):
      runtime.set_cpu_devices(cpu_devices)
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
      # The trainer's GPUs are its own (disaggregated): JAX may take 90 % of each
      # instead of its default 75 %, as the memory plan assumes.
      os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", TRAINER_GPU_MEMORY_FRACTION)
    self._cores = tuple(sorted(os.sched_getaffinity(0)))
    self.process_index, self.num_processes = process_index, num_processes

  def open_log(self, workdir: str) -> str:
    """Sends this process's output to its log in `workdir`; returns the path."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, log_name(self.process_index, self.num_processes))
    _redirect_output(path)
    metrics.configure_actor_logging(workdir)
    return path

  def process(self) -> tuple[int, str]:
    """(pid, host) of this process: the launcher watches its memory."""
    return os.getpid(), socket.gethostname()

  def coordinator_address(self) -> str:
    """Where process 0 will serve JAX's coordination service: on its Ray
    node's address (127.0.0.1 on a local Ray), the only one it listens on."""
    return runtime.coordinator_address(cluster_lib.node_address())

  def init_distributed(self, coordinator: str, timeout_s: int) -> dict:
    """Joins the trainer's JAX runtime; returns this process's placement.
    Its gloo collectives listen on its Ray node's address."""
    runtime.initialize(
        coordinator,
        self.num_processes,
        self.process_index,
        timeout_s=int(timeout_s),
        host=cluster_lib.node_address(),
    )
    return self.where()

  def where(self) -> dict:
    import jax  # pylint: disable=g-import-not-at-top

    return {
        **cluster_lib.where_am_i(),
        "process_index": self.process_index,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cores": list(self._cores),
        "gpu_ids": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "devices": [str(d) for d in jax.local_devices()],
    }

  def run(
      self,
      s: settings_lib.Settings,
      workdir: str,
      info: cluster_lib.ClusterInfo,
      processes: list[dict] | None = None,
      queues: list[tuple] | None = None,
  ) -> dict:
    """Runs the experiment as process 0 of `processes` (each one's placement),
    leading the others through `queues` (each follower's commands and replies)."""
    self.open_log(workdir)  # First: what importing the trainer logs goes there too.
    from streamrl import train  # pylint: disable=g-import-not-at-top
    from streamrl.trainer import protocol  # pylint: disable=g-import-not-at-top

    processes = processes or [self.where()]
    placement = {"trainer": processes[0]}
    followers = None
    if len(processes) > 1:
      placement["trainer_processes"] = processes
      followers = protocol.Followers(
          commands=[q[0] for q in queues],
          replies=[q[1] for q in queues],
          hosts=[p["host"] for p in processes[1:]],
      )
    return train.run(s, workdir, cluster=info, placement=placement, followers=followers)

  def follow(self, s: settings_lib.Settings, workdir: str, commands, reply) -> None:
    self.open_log(workdir)
    from streamrl.trainer import follower  # pylint: disable=g-import-not-at-top

    follower.follow(s, workdir, commands, reply)


def _redirect_output(path: str) -> None:
  """Sends this process's stdout and stderr (Python's and C's) to `path`."""
  metrics.point_output_at(path)
  sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
  sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def trainer_actor_options(c: settings_lib.Cluster) -> dict:
  """The Ray resources of one `TrainerActor`: its CPUs, its share of
  `cluster.trainer_gpus` (Ray sets its CUDA_VISIBLE_DEVICES to GPUs of its
  own, disjoint from the generators' and the other trainer processes'), one
  slot of `cluster.training_pool`, on a node with `cluster.training_labels`."""
  options = dict(
      num_cpus=c.trainer_cpus,
      num_gpus=c.trainer_gpus // c.trainer_processes,
      resources={c.training_pool: 1},
      # Never restarted: a second copy would resume from the checkpoint
      # while the first one's generator actors may still be alive.
      max_restarts=0,
      name=None,
  )
  labels = cluster_lib.parse_labels(c.training_labels)
  if labels:
    options["label_selector"] = labels
  return options


def run_on_actor(s: settings_lib.Settings, workdir: str) -> dict:
  """Runs the experiment on TrainerActors (`cluster.trainer_processes` of
  them); returns the final metrics.

  Errors raised in process 0 are raised here with their own type and
  message. If any trainer process dies, or fails, the others are stopped
  (they may wait in a collective for it) and the error names the process
  and its log; rerunning with the same --workdir resumes.
  """
  info = cluster_lib.init_ray_for(s.cluster, s.gpus_needed, s.cluster.trainer_processes)
  n = s.cluster.trainer_processes
  cores = info.shares.trainer_cores if info.shares is not None else None
  actor_cls = ray.remote(TrainerActor)
  options = trainer_actor_options(s.cluster)
  cpu_devices = s.trainer_cpu_devices_per_process
  actors = [
      actor_cls.options(**options).remote(cores, s.cluster.trainer_cpus, k, n, cpu_devices)
      for k in range(n)
  ]
  os.makedirs(workdir, exist_ok=True)
  logs = [os.path.join(workdir, log_name(k, n)) for k in range(n)]
  follower = _LogFollower(logs[0])
  # Each trainer process's memory, sampled: a kill for memory is then one sentence.
  memory = oom.Watch(logs[0])
  for k, (pid, host) in enumerate(ray.get([a.process.remote() for a in actors])):
    memory.add(_trainer_name(k, n), pid, host)
  refs: dict = {}
  queues: list = []
  try:
    processes = None
    if n > 1:
      processes, queues = _start_processes(actors, s.cluster, workdir, logs)
      refs.update(
          {
              actors[k].follow.remote(s, workdir, queues[k - 1][0], queues[k - 1][1]): k
              for k in range(1, n)
          }
      )
    run_ref = actors[0].run.remote(s, workdir, info, processes, queues)
    refs[run_ref] = 0
    while True:
      ready, _ = ray.wait(list(refs), timeout=0.5)
      follower.copy_new(sys.stderr)
      if not ready:
        continue
      k = refs.pop(ready[0])
      if n > 1 and _died(ready[0]):
        # When one process dies the others may follow within seconds (JAX's
        # coordination service ends them): name the one that died first.
        others = ray.wait(list(refs), num_returns=len(refs), timeout=3)[0]
        dead = {k: ready[0], **{refs[r]: r for r in others if _died(r)}}
        k = _first_to_die(sorted(dead), logs)
        _get(dead[k], k, n, logs[k], memory)
      try:
        value = _get(ready[0], k, n, logs[k], memory)
      except ray.exceptions.RayTaskError:
        if k == 0 and refs:
          # Process 0 may raise first because a peer died under its collective
          # (gloo's connection reset): then name the process that died.
          for r in ray.wait(list(refs), num_returns=len(refs), timeout=10)[0]:
            if _died(r):
              _get(r, refs[r], n, logs[refs[r]], memory)
        raise
      if k == 0:
        ray.wait(list(refs), num_returns=len(refs), timeout=60)  # followers stop on their own
        return value
      # A follower returns once process 0 has told it to stop (at its end).
  finally:
    memory.close()
    follower.copy_new(sys.stderr)
    for a in actors:
      ray.kill(a, no_restart=True)
    for q in queues:
      for one in q:
        one.shutdown(force=True)


# What a JAX process logs when it ends itself because another one died.
_ENDED_BY_PEER = "JAX distributed service detected fatal errors"


def _first_to_die(dead: list[int], logs: list[str]) -> int:
  """Of trainer processes that died together, the one that did not end
  itself because a peer died (the first of them if that can't be told)."""
  for k in dead:
    try:
      with open(logs[k], "rb") as f:
        f.seek(max(0, os.path.getsize(logs[k]) - (1 << 20)))
        tail = f.read().decode(errors="replace")
    except OSError:
      continue
    if _ENDED_BY_PEER not in tail:
      return k
  return dead[0]


def _died(ref) -> bool:
  """Whether a finished call's process died (rather than returned or raised)."""
  try:
    ray.get(ref)
  except ray.exceptions.RayActorError:
    return True
  except Exception:  # pylint: disable=broad-except
    pass
  return False


def _trainer_name(k: int, n: int) -> str:
  return "trainer actor" if n == 1 else f"trainer process {k}"


def _get(ref, k: int, n: int, log_path: str, memory: oom.Watch | None = None):
  """ray.get of trainer process k's call; its failure as one clear error."""
  try:
    return ray.get(ref)
  except ray.exceptions.RayTaskError as e:
    if isinstance(getattr(e, "cause", None), errors.RunStopped):
      # A process of the run died (a generator killed for memory...): its one
      # sentence, not Ray's remote traceback around it.
      raise errors.RunStopped(str(e.cause)) from None
    if n == 1 or k == 0:
      raise e.as_instanceof_cause() from None
    raise errors.RunStopped(
        f"Trainer process {k} failed ({_last_line(e)}); its output is in {log_path}, and "
        "rerunning with the same --workdir resumes from the last checkpoint."
    ) from None
  except ray.exceptions.RayActorError as e:
    killed = memory.explain(_trainer_name(k, n), str(e)) if memory is not None else None
    if killed is not None:
      raise killed from None
    what = "The trainer actor" if n == 1 else f"Trainer process {k}"
    raise errors.RunStopped(
        f"{what} died ({_death_reason(e)}); its output is in {log_path}, and rerunning with "
        "the same --workdir resumes from the last checkpoint."
    ) from None


def _start_processes(actors, c: settings_lib.Cluster, workdir: str, logs: list[str]):
  """Joins the trainer actors into one JAX runtime; returns (placement of
  each process, each follower's (commands, replies) queues)."""
  from ray.util.queue import Queue  # pylint: disable=g-import-not-at-top

  n = len(actors)
  ray.get([a.open_log.remote(workdir) for a in actors])
  coordinator = ray.get(actors[0].coordinator_address.remote())
  timeout = int(max(c.connect_timeout_s * 4, 60))
  pending = {a.init_distributed.remote(coordinator, timeout): k for k, a in enumerate(actors)}
  processes = [None] * n
  while pending:
    # A process that fails to join ends the wait at once (its error is raised).
    ready, _ = ray.wait(list(pending), timeout=1.0)
    for r in ready:
      k = pending.pop(r)
      processes[k] = _get(r, k, n, logs[k])
  queues = [
      (Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0}))
      for _ in actors[1:]
  ]
  return processes, queues


class _LogFollower:
  """Copies what was appended to a file since the last call."""

  def __init__(self, path: str):
    self.path = path
    self.pos = os.path.getsize(path) if os.path.exists(path) else 0

  def copy_new(self, out) -> None:
    try:
      with open(self.path, "r", errors="replace") as f:
        f.seek(self.pos)
        text = f.read()
        self.pos = f.tell()
    except FileNotFoundError:
      return
    if text:
      out.write(text)
      out.flush()


def _death_reason(e: Exception) -> str:
  """Ray's account of an actor's death, short: its exit type and detail."""
  text = " ".join(str(getattr(e, "error_msg", None) or e).split())
  kind = re.search(r"Worker exit type: (\w+)", text)
  detail = re.search(r"Worker exit detail: (.*?\.)", text)
  if kind:
    return f"{kind.group(1)}: {detail.group(1)}" if detail else kind.group(1)
  return _last_line(e)


def _last_line(e: Exception) -> str:
  msg = str(getattr(e, "error_msg", None) or e).strip().splitlines()
  return msg[-1] if msg else e.__class__.__name__


def record_plan(path: str, workdir: str, config) -> settings_lib.Settings:
  """Validates `config` (a plan file applied: streamrl/planner/emit.py), refuses
  a workdir whose checkpoints another config wrote (nothing is written then),
  copies the plan file to <workdir>/plan.json and returns the run's Settings."""
  s = settings_lib.from_config(config)
  refuse_incompatible_checkpoints(s, workdir)
  dst = os.path.join(workdir, "plan.json")
  if not (os.path.exists(dst) and os.path.samefile(path, dst)):
    shutil.copyfile(path, dst)
  return s
