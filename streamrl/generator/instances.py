"""The generator instances of one service: their actors, lifecycle and weight versions.

`Instances` starts the Ray actors (`actor.GeneratorActor`, ids 0..N-1, never
reused), knows which are live, being removed (draining) or dead, and which
weight version each has loaded; it delivers new weights through a
`delivery.Delivery` backend. The service's generate calls (fanin.py) ask it
for the actors and report deaths to it (`mark_dead`).

Elastic generation: `add` starts one more instance mid-run (catching up to
the current weights through the transfer service), `remove` drains one:
it takes no new work and stops once its work is delivered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import ray

from streamrl import cluster as cluster_lib
from streamrl import oom
from streamrl.generator import delivery as delivery_lib
from streamrl.generator.config import Engine
from streamrl.generator.rollout import DeadInstance
from streamrl.transfer.config import Transfer

log = logging.getLogger(__name__)


def last_line(msg: str | None) -> str:
  """The last non-empty line of an error text (a remote traceback's cause)."""
  lines = [ln.strip() for ln in (msg or "").splitlines() if ln.strip()]
  return lines[-1] if lines else "unknown cause"


class Instances:
  """The generator actors of one service (see the module docstring).

  Args:
    model_dir, engine, cluster, log_dir: what every actor is started with
      (`actor.GeneratorActor`).
    engine_kwargs: the engine's keyword arguments (`local.engine_kwargs`).
    num_instances: how many start now.
    slots: the most instances the run may have at once (Ray's CPU bookkeeping
      and the core split assume that many).
    actor_cls: `GeneratorActor` or `StoppableGeneratorActor`.
    options: the Ray options of one actor (`actor.actor_options`).
    start_timeout_s: longest wait for an engine to come up.
    transfer, stall_timeout_s: how weights travel (`delivery.backend_for`).
  """

  def __init__(
      self,
      model_dir: str,
      engine: Engine,
      *,
      cluster: cluster_lib.ClusterInfo,
      engine_kwargs: dict,
      num_instances: int,
      slots: int,
      actor_cls,
      options: dict,
      start_timeout_s: float,
      log_dir: str | None,
      transfer: Transfer | None,
      stall_timeout_s: float,
  ):
    self.num_instances = 0  # ids handed out so far (0..num_instances-1)
    self.placement: dict[int, dict] = {}
    # (instance_id, reason, time.perf_counter()) of each instance removed on purpose.
    self.retired: list[tuple[int, str, float]] = []
    self.actor_cls = actor_cls
    self.options = options
    self._model_dir, self._engine, self._cluster, self._log_dir = (
        model_dir,
        engine,
        cluster,
        log_dir,
    )
    self._engine_kwargs = engine_kwargs
    self._slots = slots
    self._start_timeout_s = float(start_timeout_s)
    self._actors = {}
    self._lock = threading.RLock()
    self._live: set[int] = set()
    self._draining: set[int] = set()  # being removed: finish their work, take no new work
    self._calls = 0  # generate calls running now
    self._retire_reasons: dict[int, str] = {}
    self._dead: list[DeadInstance] = []
    # Each instance's resident memory, sampled, so that one killed for memory
    # stops the run with one sentence when no instance is left (streamrl/oom.py).
    self._memory = oom.Watch(os.path.join(log_dir, "trainer.log") if log_dir else "")
    self._memory_kills: list[Exception] = []
    self._versions: dict[int, int] = {}
    ids = [self._start_actor() for _ in range(num_instances)]
    self._wait_ready(ids, start_timeout_s)
    backend = delivery_lib.backend_for(transfer)
    self.delivery = delivery_lib.BACKENDS[backend](
        self.actor,
        self.receiving,
        self.finish_update,
        transfer=transfer,
        start_version=min(self._versions.values(), default=0),
        stall_timeout_s=stall_timeout_s,
    )

  def _start_actor(self) -> int:
    """Starts one more GeneratorActor (not yet live); returns its id."""
    i = self.num_instances
    self.num_instances += 1
    engine, cluster = self._engine, self._cluster
    if engine.gpus_per_instance:
      # A GPU engine: its CPU threads only feed the GPUs, no core pinning.
      cores, threads = None, None
    else:
      n = self._slots
      cores = cluster.shares.instance_cores(i % n, n) if cluster.shares is not None else None
      threads = len(cores) if cores else max(1, cluster.generator_cpus // n)
    self._actors[i] = self.actor_cls.options(**self.options).remote(
        self._model_dir,
        instance_id=i,
        engine_kwargs=self._engine_kwargs,
        cores=cores,
        num_threads=threads,
        # GPU engines keep vLLM's own engine-core process (its busy loop
        # overlaps scheduling with the GPU's work); CPU ones may run inline.
        in_process=engine.in_process and not engine.gpus_per_instance,
        log_dir=self._log_dir,
    )
    return i

  def _wait_ready(self, ids: Sequence[int], timeout_s: float) -> None:
    """Waits for the engines of `ids` to start; they become live. On failure
    every one of them is stopped and the error names the first that failed."""
    refs = {i: self._actors[i].info.remote() for i in ids}
    gpus = self._engine.gpus_per_instance
    gpus = f" and {len(ids)} x {gpus} GPUs" if gpus else ""
    try:
      infos = ray.get(list(refs.values()), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
      self._stop(ids)
      raise TimeoutError(
          f"The generator instances did not start within {timeout_s:.0f} s; check that the "
          f"cluster offers {len(ids)} x {self.options['resources']} on nodes labelled "
          f"{self.options.get('label_selector', {})} and enough CPUs{gpus} (ray status)."
      ) from None
    except ray.exceptions.RayActorError as e:
      bad = next((i for i, r in refs.items() if _failed(r)), "?")
      self._stop(ids)
      raise RuntimeError(
          f"Generator instance {bad} failed to start: " f"{last_line(e.error_msg)}"
      ) from None
    with self._lock:
      for info in infos:
        self.placement[info["instance_id"]] = info
        self._memory.add(_name(info["instance_id"], info), info.get("pid"), info.get("host"))
        self._versions[info["instance_id"]] = info["weight_version"]
        self._live.add(info["instance_id"])

  def _stop(self, ids: Sequence[int]) -> None:
    # A kill leaves no time to clean up: first each engine removes the weights
    # file it keeps in /dev/shm (a dead or stuck one is killed all the same).
    refs = [self._actors[i].release_weights_file.remote() for i in ids]
    ray.wait(refs, num_returns=len(refs), timeout=10)
    for i in ids:
      ray.kill(self._actors[i], no_restart=True)

  def close(self) -> None:
    """Stops every instance and the weight delivery."""
    self._stop(list(self._actors))
    with self._lock:
      self._live.clear()
      self._draining.clear()
    self.delivery.close()
    self._memory.close()

  def actor(self, instance_id: int):
    """The Ray actor handle of one instance."""
    return self._actors[instance_id]

  @property
  def live_instances(self) -> list[int]:
    """The instances that take new work (not the ones being removed)."""
    with self._lock:
      return sorted(self._live - self._draining)

  def receiving(self) -> list[int]:
    """The instances that load new weights: the live ones, draining ones included."""
    return sorted(self._live)

  def is_live(self, instance_id: int) -> bool:
    """Whether the instance is up (live or draining)."""
    return instance_id in self._live

  @property
  def dead_instances(self) -> list[DeadInstance]:
    return list(self._dead)

  @contextlib.contextmanager
  def serving(self) -> Iterator[None]:
    """Counts one running generate call; when the last one ends, the
    instances being removed stop (`remove`)."""
    with self._lock:
      self._calls += 1
    try:
      yield
    finally:
      with self._lock:
        self._calls -= 1
        last = self._calls == 0
      if last:
        with self._lock:
          ready = sorted(self._draining)
        for i in ready:
          self._retire(i, self._retire_reasons.pop(i, ""))

  # -- elastic generation -----------------------------------------------------

  def add(self, reason: str = "") -> int:
    """Starts one more instance and returns its id once it can serve (see
    `StreamGenerationService.add_instance`)."""
    if not self.delivery.can_catch_up and max(self._versions.values(), default=0) > 0:
      raise RuntimeError(
          "An instance added after a weight update needs the current weights from the "
          "checkpoint-transfer service; set transfer.enabled=True."
      )
    i = self._start_actor()
    refs = [self._actors[i].info.remote()]
    try:
      info = ray.get(refs[0], timeout=self._start_timeout_s)
      version = self.delivery.catch_up(i, self._start_timeout_s)
      version = info["weight_version"] if version is None else version
    except Exception as e:  # pylint: disable=broad-except
      self._stop([i])
      why = (
          f"did not start within {self._start_timeout_s:.0f} s"
          if isinstance(e, ray.exceptions.GetTimeoutError)
          else last_line(getattr(e, "error_msg", None) or str(e))
      )
      raise RuntimeError(f"Generator instance {i} could not join: {why}.") from None
    with self._lock:
      self.placement[i] = info
      self._versions[i] = version
      self._live.add(i)
    log.info(
        "Generator instance %d joined at weight version %d%s.",
        i,
        version,
        f" ({reason})" if reason else "",
    )
    return i

  def remove(self, instance_id: int | None = None, reason: str = "") -> int:
    """Takes an instance (default: the newest live one) out of service (see
    `StreamGenerationService.remove_instance`)."""
    with self._lock:
      live = sorted(self._live - self._draining)
      if len(live) <= 1:
        raise RuntimeError("Cannot remove the last live generator instance.")
      i = live[-1] if instance_id is None else int(instance_id)
      if i not in live:
        raise ValueError(f"Generator instance {i} is not live; live ones: {live}.")
      self._draining.add(i)
      idle = self._calls == 0
    log.info("Generator instance %d is draining%s.", i, f" ({reason})" if reason else "")
    if idle:
      self._retire(i, reason)
    else:
      self._retire_reasons[i] = reason
    return i

  def retire_if_draining(self, instance_id: int) -> None:
    """Stops the instance now if it is being removed (its work is all delivered)."""
    if instance_id in self._draining:
      self._retire(instance_id, self._retire_reasons.pop(instance_id, ""))

  def _retire(self, i: int, reason: str) -> None:
    with self._lock:
      if i not in self._draining:
        return
      self._draining.discard(i)
      self._live.discard(i)
      self._versions.pop(i, None)
    self._stop([i])
    self.delivery.forget(i)
    self.retired.append((i, reason, time.perf_counter()))
    log.info("Generator instance %d removed%s.", i, f" ({reason})" if reason else "")

  # -- weights ----------------------------------------------------------------

  def versions(self) -> dict[int, int]:
    """{instance_id: weight version} of the live instances, as of their last
    load (kept here, so asking never waits behind a running stream)."""
    return {i: self._versions[i] for i in sorted(self._live)}

  def query_versions(self, timeout_s: float = 60.0) -> dict[int, int]:
    """The versions as the live instances report them (waits for running streams)."""
    ids = sorted(self._live)
    got = ray.get([self._actors[i].weight_version.remote() for i in ids], timeout=timeout_s)
    return dict(zip(ids, got))

  def finish_update(self, calls: Mapping, timeout_s: float | None) -> dict[int, int]:
    """{instance: version} of the load `calls` (the delivery's `Finish`); an
    instance that died meanwhile is marked dead."""
    try:
      ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    except ray.exceptions.RayError:
      pass  # Read each result below.
    for i, call in calls.items():
      try:
        self._versions[i] = ray.get(call, timeout=0 if timeout_s is not None else None)
      except ray.exceptions.GetTimeoutError:
        raise TimeoutError(
            f"Generator instance {i} did not load the weights within " f"{timeout_s:.0f} s."
        ) from None
      except ray.exceptions.RayActorError as e:
        self.mark_dead(
            i,
            f"died during a weight update: {last_line(e.error_msg)}",
            0,
            error_text=e.error_msg,
        )
      except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None
    if not self._live:
      raise self.all_dead_error(message="All generator instances died during the weight update.")
    return self.versions()

  # -- faults -----------------------------------------------------------------

  def mark_dead(self, i: int, reason: str, requeued: int, error_text: str = "") -> None:
    """Records that instance `i` died (`reason`: one line; `error_text`: the
    whole error, read for a memory kill) with `requeued` of its requests
    re-run elsewhere, and makes sure its actor is gone."""
    with self._lock:
      if i not in self._live:
        return
      self._live.discard(i)
      self._draining.discard(i)
      self._versions.pop(i, None)
      if not self._live - self._draining and self._draining:
        # The last instance taking work died: keep the ones being removed.
        log.warning("Keeping generator instances %s: the last live one died.", self._draining)
        self._draining.clear()
    # An actor that is only unreachable could come back and produce samples
    # that were already re-run elsewhere: make sure it is gone.
    ray.kill(self._actors[i], no_restart=True)
    killed = self._memory.explain(_name(i, self.placement.get(i, {})), error_text or reason)
    if killed is not None:
      self._memory_kills.append(killed)
      reason = str(killed)
    self._dead.append(DeadInstance(i, reason, requeued, time.perf_counter()))
    log.warning(
        "Generator instance %d died (%s); %d unfinished requests re-run on instances " "%s.",
        i,
        reason,
        requeued,
        sorted(self._live),
    )

  def all_dead_error(self, *, unfinished: int = 0, message: str | None = None) -> Exception:
    """The error that ends the run once no instance is left: the first memory
    kill's one sentence when there was one, else `message` (by default: which
    instances died, and that `unfinished` requests could not be finished)."""
    if self._memory_kills:
      return self._memory_kills[0]
    if message is None:
      dead = ", ".join(f"{d.instance_id} ({d.reason})" for d in self._dead)
      message = (
          f"All {self.num_instances} generator instances are dead ({dead}); {unfinished} "
          "requests could not be finished. Check the instances' logs (ray logs) and "
          "restart the run."
      )
    return RuntimeError(message)


def _name(i: int, info: Mapping) -> str:
  """How a sentence names generator instance `i` (`info`: its placement)."""
  pid = info.get("pid")
  return f"generator (instance {i}, pid {pid})" if pid else f"generator (instance {i})"


def _failed(ref) -> bool:
  ready, _ = ray.wait([ref], timeout=0)
  if not ready:
    return False
  try:
    ray.get(ref)
    return False
  except Exception:  # pylint: disable=broad-except
    return True
