"""Where generation runs: in this process (colocated) or on Ray actors.

Both backends offer the same small surface as `StreamGenerationService`:
`generate(requests, sampling, assignments=None, caps=None)` streaming
Samples, `update(tensors, version)`, `start_update(...)` returning something
with `wait()`, `close()`.
"""

from __future__ import annotations

import logging
import time

from streamrl.generator.vllm_engine import GeneratorInstance, SamplingConfig

log = logging.getLogger(__name__)


def make_engine(config, model_dir: str, instance_id: int = 0) -> GeneratorInstance:
  g = config.generation
  return GeneratorInstance(model_dir, instance_id=instance_id, max_num_seqs=g.max_num_seqs,
                           max_model_len=g.max_model_len, seed=config.seed,
                           kv_cache_gib=g.kv_cache_gib, dtype=config.model.dtype)


def sampling_for(config, iteration: int) -> SamplingConfig:
  g = config.generation
  # A fresh seed per iteration; each request adds its id to it.
  return SamplingConfig(temperature=g.temperature, top_p=g.top_p, max_tokens=g.max_tokens,
                        seed=config.seed * 1_000_003 + iteration * 100_003)


class _Done:
  """An update that already happened (the local engine loads synchronously)."""

  def delivered(self, timeout_s=None):
    return None

  def wait(self, timeout_s=None):
    return None


class LocalBackend:
  """One engine in the trainer's process: generation and training take turns."""

  def __init__(self, config, model_dir: str):
    self.engine = make_engine(config, model_dir)
    self.busy_intervals: list[tuple[int, float, float, int]] = []
    self.dead_instances: list = []
    self.num_instances = 1

  def generate(self, requests, sampling, *, assignments=None, caps=None):
    if assignments is not None:
      requests = [r for part in assignments for r in part]
    cap = caps[0] if caps else None
    start, n = time.perf_counter(), 0
    try:
      for s in self.engine.generate(requests, sampling, max_in_flight=cap):
        n += 1
        yield s
    finally:
      self.busy_intervals.append((0, start, time.perf_counter(), n))

  def update(self, tensors, version: int) -> dict[int, int]:
    return {0: self.engine.update_weights(tensors, version)}

  def start_update(self, tensors, version: int) -> _Done:
    self.update(tensors, version)
    return _Done()

  def close(self) -> None:
    self.engine.close()


def make_backend(config, model_dir: str, cluster_info=None):
  if config.pipeline.mode == "colocated":
    return LocalBackend(config, model_dir)
  from streamrl.generator.service import StreamGenerationService  # pylint: disable=g-import-not-at-top
  from streamrl import cluster  # pylint: disable=g-import-not-at-top
  info = cluster_info or cluster.init_ray_from_config(config)
  return StreamGenerationService(config, model_dir, cluster=info)
