"""The Stream Generation Service: N generator instances behind one stream.

Each instance is a Ray actor (`GeneratorActor`) holding one vLLM engine
(`GeneratorInstance`). `StreamGenerationService.generate` hands each instance
its share of the requests and yields every finished Sample the moment any
instance produces it, so the trainer can work on it at once; `update` loads
new weights into every live instance.

Faults: an instance that dies mid-stream is reported (`dead_instances`, a log
warning) and its undelivered requests are re-run on the survivors, so the
stream still yields every request exactly once. An instance that still has
work but yields nothing for `stall_timeout_s` fails the stream with a
TimeoutError that names it: the trainer never waits forever.

torch and vLLM are imported only inside the actor processes, never here in
the trainer's process.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import ray

from streamrl import cluster as cluster_lib
from streamrl import lifecycle
from streamrl import oom
from streamrl.cluster import Cluster
from streamrl.envs.config import Env
from streamrl.generator.config import Engine, Sampling
from streamrl.transfer.config import Transfer
from streamrl.errors import UserError
from streamrl.scheduling.pool import Feed, WorkPool
from streamrl.generator import delivery as delivery_lib
from streamrl.generator import local
from streamrl.generator import pooled as pooled_lib
from streamrl.generator.rollout import (
    PARTIAL,
    DeadInstance,
    Request,
    Sample,
    UpdateHandle,
    as_requests,
)

log = logging.getLogger(__name__)


class _GeneratorActor:
  """One generator instance in its own Ray worker process.

  Methods run one at a time (a plain, single-threaded actor), so a weight
  update can never overlap a stream: a `ray.cancel`ed stream stops at its next
  finished sample, aborts what is still running and frees the engine first.
  `StoppableGeneratorActor` adds `request_stop`, which runs beside a stream.
  """

  def __init__(
      self,
      model_dir: str,
      *,
      instance_id: int,
      engine_kwargs: dict,
      cores: Sequence[int] | None,
      num_threads: int | None,
      in_process: bool = True,
      log_dir: str | None = None,
  ):
    lifecycle.guard_children()  # Its engine processes die with this actor.
    # First: vLLM's and other libraries' chatter goes to <log_dir>/libraries.log.
    from streamrl import metrics  # pylint: disable=g-import-not-at-top

    metrics.configure_actor_logging(log_dir)
    # Before torch loads: libgomp sizes its pool from OMP_NUM_THREADS. None
    # (GPU engines): leave the thread counts as Ray set them.
    if num_threads is not None:
      os.environ["OMP_NUM_THREADS"] = str(num_threads)
      os.environ["MKL_NUM_THREADS"] = str(num_threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # In-process engine: no extra engine-core process, ~2.5 s start-up instead
    # of ~15 s on CPU, and the pinning below covers every engine thread.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    # Read only by vLLM's multiprocess executor (in_process=False): it binds
    # the worker's OpenMP threads to these cores.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores)) if cores else "nobind"
    t0 = time.perf_counter()
    import torch  # pylint: disable=g-import-not-at-top
    # Must precede the engine: vLLM's CPU worker disables set_num_threads.
    if num_threads is not None:
      torch.set_num_threads(num_threads)
    from streamrl.generator.vllm_engine import GeneratorInstance  # pylint: disable=g-import-not-at-top

    self._gen = GeneratorInstance(model_dir, instance_id=instance_id, **engine_kwargs)
    # Pinned only now, so that imports and engine start-up may use any core;
    # this pins every thread that exists, and threads made later inherit it.
    if cores:
      cluster_lib.pin_process_threads(cores, children=not in_process)
    self._startup_s = time.perf_counter() - t0
    self._instance_id = instance_id
    self._fault: dict | None = None
    self._peak_in_flight = self._num_yielded = 0
    self._stop_key = None  # the stream `request_stop` asked to end
    self._feeds: dict[int, Feed] = {}  # a shared pool's streams: key -> their feed

  def info(self) -> dict:
    import torch  # pylint: disable=g-import-not-at-top

    return {
        **cluster_lib.where_am_i(),
        "instance_id": self._instance_id,
        "pid": os.getpid(),
        "weight_version": self._gen.weight_version,
        "cores": tuple(sorted(os.sched_getaffinity(0))),
        "torch_threads": torch.get_num_threads(),
        # What Ray gave this actor (None: no GPU was asked for).
        "gpu_ids": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "engine_in_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
        "startup_s": self._startup_s,
    }

  def last_stream_stats(self) -> dict:
    """The last stream's sample count and the largest number of requests seen
    running at once (sampled at each finish: checks that a cap arrived)."""
    return {"num_samples": self._num_yielded, "peak_in_flight": self._peak_in_flight}

  def generate(
      self,
      requests: Sequence[Request],
      sampling: Sampling,
      max_in_flight: int | None = None,
      coalesce_s: float = 0.0,
      stop_key: int | None = None,
      *,
      seed: int | None = None,
      feed_key: int | None = None,
      straggler_tokens: int | None = None,
  ):
    """Ray streaming generator: yields lists of finished Samples.

    `sampling` and `seed` as in `GeneratorInstance.generate` (with a seed,
    the request of prompt id p samples with seed + p; None: unseeded).

    Samples that finish within `coalesce_s` of the first one not yet sent
    travel together as one Ray object (0: each on its own). Each object costs
    the receiving trainer CPU time (experiments/RESULTS.md); a window of a few
    tens of ms keeps that off the trainer's core while delaying no sample by
    more than the window (or the gap to the next finish, when that is longer).
    With a `stop_key`, `request_stop(stop_key)` ends the stream early: what is
    unfinished comes back as PARTIAL samples.
    With a `feed_key` the stream takes its requests from a shared pool's
    `Feed` (streamrl/scheduling/pool.py), which `feed(feed_key, ...)` tops up
    beside it; it ends once the feed is closed and its work is done, and
    gives up running requests that reach `straggler_tokens`.
    """
    ctx = ray.get_runtime_context()
    self.apply_staged()  # Between streams: the newest verified weights, if any.
    fault, self._fault = self._fault, None
    stop = None if stop_key is None else (lambda: self._stop_key == stop_key)
    if feed_key is not None:
      feed = self._feeds.setdefault(feed_key, Feed())
      if straggler_tokens and feed.open:
        feed.straggler = int(straggler_tokens)
      feed.add(requests)
      requests = feed
    stream = self._gen.generate(
        requests, sampling, seed=seed, max_in_flight=max_in_flight, stop=stop
    )
    self._peak_in_flight = self._num_yielded = 0
    pending: list = []
    first_at = 0.0
    try:
      for n, sample in enumerate(stream, 1):
        if sample.finish_reason == PARTIAL:
          # The stream is ending: what is left travels in one object.
          pending.append(sample)
          continue
        # The engine's count of requests still running after this finish.
        self._peak_in_flight = max(self._peak_in_flight, self._gen.in_flight + 1)
        if not pending:
          first_at = time.perf_counter()
        pending.append(sample)
        at_fault = fault is not None and n == fault["after_samples"]
        if at_fault or time.perf_counter() - first_at >= coalesce_s:
          self._num_yielded = n
          yield pending
          pending = []
        if at_fault:
          self._run_fault(fault, ctx)
        # ray.cancel only raises a flag for a running actor task.
        if ctx.is_canceled():
          return
      if pending:
        self._num_yielded += len(pending)
        yield pending
    finally:
      stream.close()  # Aborts whatever the engine still runs.
      if feed_key is not None:
        self._feeds.pop(feed_key, None)

  def feed(self, feed_key: int, **order) -> None:
    """Tops up the shared pool's stream `feed_key` (see `generate`): one
    `Feed.order` (more requests, running requests to give up, the close).
    Runs beside the stream on a StoppableGeneratorActor; may arrive before
    the stream starts."""
    self._feeds.setdefault(feed_key, Feed()).order(**order)

  def update_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> int:
    return self._gen.update_weights(tensors, version)

  def update_weights_from_file(self, path: str, version: int) -> int:
    """Loads a weights file on this host (one file for every instance here)."""
    return self._gen.update_weights_from_file(path, version)

  def release_weights_file(self) -> None:
    """Removes the engine's kept weights file (before the actor is stopped)."""
    self._gen.release_weights_file()

  def last_weights_file(self) -> str | None:
    """The file the engine last loaded weights from (for tests and diagnostics)."""
    return self._gen.last_weights_file

  # -- checkpoint-transfer service (config.transfer.enabled) -----------------

  def join_transfer(
      self,
      address,
      schema,
      transfer: Transfer,
      *,
      bind: str = "127.0.0.1",
      secret: bytes,
      run_keys,
  ) -> int:
    """Starts this instance's transfer Receiver and joins the publisher.

    The receiver pulls and verifies new versions on its own threads while
    the engine generates; a verified version is only staged here and loaded
    between two streams (`apply_staged`), so generation pauses just for the
    in-place load itself and never mixes two versions. The engine loads
    the verified file itself: the publisher's on its host, else the one
    file its host's first receiver received (see streamrl/transfer).
    `secret` is the run's transfer secret (TransferDelivery makes one per run) and
    `run_keys` the publisher's keys (`Publisher.run_keys`): only versions the
    publisher signed are loaded.
    """
    from streamrl.transfer import Receiver  # pylint: disable=g-import-not-at-top

    self._stage_lock = threading.Lock()
    self._staged = None
    self._receiver = Receiver(
        f"generator{self._instance_id}",
        cluster_lib.where_am_i()["datacenter"],
        self._stage,
        expected_schema=schema,
        config=transfer,
        initial_version=self._gen.weight_version,
        bind=bind,
        secret=secret,
        run_keys=run_keys,
    )
    return self._receiver.join(tuple(address))

  def _stage(self, tensors, version: int) -> None:
    """The receiver's load_fn: keeps the verified version for `apply_staged`.

    `tensors.path` is the verified file; a pin keeps any writer from
    rewriting or removing it until the engine has loaded it (or a newer
    version replaces it here). Without /dev/shm the bytes are in memory the
    receiver reuses: they are copied.
    """
    from streamrl.transfer import Pin  # pylint: disable=g-import-not-at-top

    if tensors.path is not None:
      staged = (version, tensors.path, Pin(tensors.path))
    else:
      staged = (version, {k: np.array(v) for k, v in tensors.items()}, None)
    with self._stage_lock:
      old, self._staged = self._staged, staged
    if old is not None and old[2] is not None:
      old[2].release()

  def apply_staged(self) -> int:
    """Loads the newest verified version, if newer than the engine's."""
    staged = None
    if getattr(self, "_stage_lock", None) is not None:
      with self._stage_lock:
        staged, self._staged = self._staged, None
    if staged is None:
      return self._gen.weight_version
    version, weights, pin = staged
    try:
      if version > self._gen.weight_version:
        if pin is not None:
          self._gen.update_weights_from_file(weights, version)
        else:
          self._gen.update_weights(weights, version)
    finally:
      if pin is not None:
        pin.release()
    return self._gen.weight_version

  def weight_version(self) -> int:
    return self._gen.weight_version

  # -- test hooks -------------------------------------------------------------

  def inject_fault(self, kind: str, after_samples: int, seconds: float = 3600.0) -> None:
    """For tests: the next generate call, after `after_samples` samples,
    stalls (`kind="stall"`, sleeps up to `seconds` unless cancelled) or dies
    (`kind="crash"`, the process exits)."""
    if kind not in ("stall", "crash"):
      raise ValueError(f"Unknown fault kind {kind!r}; use 'stall' or 'crash'.")
    self._fault = {"kind": kind, "after_samples": after_samples, "seconds": seconds}

  @staticmethod
  def _run_fault(fault: dict, ctx) -> None:
    if fault["kind"] == "crash":
      os._exit(1)  # pylint: disable=protected-access
    end = time.monotonic() + fault["seconds"]
    while time.monotonic() < end and not ctx.is_canceled():
      time.sleep(0.05)

  def request_stop(self, stop_key: int) -> None:
    """Ends the stream started with `stop_key` (now or, if it has not begun,
    as soon as it does); a plain actor runs this only between streams."""
    self._stop_key = stop_key


