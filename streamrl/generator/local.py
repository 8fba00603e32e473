"""`LocalRollout`: one engine in the trainer's process (the colocated mode).

Generation and training take turns on the same cores; a weight update loads
synchronously, so its `UpdateHandle` is already done.
"""

from __future__ import annotations

import time

from streamrl import lifecycle
from streamrl.envs.config import Env
from streamrl.generator.config import Engine, Sampling
from streamrl.generator.rollout import UpdateHandle


def engine_kwargs(
    engine: Engine,
    *,
    dtype: str,
    seed: int,
    env: Env | None = None,
    chat_template: str = "auto",
    chat_template_kwargs: dict | None = None,
    lora_rank: int = 0,
) -> dict:
  """`GeneratorInstance` keyword arguments for one engine (`env`: its environment, for
  multi-turn rollouts, with the task's `chat_template` mode and its extra variables
  `chat_template_kwargs`; `lora_rank`: the
  trainer's, when versions arrive as LoRA adapters)."""
  return dict(
      env=env,
      lora_rank=lora_rank,
      chat_template=chat_template,
      chat_template_kwargs=dict(chat_template_kwargs or {}),
      max_num_seqs=engine.max_num_seqs,
      max_model_len=engine.max_model_len,
      seed=seed,
      kv_cache_gib=engine.kv_cache_gib,
      dtype=dtype,
      tensor_parallel_size=engine.tensor_parallel_size,
      gpu_memory_utilization=engine.gpu_memory_utilization,
      enforce_eager=engine.enforce_eager,
      keep_weights_file=engine.keep_weights_file,
  )


def start_instance(
    model_dir: str,
    *,
    instance_id: int,
    env: Env | None = None,
    chat_template: str = "auto",
    chat_template_kwargs: dict | None = None,
    **kwargs,
):
  """Starts one engine: (its `GeneratorInstance`, what streams its samples).

  The second is the engine itself, or for multi-turn rollouts (`env`
  enabled) an `agentic.AgentStream` on it (the agent loop of
  streamrl/envs/agent_loop.py); both have the same `generate`. `kwargs` are
  the engine's (`engine_kwargs` less env and the chat template's). Imports vLLM:
  only in a process that runs an engine.
  """
  from streamrl.generator.vllm_engine import GeneratorInstance  # pylint: disable=g-import-not-at-top

  gen = GeneratorInstance(model_dir, instance_id=instance_id, **kwargs)
  if env is None or not env.enabled:
    return gen, gen
  from streamrl.generator.agentic import AgentStream  # pylint: disable=g-import-not-at-top

  return gen, AgentStream(
      gen, env, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs
  )


def round_seed(seed: int, iteration: int) -> int:
  """The sampling seed of one training round (`generate(..., seed=...)`): a
  fresh one per iteration (each request adds its prompt id to it), so a
  resumed run samples what it would have."""
  return seed * 1_000_003 + iteration * 100_003


class LocalRollout:
  """One `GeneratorInstance` in this process (`engine`; multi-turn rollouts
  run on it through an `agentic.AgentStream`); `options` are `engine_kwargs`'
  keyword arguments (dtype, seed, env, chat_template, chat_template_kwargs, lora_rank)."""

  def __init__(self, model_dir: str, engine: Engine, **options):
    # vLLM's engine-core and worker processes die with this one (a no-op
    # when the run already guards this process).
    lifecycle.guard_children()
    from streamrl import metrics  # pylint: disable=g-import-not-at-top
    # vLLM's start-up chatter (its engine-core process inherits this
    # process's output as it is now) goes to <workdir>/libraries.log.
    with metrics.output_to_library_log():
      self.engine, self._stream = start_instance(
          model_dir, instance_id=0, **engine_kwargs(engine, **options)
      )
    self.busy_intervals: list[tuple[int, float, float, int]] = []
    self.num_instances = 1
    self.placement: dict = {}
    self.retired: list = []
    self.pooled = False
    self.publisher = None

  @property
  def live_instances(self) -> list[int]:
    return [0]

  @property
  def dead_instances(self) -> list:
    return []

  def helper_placement(self) -> None:
    return None  # no generation side apart from this process

  def generate(
      self, requests, sampling: Sampling, *, seed: int | None = None, assignments=None, caps=None
  ):
    """`rollout.Rollout.generate` on the one engine (with a `seed`, the
    request of prompt id p samples with seed + p; None: unseeded)."""
    if assignments is not None:
      requests = [r for part in assignments for r in part]
    cap = caps[0] if caps else None
    start, n = time.perf_counter(), 0
    try:
      for s in self._stream.generate(requests, sampling, seed=seed, max_in_flight=cap):
        n += 1
        yield s
    finally:
      self.busy_intervals.append((0, start, time.perf_counter(), n))

  def update(self, tensors, version: int) -> UpdateHandle:
    return UpdateHandle.done(version, {0: self.engine.update_weights(tensors, version)})

  def close(self) -> None:
    if self._stream is not self.engine:
      self._stream.close()
    self.engine.close()
