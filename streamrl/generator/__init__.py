"""Generation: vLLM engines behind the `Rollout` protocol (rollout.py).

The only package that imports torch and vLLM (inside `vllm_engine.py` and
`vllm_worker.py`, and only in the processes that run an engine):

  rollout.py      the protocol, Sample, UpdateHandle
  fake.py         FakeRollout: the protocol without an engine (tests of the loop)
  vllm_engine.py  one engine = one generator instance; its turn API
  vllm_worker.py  what runs inside vLLM's workers: the in-place weight reload
  admission.py    the order one generate call admits its requests in
  agentic.py      AgentStream: multi-turn rollouts on one engine, as Samples
  local.py        LocalRollout: one engine in the trainer's process
  actor.py        GeneratorActor: one engine in a Ray worker process
  instances.py    the actors of a service: start, live / draining / dead, versions
  delivery.py     how new weights reach the instances (Ray, transfer service)
  fanin.py        the fan-in loop: one call's streams merged into one
  fixed.py        a call over fixed per-instance lists
  pooled.py       a call over a shared work pool (and its bookkeeping)
  service.py      StreamGenerationService: N engines on Ray actors
  lockstep.py     engines in one process on a CPU-time clock (benchmarks)
  profiler.py     the PTL(BS) latency profile of one engine

The multi-turn agent loop itself is streamrl/envs/agent_loop.py, over the
engine's turn API.
"""

from __future__ import annotations


def make_rollout(s, model_dir: str, cluster=None, workdir: str | None = None):
  """The rollout of settings `s`: in this process for colocated, Ray actors
  otherwise (joining or starting Ray unless `cluster` is given)."""
  if s.pipeline.mode == "colocated":
    from streamrl.generator.local import LocalRollout  # pylint: disable=g-import-not-at-top

    return LocalRollout(
        model_dir,
        s.engine,
        dtype=s.model.dtype,
        seed=s.seed,
        env=s.env,
        chat_template=s.task.chat_template,
        chat_template_kwargs=s.task.template_kwargs(),
        lora_rank=s.trainer.lora_rank,
    )
  from streamrl import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from streamrl.generator.service import StreamGenerationService  # pylint: disable=g-import-not-at-top

  info = cluster or cluster_lib.init_ray_for(s.cluster, s.gpus_needed)
  return StreamGenerationService(
      model_dir,
      s.engine,
      dtype=s.model.dtype,
      seed=s.seed,
      cluster=info,
      stall_timeout_s=s.pipeline.stall_timeout_s,
      transfer=s.transfer,
      log_dir=workdir,
      placement=s.cluster,
      max_instances=s.elastic.max_instances if s.elastic.enabled else None,
      stoppable=s.partial_rollouts,
      env=s.env,
      chat_template=s.task.chat_template,
      chat_template_kwargs=s.task.template_kwargs(),
      lora_rank=s.trainer.lora_rank,
  )
