"""The generators' settings: how they sample (`sampling.*`) and the vLLM
engines that run (`engine.*`)."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import need, positive


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the generators sample (the trainer scores at the same temperature)."""

  temperature: float = 1.0
  top_p: float = 1.0
  max_tokens: int = 56

  def check(self) -> None:
    need(self.temperature >= 0, f"sampling.temperature={self.temperature} must be >= 0.")
    need(0 < self.top_p <= 1, f"sampling.top_p={self.top_p} must be in (0, 1].")
    positive("sampling.max_tokens", self.max_tokens)


@dataclasses.dataclass(frozen=True)
class Engine:
  """One vLLM engine (generator instance) and how many of them run."""

  max_num_seqs: int = 128
  max_model_len: int = 128
  kv_cache_gib: float = 1.0
  num_instances: int = 1
  # Ray generators: samples finishing within this many seconds travel to the
  # trainer as one object (0: one object per sample).
  coalesce_s: float = 0.02
  # CPU engines: run vLLM's engine core inside the actor's process (fast
  # start, every thread pinned) rather than as a child process. GPU engines
  # always keep vLLM's engine-core process.
  in_process: bool = True
  # GPUs each Ray generator instance asks Ray for (0: a CPU engine, pinned
  # to its own cores); the engine shards over them with tensor parallelism.
  gpus_per_instance: int = 0
  tensor_parallel_size: int = 1
  # GPU engines: the fraction of GPU memory vLLM takes for weights + KV cache
  # (CPU engines size their KV cache by kv_cache_gib instead).
  gpu_memory_utilization: float = 0.85
  # GPU engines capture CUDA graphs unless True; CPU engines always run eager.
  enforce_eager: bool = False
  # Weights handed to an engine directly (colocated, or Ray's object store):
  # keep its /dev/shm weights file and rewrite it in place for each update
  # (faster updates, one more copy of the weights in RAM), or write a new
  # file per update and remove it after the load.
  keep_weights_file: bool = True

  def check(self) -> None:
    positive("engine.max_model_len", self.max_model_len)
    positive("engine.max_num_seqs", self.max_num_seqs)
    positive("engine.kv_cache_gib", self.kv_cache_gib)
    need(
        self.num_instances >= 1,
        f"engine.num_instances={self.num_instances} must be >= 1 (one vLLM engine at least).",
    )
    positive("engine.coalesce_s", self.coalesce_s, zero_ok=True)
    positive("engine.gpus_per_instance", self.gpus_per_instance, zero_ok=True)
    positive("engine.tensor_parallel_size", self.tensor_parallel_size)
    need(
        self.gpus_per_instance == 0 or self.tensor_parallel_size == self.gpus_per_instance,
        f"engine.tensor_parallel_size={self.tensor_parallel_size} must equal "
        f"engine.gpus_per_instance={self.gpus_per_instance} (one engine shards over all its "
        f"GPUs); set tensor_parallel_size={self.gpus_per_instance}.",
    )
    need(
        0 < self.gpu_memory_utilization <= 1,
        f"engine.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1].",
    )
