"""One generator instance in its own Ray worker process (`GeneratorActor`).

The actor holds one engine (`vllm_engine.GeneratorInstance`, started by
`local.start_instance`) and streams its finished samples as Ray objects;
it loads new weights between streams, from Ray, a file on its host, or the
checkpoint-transfer service's receiver. `StoppableGeneratorActor` also takes
a stop or a shared pool's top-up while a stream runs. `actor_options` is the
Ray resources of one.

torch and vLLM are imported only inside the actor's process.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import ray

from streamrl import allocator
from streamrl import cluster as cluster_lib
from streamrl import lifecycle
from streamrl.cluster import Cluster
from streamrl.generator import local
from streamrl.generator.config import Engine, Sampling
from streamrl.generator.rollout import PARTIAL, Request
from streamrl.scheduling.pool import Feed
from streamrl.transfer.config import Transfer


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
    allocator.cap_arenas()  # before the engine's weights and buffers
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
    # `_stream` generates: the engine itself, or the multi-turn agent loop on it.
    self._gen, self._stream = local.start_instance(
        model_dir, instance_id=instance_id, **engine_kwargs
    )
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
    stream = self._stream.generate(
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