# Named as the class: Ray titles the worker process after it (`ray::GeneratorActor`).
GeneratorActor = ray.remote(max_restarts=0, max_task_retries=0)(
    type("GeneratorActor", (_GeneratorActor,), {"__doc__": _GeneratorActor.__doc__})
)


@ray.remote(max_restarts=0, max_task_retries=0, concurrency_groups={"control": 1})
class StoppableGeneratorActor(_GeneratorActor):
  """A GeneratorActor whose `request_stop` runs beside a stream (its own
  concurrency group), for partial rollouts; every other method still runs
  one at a time."""

  @ray.method(concurrency_group="control")
  def request_stop(self, stop_key: int) -> None:
    self._stop_key = stop_key

  @ray.method(concurrency_group="control")
  def feed(self, feed_key: int, **order) -> None:
    super().feed(feed_key, **order)


def actor_options(
    engine: Engine,
    generator_cpus: float,
    num_instances: int,
    placement: Cluster | None = None,
) -> dict:
  """The Ray resources of one `GeneratorActor`: its share of the generator
  CPUs, one slot of the generation pool and `engine.gpus_per_instance` GPUs
  (Ray then sets the actor's CUDA_VISIBLE_DEVICES to GPUs of its own), on a
  node carrying `placement.generation_labels`."""
  placement = placement or Cluster()
  options = dict(
      num_cpus=round(generator_cpus / num_instances, 4),
      num_gpus=engine.gpus_per_instance,
      resources={placement.generation_pool: 1},
      name=None,
  )
  labels = cluster_lib.parse_labels(placement.generation_labels)
  if labels:
    options["label_selector"] = labels
  return options


