"""The Stream Generation Service: N generator instances behind one stream.

Each instance is a Ray actor (actor.py) holding one vLLM engine.
`StreamGenerationService.generate` hands each instance its share of the
requests (fixed lists, fixed.py, or a shared work pool, pooled.py) and
yields every finished Sample the moment any instance produces it (the
fan-in loop, fanin.py), so the trainer can work on it at once; `update`
loads new weights into every live instance (delivery.py). The instances'
lifecycle, elastic changes included, is instances.py's.

Faults: an instance that dies mid-stream is reported (`dead_instances`, a log
warning) and its undelivered requests are re-run on the survivors, so the
stream still yields every request exactly once. An instance that still has
work but yields nothing for `stall_timeout_s` fails the stream with a
TimeoutError that names it: the trainer never waits forever.

torch and vLLM are imported only inside the actor processes, never here in
the trainer's process.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from streamrl import cluster as cluster_lib
from streamrl.cluster import Cluster
from streamrl.envs.config import Env
from streamrl.errors import UserError
from streamrl.generator import fanin
from streamrl.generator import fixed
from streamrl.generator import local
from streamrl.generator import pooled as pooled_lib
from streamrl.generator.actor import GeneratorActor, StoppableGeneratorActor, actor_options
from streamrl.generator.config import Engine, Sampling
from streamrl.generator.instances import Instances
from streamrl.generator.rollout import DeadInstance, Request, UpdateHandle
from streamrl.scheduling.pool import WorkPool
from streamrl.transfer.config import Transfer

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
    placement: where the actors run (`cluster.*`: the generation pool and labels).
    max_instances: the most instances the run may have at once (elastic
      generation; None: `num_instances`).
    stoppable: `generate(stoppable=True)` calls, which `stop_generation` ends.
    pooled: `generate(pool=...)` calls over a shared work pool.
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
      chat_template_kwargs: dict | None = None,
      lora_rank: int = 0,
  ):
    num_instances = int(num_instances or engine.num_instances)
    if num_instances < 1:
      raise UserError(f"engine.num_instances={num_instances} must be >= 1.")
    self.stall_timeout_s = float(stall_timeout_s)
    # Partial rollouts: streams that `stop_generation` can end early.
    # A shared work pool's streams (`pooled`) are topped up beside them too.
    self._stoppable = bool(stoppable or pooled)
    self.pooled = bool(pooled)  # generate takes a shared pool
    self._migrate = env is None or not env.enabled  # trajectories do not move
    self._max_num_seqs = engine.max_num_seqs
    self._stop_keys = iter(range(1, 1 << 62))
    self._stoppable_key: int | None = None  # the stoppable stream running now
    self._stopped_key: int | None = None  # the one asked to stop
    # Samples finishing within this window reach the trainer as one object.
    self.coalesce_s = float(engine.coalesce_s)
    self.traffic = fanin.Traffic()
    self._cluster = cluster
    # Ray's CPU bookkeeping and the core split assume the most instances the
    # run may have at once.
    slots = max(num_instances, int(max_instances or num_instances))
    self.instances = Instances(
        model_dir,
        engine,
        cluster=cluster,
        engine_kwargs=local.engine_kwargs(
            engine,
            dtype=dtype,
            seed=seed,
            env=env,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            lora_rank=lora_rank,
        ),
        num_instances=num_instances,
        slots=slots,
        actor_cls=StoppableGeneratorActor if self._stoppable else GeneratorActor,
        options=actor_options(engine, cluster.generator_cpus, slots, placement),
        start_timeout_s=start_timeout_s,
        log_dir=log_dir,
        transfer=transfer,
        stall_timeout_s=self.stall_timeout_s,
    )
    self.delivery = self.instances.delivery

  # -- what the run reads -----------------------------------------------------

  @property
  def num_instances(self) -> int:
    """Instances ever started (ids 0..num_instances-1)."""
    return self.instances.num_instances

  @property
  def placement(self) -> dict[int, dict]:
    """{instance_id: {"pid", "cores", ...}}: where each instance runs."""
    return self.instances.placement

  @property
  def retired(self) -> list[tuple[int, str, float]]:
    """(instance_id, reason, time.perf_counter()) of each instance removed on purpose."""
    return self.instances.retired

  @property
  def busy_intervals(self) -> list[tuple[int, float, float, int]]:
    """(instance_id, start, end, num_samples) per finished stream segment, in
    time.perf_counter() seconds of this process: the instances' busy time."""
    return self.traffic.busy_intervals

  @property
  def num_objects(self) -> int:
    """Sample batches received, over all streams."""
    return self.traffic.num_objects

  @property
  def moves(self) -> int:
    """Responses moved between instances (shared pool), over all calls."""
    return self.traffic.moves

  @property
  def live_instances(self) -> list[int]:
    """The instances that take new work (not the ones being removed)."""
    return self.instances.live_instances

  @property
  def dead_instances(self) -> list[DeadInstance]:
    return self.instances.dead_instances

  @property
  def publisher(self):
    """The transfer service's publisher (None with the Ray backend)."""
    return getattr(self.delivery, "publisher", None)

  def actor(self, instance_id: int):
    """The Ray actor handle of one instance (for tests and diagnostics)."""
    return self.instances.actor(instance_id)

  def helper_placement(self) -> tuple[dict, tuple[int, ...] | None]:
    """Where a helper process of the generation side (the ranker,
    `streamrl.scheduling.ranker_actor`) runs: Ray options that put it on a
    generation node without taking an instance's slot or CPUs, and the
    generator cores to pin it to (a local Ray; None on a remote cluster)."""
    options = {"num_cpus": 0}
    if "label_selector" in self.instances.options:
      options["label_selector"] = dict(self.instances.options["label_selector"])
    shares = self._cluster.shares
    return options, (tuple(shares.generator_cores) if shares is not None else None)

  def close(self) -> None:
    self.instances.close()

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
    return self.instances.add(reason)

  def remove_instance(self, instance_id: int | None = None, reason: str = "") -> int:
    """Takes an instance (default: the newest live one) out of service.

    It takes no new work at once; the work it already has finishes and is
    delivered (nothing is lost or re-run), then it is stopped. Returns its id.
    """
    return self.instances.remove(instance_id, reason)

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
    if not self.instances.receiving():
      raise self.instances.all_dead_error(
          message="All generator instances are dead; nothing to update."
      )
    return self.delivery.push(tensors, int(version))

  def versions(self) -> dict[int, int]:
    """{instance_id: weight version} of the live instances, as of their last
    load (kept here, so asking never waits behind a running stream)."""
    return self.instances.versions()

  def query_versions(self, timeout_s: float = 60.0) -> dict[int, int]:
    """The versions as the live instances report them (waits for running streams)."""
    return self.instances.query_versions(timeout_s)

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
    if not self.instances.receiving():
      raise self.instances.all_dead_error()
    num = self.num_instances
    if pool is not None:
      if requests is not None or assignments is not None:
        raise ValueError("generate takes a pool or requests / assignments, not both.")
      if not self._stoppable:
        raise ValueError("generate(pool=...) needs a StreamGenerationService(pooled=True).")
    else:
      plan = fixed.plan(requests, assignments, num, self.live_instances)
    caps = list(caps) if caps is not None else [None] * num
    if len(caps) != num:
      raise ValueError(f"caps has {len(caps)} entries for {num} instances.")
    stop_key = None
    if stoppable:
      if not self._stoppable:
        raise ValueError(
            "generate(stoppable=True) needs a StreamGenerationService(stoppable=True)."
        )
      stop_key = self._stoppable_key = next(self._stop_keys)

    def stopped() -> bool:
      return stop_key is not None and self._stopped_key == stop_key

    fan = fanin.FanIn(self.instances, self.traffic, stall_timeout_s or self.stall_timeout_s)
    if pool is not None:
      rnd = pooled_lib.PooledRound(
          pool,
          {i: c or self._max_num_seqs for i, c in enumerate(caps)},
          max_tokens=sampling.max_tokens,
          migrate=migrate and self._migrate,
          lookahead=POOL_LOOKAHEAD,
          straggler_tokens=straggler_tokens if self._migrate else 0,
          long_instances=tuple(pool.long_instances) or tuple(self.live_instances[-1:]),
      )
      call = pooled_lib.PooledCall(
          rnd,
          self.traffic,
          sampling=sampling,
          seed=seed,
          stop_key=stop_key,
          feed_key=stop_key if stop_key is not None else next(self._stop_keys),
          stopped=stopped,
      )
    else:
      call = fixed.FixedRound(
          plan,
          self.instances,
          sampling=sampling,
          seed=seed,
          caps=caps,
          coalesce_s=self.coalesce_s,
          stop_key=stop_key,
          stopped=stopped,
      )
    return self._guarded(fan.run(call), stop_key)

  def _guarded(self, stream, stop_key):
    """`stream` counted as a running call (instances being removed stop after the last)."""
    with self.instances.serving():
      try:
        yield from stream
      finally:
        stream.close()
        if stop_key is not None and self._stoppable_key == stop_key:
          self._stoppable_key = None

  def stop_generation(self) -> None:
    """Ends the running stoppable `generate` call early (see
    `rollout.Rollout.stop_generation`); does nothing when none runs."""
    key = self._stoppable_key
    if key is None or self._stopped_key == key:
      return
    self._stopped_key = key
    for i in self.live_instances:
      self.instances.actor(i).request_stop.remote(key)
