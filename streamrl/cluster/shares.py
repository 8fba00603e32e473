"""CPU shares on one machine: each side of the pipeline its own cores, pinned.

What is actually enforced:
- Each side gets its own cores (`plan_cpu_shares`). A generator actor pins all
  its threads with `sched_setaffinity` (kernel-enforced: its threads cannot
  run on other cores) and sizes torch's OpenMP pool to its share
  (`OMP_NUM_THREADS` before torch loads, `torch.set_num_threads` before the
  engine starts; vLLM forbids changing it afterwards). With the engine in the
  actor's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the default here) that
  is all there is. With worker processes (engine.in_process=False)
  `VLLM_CPU_OMP_THREADS_BIND` is set to the same cores, so vLLM binds its
  worker there, and the actor pins its engine-core process tree as well.
- The trainer process calls `bound_trainer_threads(cores)` before JAX creates
  its CPU client: its threads are pinned to the trainer's cores, and XLA
  sizes its thread pool from that affinity mask.
- Ray's own `num_cpus` per actor is bookkeeping for the scheduler only; Ray
  enforces nothing about cores.
- On a remote cluster no core ids are known in advance: actors only bound
  their thread counts (no pinning), and the node labels do the separation.

"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Sequence

from streamrl.errors import UserError

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CpuShares:
  """Core ids of this machine given to each side of the pipeline."""

  generator_cores: tuple[int, ...]
  trainer_cores: tuple[int, ...]

  def instance_cores(self, instance_id: int, num_instances: int) -> tuple[int, ...]:
    """Contiguous, disjoint slices of the generator cores, one per instance.

    With fewer cores than instances, instances share cores round-robin (no
    instance ever gets an empty set).
    """
    cores = self.generator_cores
    if num_instances <= len(cores):
      per, extra = divmod(len(cores), num_instances)
      start = instance_id * per + min(instance_id, extra)
      return cores[start : start + per + (instance_id < extra)]
    return (cores[instance_id % len(cores)],)


# affinity, and a second pipeline must still see every core.
_CORES_AT_START = tuple(sorted(os.sched_getaffinity(0)))


def available_cores() -> tuple[int, ...]:
  return _CORES_AT_START


def plan_cpu_shares(
    generator_cpus: int, trainer_cpus: int, cores: Sequence[int] | None = None
) -> CpuShares:
  """Generators take the first `generator_cpus` cores, the trainer the last
  `trainer_cpus`; they are disjoint when the machine has enough cores, and
  overlap (with a warning) when it hasn't."""
  if generator_cpus < 1 or trainer_cpus < 1:
    raise UserError(
        f"cluster.generator_cpus and cluster.trainer_cpus must be >= 1, got "
        f"{generator_cpus} and {trainer_cpus}."
    )
  cores = tuple(cores) if cores is not None else available_cores()
  n = len(cores)
  gen = tuple(cores[i % n] for i in range(generator_cpus))
  trainer = tuple(cores[(n - trainer_cpus + i) % n] for i in range(trainer_cpus))
  shared = sorted(set(gen) & set(trainer))
  if shared:
    log.warning(
        "generator_cpus=%d + trainer_cpus=%d exceed the %d cores available: cores "
        "%s are shared by both sides, so they are not disaggregated.",
        generator_cpus,
        trainer_cpus,
        n,
        shared,
    )
  return CpuShares(
      generator_cores=tuple(sorted(set(gen))), trainer_cores=tuple(sorted(set(trainer)))
  )


def pin_process_threads(cores: Sequence[int], *, children: bool = False) -> None:
  """Pins every thread this process has now, and (by inheritance) every thread
  it creates later, to `cores`; with `children`, its descendant processes'
  threads too. `os.sched_setaffinity(0, ...)` alone would pin only the
  calling thread."""
  cores = set(cores)
  pids = [os.getpid()] + (_descendants(os.getpid()) if children else [])
  for pid in pids:
    try:
      tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
      continue
    for tid in tids:
      try:
        os.sched_setaffinity(int(tid), cores)
      except (ProcessLookupError, PermissionError, OSError):
        pass  # A thread that just exited, or one we may not touch.
  os.sched_setaffinity(0, cores)


def _descendants(root: int) -> list[int]:
  parent: dict[int, int] = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          # The command name may hold spaces: the fields after it start at ')'.
          parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        pass
  found, frontier = [], [root]
  while frontier:
    kids = [p for p, pp in parent.items() if pp in frontier]
    found += kids
    frontier = kids
  return found


def bound_trainer_threads(cores: Sequence[int]) -> dict:
  """Confines the calling (trainer) process to `cores`; call it before JAX's
  first computation, since XLA sizes its CPU thread pool from the affinity
  mask when its client is created. Returns what was set, for the log."""
  cores = tuple(sorted(set(cores)))
  if not cores:
    raise ValueError("bound_trainer_threads needs at least one core.")
  n = str(len(cores))
  for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = n
  if set(os.sched_getaffinity(0)) <= set(cores):
    # Already confined (e.g. a TrainerActor pinned itself before JAX started):
    # nothing to pin again, and nothing to warn about.
    return {"cores": cores, "num_threads": len(cores), "already_bound": True}
  jax_started = _jax_backend_started()
  if jax_started:
    log.warning(
        "bound_trainer_threads called after JAX created its CPU client: threads are "
        "pinned to %s, but XLA's pool keeps its size.",
        cores,
    )
  pin_process_threads(cores)
  return {"cores": cores, "num_threads": len(cores), "jax_already_started": jax_started}


def _jax_backend_started() -> bool:
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

    return bool(getattr(xla_bridge, "_backends", {}))
  except ImportError:
    return False