# Requests a shared pool's instance holds beyond its cap: one top-up may travel
# while it still has work queued.
POOL_LOOKAHEAD = 2


class StreamGenerationService:
  """N generator instances (Ray actors, ids 0..N-1) behind one sample stream;
  a `streamrl.generator.rollout.Rollout`.

  Args:
    model_dir: HF model directory every instance loads.
    engine: the engine settings (sizes, number of instances, coalescing).
    dtype, seed: the engine's dtype and sampling seed base.
    cluster: what `streamrl.cluster.init_ray` returned; its CPU shares pin
      each instance to its own cores on a local Ray.
    stall_timeout_s: longest wait for the next sample of an instance that
      still has work.
    transfer: when enabled, weights go through the checkpoint-transfer
      service (verified, chunked; shared memory on this host, TCP across
      hosts) instead of Ray's object store.
    num_instances: overrides `engine.num_instances`.
    start_timeout_s: longest wait for all engines to come up.
    log_dir: the run's workdir: each actor's library log goes to
      <log_dir>/libraries.log (None: Ray's worker logs).
    env, chat_template: multi-turn rollouts (streamrl/envs): each instance
      runs its own tool workers beside its engine.
    lora_rank: the trainer's `trainer.lora_rank`: each version is then an
      adapter on the model directory's weights (0: full weights).
  """

  def __init__(
      self,
      model_dir: str,
      engine: Engine,
      *,
      dtype: str,
      seed: int,
      cluster: cluster_lib.ClusterInfo,
      stall_timeout_s: float = 600.0,
      transfer: Transfer | None = None,
      num_instances: int | None = None,
      start_timeout_s: float = 600.0,
      log_dir: str | None = None,
      placement: Cluster | None = None,
      max_instances: int | None = None,
      stoppable: bool = False,
      pooled: bool = False,
      env: Env | None = None,
      chat_template: str = "auto",
      lora_rank: int = 0,
  ):
    num_instances = int(num_instances or engine.num_instances)
    if num_instances < 1:
      raise UserError(f"engine.num_instances={num_instances} must be >= 1.")
    self.stall_timeout_s = float(stall_timeout_s)
    # Partial rollouts: streams that `stop_generation` can end early.
    # A shared work pool's streams (`pooled`) are topped up beside them too.
    self._actor_cls = StoppableGeneratorActor if stoppable or pooled else GeneratorActor
    self.pooled = bool(pooled)  # generate takes a shared pool
    self.moves = 0  # responses moved between instances (shared pool), over all calls
    self._migrate = env is None or not env.enabled  # trajectories do not move
    self._stop_keys = iter(range(1, 1 << 62))
    self._stoppable_key: int | None = None  # the stoppable stream running now
    self._stopped_key: int | None = None  # the one asked to stop
    # Samples finishing within this window reach the trainer as one object.
    self.coalesce_s = float(engine.coalesce_s)
    self.num_objects = 0  # sample batches received, over all streams
    self.num_instances = 0  # ids handed out so far (0..num_instances-1)
    self.placement: dict[int, dict] = {}
    self._actors = {}
    self._gpus_per_instance = engine.gpus_per_instance
    self._lock = threading.RLock()
    self._live: set[int] = set()
    self._draining: set[int] = set()  # being removed: finish their work, take no new work
    self._runs_active = 0
    self._retire_reasons: dict[int, str] = {}
    self._dead: list[DeadInstance] = []
    # Each instance's resident memory, sampled, so that one killed for memory
    # stops the run with one sentence when no instance is left (streamrl/oom.py).
    self._memory = oom.Watch(os.path.join(log_dir, "trainer.log") if log_dir else "")
    self._memory_kills: list[Exception] = []
    # (instance_id, reason, time.perf_counter()) of each instance removed on purpose.
    self.retired: list[tuple[int, str, float]] = []
    # (instance_id, start, end, num_samples) per finished stream segment, in
    # time.perf_counter() seconds of this process: the instances' busy time.
    self.busy_intervals: list[tuple[int, float, float, int]] = []
    self._versions: dict[int, int] = {}
    # What a later instance is started with (elastic generation).
    self._model_dir, self._engine, self._cluster, self._log_dir = (
        model_dir,
        engine,
        cluster,
        log_dir,
    )
    self._engine_kwargs = local.engine_kwargs(
        engine, dtype=dtype, seed=seed, env=env, chat_template=chat_template, lora_rank=lora_rank
    )
    # Ray's CPU bookkeeping and the core split assume the most instances the
    # run may have at once.
    self._slots = max(num_instances, int(max_instances or num_instances))
    self._options = actor_options(engine, cluster.generator_cpus, self._slots, placement)
    self._start_timeout_s = float(start_timeout_s)
    ids = [self._start_actor() for _ in range(num_instances)]
    self._wait_ready(ids, start_timeout_s)
    backend = delivery_lib.backend_for(transfer)
    self.delivery = delivery_lib.BACKENDS[backend](
        self.actor,
        lambda: sorted(self._live),
        self._finish_update,
        transfer=transfer,
        start_version=min(self._versions.values(), default=0),
        stall_timeout_s=self.stall_timeout_s,
    )

  @property
  def publisher(self):
    """The transfer service's publisher (None with the Ray backend)."""
    return getattr(self.delivery, "publisher", None)

  def helper_placement(self) -> tuple[dict, tuple[int, ...] | None]:
    """Where a helper process of the generation side (the ranker,
    `streamrl.scheduling.ranker_actor`) runs: Ray options that put it on a
    generation node without taking an instance's slot or CPUs, and the
    generator cores to pin it to (a local Ray; None on a remote cluster)."""
    options = {"num_cpus": 0}
    if "label_selector" in self._options:
      options["label_selector"] = dict(self._options["label_selector"])
    shares = self._cluster.shares
    return options, (tuple(shares.generator_cores) if shares is not None else None)

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
    self._actors[i] = self._actor_cls.options(**self._options).remote(
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

  # -- lifecycle --------------------------------------------------------------

  def _wait_ready(self, ids: Sequence[int], timeout_s: float) -> None:
    """Waits for the engines of `ids` to start; they become live. On failure
    every one of them is stopped and the error names the first that failed."""
    refs = {i: self._actors[i].info.remote() for i in ids}
    gpus = f" and {len(ids)} x {self._gpus_per_instance} GPUs" if self._gpus_per_instance else ""
    try:
      infos = ray.get(list(refs.values()), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
      self._stop(ids)
      raise TimeoutError(
          f"The generator instances did not start within {timeout_s:.0f} s; check that the "
          f"cluster offers {len(ids)} x {self._options['resources']} on nodes labelled "
          f"{self._options.get('label_selector', {})} and enough CPUs{gpus} (ray status)."
      ) from None
    except ray.exceptions.RayActorError as e:
      bad = next((i for i, r in refs.items() if _failed(r)), "?")
      self._stop(ids)
      raise RuntimeError(
          f"Generator instance {bad} failed to start: " f"{pooled_lib.last_line(e.error_msg)}"
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
    self._stop(list(self._actors))
    with self._lock:
      self._live.clear()
      self._draining.clear()
    self.delivery.close()
    self._memory.close()

  @property
  def live_instances(self) -> list[int]:
    """The instances that take new work (not the ones being removed)."""
    with self._lock:
      return sorted(self._live - self._draining)

  # -- elastic generation -----------------------------------------------------

  def add_instance(self, reason: str = "") -> int:
    """Starts one more generator instance and returns its id once it can serve.

    Late-joiner catch-up: through the transfer service its receiver pulls
    and verifies the current weight version (checksums, schema) before
    `join` returns, and the engine loads it; the instance becomes live only
    when it reports that version. Without the transfer service it starts
    from the model directory, so only before the first update. It takes
    work from the next `generate` call on.
    """
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
          else pooled_lib.last_line(getattr(e, "error_msg", None) or str(e))
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

  def remove_instance(self, instance_id: int | None = None, reason: str = "") -> int:
    """Takes an instance (default: the newest live one) out of service.

    It takes no new work at once; the work it already has finishes and is
    delivered (nothing is lost or re-run), then it is stopped. Returns its id.
    """
    with self._lock:
      live = sorted(self._live - self._draining)
      if len(live) <= 1:
        raise RuntimeError("Cannot remove the last live generator instance.")
      i = live[-1] if instance_id is None else int(instance_id)
      if i not in live:
        raise ValueError(f"Generator instance {i} is not live; live ones: {live}.")
      self._draining.add(i)
      idle = self._runs_active == 0
    log.info("Generator instance %d is draining%s.", i, f" ({reason})" if reason else "")
    if idle:
      self._retire(i, reason)
    else:
      self._retire_reasons[i] = reason
    return i

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

  def _retire_idle_draining(self, busy: set[int] = frozenset()) -> None:
    with self._lock:
      ready = sorted(self._draining - set(busy))
    for i in ready:
      self._retire(i, self._retire_reasons.pop(i, ""))

  @property
  def dead_instances(self) -> list[DeadInstance]:
    return list(self._dead)

  def actor(self, instance_id: int):
    """The Ray actor handle of one instance (for tests and diagnostics)."""
    return self._actors[instance_id]

  # -- weights ----------------------------------------------------------------

  def update(self, tensors, version: int) -> UpdateHandle:
    """Sends the weights and returns at once; `.wait()` on the handle for the load.

    Each instance loads them after the stream it is running now, and before
    any generate call made after this one: a stream started later carries
    the new version in all its samples. How they travel is the delivery
    backend's (streamrl/generator/delivery.py: Ray, or the transfer
    service); `tensors` may be lazy (`hf.HFTensors`) or a filled
    `transfer.WeightsFile` (a multi-process trainer's export).
    """
    if not self._live:
      raise self._all_dead_error("All generator instances are dead; nothing to update.")
    return self.delivery.push(tensors, int(version))

  def _finish_update(self, calls: Mapping, timeout_s: float | None) -> dict[int, int]:
    """{instance: version} of the load `calls` (the delivery's `finish`); an
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
        self._mark_dead(
            i,
            f"died during a weight update: {pooled_lib.last_line(e.error_msg)}",
            0,
            error_text=e.error_msg,
        )
      except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None
    if not self._live:
      raise self._all_dead_error("All generator instances died during the weight update.")
    return self.versions()

  def versions(self) -> dict[int, int]:
    """{instance_id: weight version} of the live instances, as of their last
    load (kept here, so asking never waits behind a running stream)."""
    return {i: self._versions[i] for i in sorted(self._live)}

  def query_versions(self, timeout_s: float = 60.0) -> dict[int, int]:
    """The versions as the live instances report them (waits for running streams)."""
    ids = sorted(self._live)
    got = ray.get([self._actors[i].weight_version.remote() for i in ids], timeout=timeout_s)
    return dict(zip(ids, got))

  # -- generation -------------------------------------------------------------

  def generate(
      self,
      requests: Sequence[Request] | None,
      sampling: Sampling,
      *,
      seed: int | None = None,
      assignments: Sequence[Sequence[Request]] | None = None,
      caps: Sequence[int | None] | None = None,
      stall_timeout_s: float | None = None,
      stoppable: bool = False,
      pool: WorkPool | None = None,
      migrate: bool = False,
      straggler_tokens: int = 0,
  ) -> Iterator:
    """Yields one Sample per request, each as soon as an instance finishes it.

    Args:
      requests: (request id, prompt token ids) pairs with unique ids; split
        round-robin over the live instances unless `assignments` is given.
      sampling: the run's `sampling.*` (`config.Sampling`).
      seed: with a seed, the request of prompt id p samples with seed + p
        (the same tokens whatever instance or batch runs it); None: unseeded.
      assignments: one request list per instance id (0..N-1), run in the
        given order (e.g. LPT order from the skew scheduler). `requests` may
        then be None; if given it must hold the same ids.
      caps: per-instance cap on requests in flight (None: the engine's
        max_num_seqs).
      stall_timeout_s: overrides the service's timeout for this call.
      stoppable: `stop_generation` may end this call early (a service made
        with stoppable=True; one such call at a time).
      pool: a shared `WorkPool` holding the call's requests (instead of
        `requests` / `assignments`; a service made with pooled=True): each
        instance takes its next request from it as a slot frees up
        (streamrl/generator/pooled.py); `caps` as above.
      migrate: with a pool, an idle instance takes a straggler from the
        busiest once the pool is empty (never for multi-turn trajectories).
      straggler_tokens: with a pool, a request that reaches this many tokens
        on a regular instance moves to a long-tail instance (the pool's, else
        the last live one); 0: never.

    Closing the iterator early cancels the remaining work. Requests of an
    instance that dies (before or during the call) are re-run on the live
    ones; a Sample's `instance_id` says which instance produced it.
    """
    if not self._live:
      raise self._all_dead_error(self._all_dead_message(0))
    if pool is not None:
      if requests is not None or assignments is not None:
        raise ValueError("generate takes a pool or requests / assignments, not both.")
      if self._actor_cls is not StoppableGeneratorActor:
        raise ValueError("generate(pool=...) needs a StreamGenerationService(pooled=True).")
    else:
      plan = self._plan(requests, assignments)
    caps = list(caps) if caps is not None else [None] * self.num_instances
    if len(caps) != self.num_instances:
      raise ValueError(f"caps has {len(caps)} entries for {self.num_instances} instances.")
    stop_key = None
    if stoppable:
      if self._actor_cls is not StoppableGeneratorActor:
        raise ValueError(
            "generate(stoppable=True) needs a StreamGenerationService(stoppable=True)."
        )
      stop_key = self._stoppable_key = next(self._stop_keys)
    timeout_s = float(stall_timeout_s or self.stall_timeout_s)
    if pool is not None:
      rnd = pooled_lib.PooledRound(
          pool,
          {i: c or self._engine.max_num_seqs for i, c in enumerate(caps)},
          max_tokens=sampling.max_tokens,
          migrate=migrate and self._migrate,
          lookahead=POOL_LOOKAHEAD,
          straggler_tokens=straggler_tokens if self._migrate else 0,
          long_instances=tuple(pool.long_instances) or tuple(self.live_instances[-1:]),
      )
      return self._guarded(pooled_lib.run(self, rnd, sampling, seed, timeout_s, stop_key), stop_key)
    return self._guarded(self._run(plan, sampling, seed, caps, timeout_s, stop_key), stop_key)

  def _guarded(self, stream, stop_key):
    """`stream` counted as a running call (see `_run`'s end)."""
    with self._lock:
      self._runs_active += 1
    try:
      yield from stream
    finally:
      stream.close()
      if stop_key is not None and self._stoppable_key == stop_key:
        self._stoppable_key = None
      with self._lock:
        self._runs_active -= 1
        last = self._runs_active == 0
      if last:
        self._retire_idle_draining()

  def stop_generation(self) -> None:
    """Ends the running stoppable `generate` call early (see
    `rollout.Rollout.stop_generation`); does nothing when none runs."""
    key = self._stoppable_key
    if key is None or self._stopped_key == key:
      return
    self._stopped_key = key
    for i in self.live_instances:
      self._actors[i].request_stop.remote(key)

  def _plan(self, requests, assignments) -> dict[int, list]:
    if assignments is None:
      if requests is None:
        raise ValueError("generate needs requests or assignments.")
      reqs = as_requests(requests)
      live = self.live_instances
      plan = {i: [] for i in range(self.num_instances)}
      for k, req in enumerate(reqs):
        plan[live[k % len(live)]].append(req)
    else:
      if len(assignments) != self.num_instances:
        raise ValueError(
            f"assignments has {len(assignments)} lists for "
            f"{self.num_instances} instances; give one (maybe empty) per instance."
        )
      plan = {i: as_requests(a) for i, a in enumerate(assignments)}
      reqs = [r for i in range(self.num_instances) for r in plan[i]]
    ids = [r.id for r in reqs]
    if len(set(ids)) != len(ids):
      dup = next(r for r, c in collections.Counter(ids).items() if c > 1)
      raise ValueError(f"Request id {dup} appears more than once; request ids must be unique.")
    if assignments is not None and requests is not None:
      if sorted(r.id for r in as_requests(requests)) != sorted(ids):
        raise ValueError("assignments must hold exactly the given requests, each once.")
    # Work planned for instances that are dead or removed goes to the live ones.
    live = set(self.live_instances)
    orphans = []
    for i in [i for i in plan if i not in live]:
      orphans.extend(plan.pop(i))
    self._spread(orphans, plan)
    return plan

  def _spread(self, reqs: list, plan: dict[int, list]) -> None:
    """Round-robin over the live instances, keeping the given order (LPT
    order stays descending inside each instance)."""
    live = self.live_instances
    for k, req in enumerate(reqs):
      plan.setdefault(live[k % len(live)], []).append(req)

  def _run(
      self,
      plan: dict[int, list],
      sampling: Sampling,
      seed: int | None,
      caps: list,
      stall_timeout_s: float,
      stop_key: int | None = None,
  ):
    # Per instance: batches not started yet (a survivor that already runs a
    # stream gets a dead peer's requests as its next batch).
    queued: dict[int, collections.deque] = collections.defaultdict(collections.deque)
    for i, reqs in plan.items():
      if reqs:
        queued[i].append(reqs)
    undelivered: dict[int, dict[int, Request]] = collections.defaultdict(dict)
    for i, reqs in plan.items():
      undelivered[i].update((r.id, r) for r in reqs)
    delivered: set[int] = set()
    active: dict = {}  # ObjectRefGenerator -> pooled_lib.Stream

    def stopped() -> bool:
      return stop_key is not None and self._stopped_key == stop_key

    def start(i: int) -> None:
      if stopped():
        return  # What is still queued comes back as PARTIAL at the end.
      if i in self._live and queued[i] and not any(s.instance_id == i for s in active.values()):
        reqs = queued[i].popleft()
        gen = (
            self._actors[i]
            .generate.options(num_returns="streaming")
            .remote(reqs, sampling, caps[i], self.coalesce_s, stop_key, seed=seed)
        )
        active[gen] = pooled_lib.Stream(i, reqs, time.perf_counter())

    def end(gen) -> None:
      st = active.pop(gen)
      if st.num_samples:
        self.busy_intervals.append((st.instance_id, st.started, st.last_sample, st.num_samples))

    def drained(i: int) -> None:
      """A removed instance whose work is all delivered stops now."""
      if i in self._draining and not queued.get(i) and not undelivered.get(i):
        if not any(s.instance_id == i for s in active.values()):
          self._retire(i, self._retire_reasons.pop(i, ""))

    def fail_over(i: int, error_text: str) -> None:
      for gen in [g for g, s in active.items() if s.instance_id == i]:
        end(gen)
      leftover = list(undelivered.pop(i, {}).values())
      queued.pop(i, None)
      self._mark_dead(i, pooled_lib.last_line(error_text), len(leftover), error_text=error_text)
      if not self.live_instances:
        raise self._all_dead_error(self._all_dead_message(len(leftover)))
      moved: dict[int, list] = {}
      self._spread(leftover, moved)
      for j, reqs in moved.items():
        queued[j].append(reqs)
        undelivered[j].update((r.id, r) for r in reqs)
        start(j)

    try:
      for i in list(queued):
        start(i)
      while active:
        now = time.perf_counter()
        deadline = {g: (s.last_sample or s.started) + stall_timeout_s for g, s in active.items()}
        wait_s = max(0.0, min(deadline.values()) - now)
        ready, _ = ray.wait(list(active), num_returns=1, timeout=wait_s)
        if not ready:
          now = time.perf_counter()
          stalled = sorted({active[g].instance_id for g, d in deadline.items() if d <= now})
          if not stalled:
            continue
          counts = ", ".join(f"instance {i}: {len(undelivered[i])} unfinished" for i in stalled)
          raise pooled_lib.stall_error(stalled, stall_timeout_s, f" ({counts})")
        for gen in ready:
          st = active[gen]
          i = st.instance_id
          try:
            batch = ray.get(next(gen))
          except StopIteration:
            end(gen)
            if not queued[i] and undelivered.get(i) and not stopped():
              # Can't happen with a healthy engine; never lose a request.
              log.warning(
                  "Instance %d ended its stream with %d requests undelivered; "
                  "running them again.",
                  i,
                  len(undelivered[i]),
              )
              queued[i].append(list(undelivered[i].values()))
            start(i)
            drained(i)
            continue
          except ray.exceptions.RayActorError as e:
            fail_over(i, e.error_msg)
            continue
          except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
          st.num_samples += len(batch)
          self.num_objects += 1
          st.last_sample = time.perf_counter()
          for sample in batch:
            rid = sample.prompt_id
            undelivered[i].pop(rid, None)
            if rid in delivered:
              log.warning("Dropped a second sample for request %d (from instance %d).", rid, i)
              continue
            delivered.add(rid)
            yield sample
      if stopped():
        # Stopped before they started (queued, or on an instance that died):
        # PARTIAL with no tokens, so every request is still answered once.
        for i in list(undelivered):
          for rid, r in sorted(undelivered.pop(i).items()):
            if rid not in delivered:
              delivered.add(rid)
              yield _unstarted(r)
    finally:
      # Runs on completion, on error and when the consumer closes the stream.
      for gen in list(active):
        try:
          ray.cancel(gen)
        except Exception:  # pylint: disable=broad-except
          pass  # Already finished or its actor is gone.
        end(gen)

  # -- faults -----------------------------------------------------------------

  def _mark_dead(self, i: int, reason: str, requeued: int, error_text: str = "") -> None:
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

  def _all_dead_error(self, message: str) -> Exception:
    """The error that ends the run once no instance is left: the first memory
    kill's one sentence when there was one, else `message`."""
    return self._memory_kills[0] if self._memory_kills else RuntimeError(message)

  def _all_dead_message(self, unfinished: int) -> str:
    dead = ", ".join(f"{d.instance_id} ({d.reason})" for d in self._dead)
    return (
        f"All {self.num_instances} generator instances are dead ({dead}); {unfinished} "
        "requests could not be finished. Check the instances' logs (ray logs) and "
        "restart the run."
    )


def _name(i: int, info: Mapping) -> str:
  """How a sentence names generator instance `i` (`info`: its placement)."""
  pid = info.get("pid")
  return f"generator (instance {i}, pid {pid})" if pid else f"generator (instance {i})"


def _unstarted(r: Request) -> Sample:
  """The PARTIAL sample of a request stopped before any instance ran it."""
  return Sample(
      r.id, r.prompt, (), (), PARTIAL, weight_version=-1, instance_id=-1, trajectory=r.trajectory
  )


def _failed(ref) -> bool:
  ready, _ = ray.wait([ref], timeout=0)
  if not ready:
    return False
  try:
    ray.get(ref)
    return False
  except Exception:  # pylint: disable=broad-except
    return True
