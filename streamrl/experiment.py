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
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import ray

from streamrl import cluster as cluster_lib
from streamrl import lifecycle
from streamrl import metrics
from streamrl import settings as settings_lib
from streamrl import train

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
    train.open_checkpoints(s, workdir).close()
    return run_on_actor(s, workdir)
  if not disaggregated:
    share_gpu_memory(s.engine, os.environ)
  if disaggregated and not s.cluster.address:
    # Local Ray: keep this process's threads off the generators' cores.
    shares = cluster_lib.plan_cpu_shares(s.cluster.generator_cpus, s.cluster.trainer_cpus)
    cluster_lib.bound_trainer_threads(shares.trainer_cores)
  return train.run(s, workdir)


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


class TrainerActor:
  """Runs one experiment in its own process, on the trainer's cores."""

  def __init__(self, cores: tuple[int, ...] | None, num_threads: int | None):
    # If this actor dies (its driver died, or ray.kill), so do the engine
    # processes it started.
    lifecycle.guard_children()
    if cores:
      # Before JAX exists in this process: XLA sizes its pool from the mask.
      cluster_lib.bound_trainer_threads(cores)
    elif num_threads:
      for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(num_threads)
    self._cores = tuple(sorted(os.sched_getaffinity(0)))

  def run(self, s: settings_lib.Settings, workdir: str, info: cluster_lib.ClusterInfo) -> dict:
    os.makedirs(workdir, exist_ok=True)
    _redirect_output(os.path.join(workdir, LOG_NAME))
    metrics.configure_actor_logging(workdir)
    placement = {
        "trainer": {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cores": list(self._cores),
            "node_id": ray.get_runtime_context().get_node_id(),
            "gpu_ids": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }
    }
    return train.run(s, workdir, cluster=info, placement=placement)


def _redirect_output(path: str) -> None:
  """Sends this process's stdout and stderr (Python's and C's) to `path`."""
  metrics.point_output_at(path)
  sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
  sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def trainer_actor_options(c: settings_lib.Cluster) -> dict:
  """The Ray resources of the `TrainerActor`: its CPUs, `cluster.trainer_gpus`
  GPUs (Ray sets its CUDA_VISIBLE_DEVICES to GPUs of its own, disjoint from
  the generators') and the `training_pool` label."""
  return dict(
      num_cpus=c.trainer_cpus,
      num_gpus=c.trainer_gpus,
      resources={cluster_lib.TRAINING_POOL: 1},
      # Never restarted: a second copy would resume from the checkpoint
      # while the first one's generator actors may still be alive.
      max_restarts=0,
      name=None,
  )


def run_on_actor(s: settings_lib.Settings, workdir: str) -> dict:
  """Runs the experiment on a TrainerActor; returns its final metrics.

  Errors raised in the actor are raised here with their own type and
  message; if the actor's process dies, the error says so and names its log.
  """
  info = cluster_lib.init_ray_for(s.cluster, s.gpus_needed)
  cores = info.shares.trainer_cores if info.shares is not None else None
  cpus = s.cluster.trainer_cpus
  actor_cls = ray.remote(TrainerActor)
  actor = actor_cls.options(**trainer_actor_options(s.cluster)).remote(cores, cpus)
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, LOG_NAME)
  ref = actor.run.remote(s, workdir, info)
  follower = _LogFollower(log_path)
  try:
    while True:
      ready, _ = ray.wait([ref], timeout=0.5)
      follower.copy_new(sys.stderr)
      if ready:
        break
    return ray.get(ref)
  except ray.exceptions.RayTaskError as e:
    raise e.as_instanceof_cause() from None
  except ray.exceptions.RayActorError as e:
    raise RuntimeError(
        f"The trainer actor died ({_last_line(e)}); its output is in "
        f"{log_path}, and rerunning with the same --workdir resumes from "
        "the last checkpoint."
    ) from None
  finally:
    follower.copy_new(sys.stderr)
    ray.kill(actor, no_restart=True)


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


def _last_line(e: Exception) -> str:
  msg = str(getattr(e, "error_msg", None) or e).strip().splitlines()
  return msg[-1] if msg else e.__class__.__name__
