"""The trainer as a Ray actor on the training pool.

For the disaggregated modes (`sync`, `stream`, `async`) `train.run` hands the
whole run to one `TrainerActor`: it is placed by the `training_pool` resource
label (a training node on a real cluster; the local node otherwise), pins
itself to the trainer's cores before JAX starts (so XLA sizes its thread
pool to the trainer's share), and runs `train.run_here`, which starts the
generator actors on the `generation_pool` and streams their samples straight
into this actor. The launching process only waits, and copies the actor's
log (`<workdir>/trainer.log`) to its own output as it grows.

`cluster.trainer_actor=False` keeps the trainer in the launching process
(easier to debug with pdb); `colocated` never uses an actor: generation and
training take turns on the same cores there.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import ray

from streamrl import cluster as cluster_lib

log = logging.getLogger(__name__)

LOG_NAME = "trainer.log"


class TrainerActor:
  """Runs one experiment in its own process, on the trainer's cores."""

  def __init__(self, cores: tuple[int, ...] | None, num_threads: int | None):
    if cores:
      # Before JAX exists in this process: XLA sizes its pool from the mask.
      cluster_lib.bound_trainer_threads(cores)
    elif num_threads:
      for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(num_threads)
    self._cores = tuple(sorted(os.sched_getaffinity(0)))

  def run(self, config, workdir: str, info: cluster_lib.ClusterInfo) -> dict:
    os.makedirs(workdir, exist_ok=True)
    _redirect_output(os.path.join(workdir, LOG_NAME))
    from streamrl import metrics, train  # pylint: disable=g-import-not-at-top
    metrics.configure_logging()
    placement = {"trainer": {"pid": os.getpid(), "host": socket.gethostname(),
                             "cores": list(self._cores),
                             "node_id": ray.get_runtime_context().get_node_id()}}
    return train.run_here(config, workdir, cluster=info, placement=placement)


def _redirect_output(path: str) -> None:
  """Sends this process's stdout and stderr (Python's and C's) to `path`."""
  sys.stdout.flush()
  sys.stderr.flush()
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)
  sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
  sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def run(config, workdir: str) -> dict:
  """Runs the experiment on a TrainerActor; returns its final metrics.

  Errors raised in the actor are raised here with their own type and
  message; if the actor's process dies, the error says so and names its log.
  """
  info = cluster_lib.init_ray_from_config(config)
  c = config.cluster
  cores = info.shares.trainer_cores if info.shares is not None else None
  cpus = int(c.get("trainer_cpus", 1))
  actor_cls = ray.remote(TrainerActor)
  actor = actor_cls.options(
      num_cpus=cpus, num_gpus=float(c.get("trainer_gpus", 0) or 0),
      resources={cluster_lib.TRAINING_POOL: 1},
      # Never restarted: a second copy would resume from the checkpoint
      # while the first one's generator actors may still be alive.
      max_restarts=0, name=None).remote(cores, cpus)
  os.makedirs(workdir, exist_ok=True)
  log_path = os.path.join(workdir, LOG_NAME)
  ref = actor.run.remote(config, workdir, info)
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
    raise RuntimeError(f"The trainer actor died ({_last_line(e)}); its output is in "
                       f"{log_path}, and rerunning with the same --workdir resumes from "
                       "the last checkpoint.") from None
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

