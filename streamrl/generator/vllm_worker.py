"""What runs inside vLLM's worker processes: the in-place weight reload.

`GeneratorInstance` (vllm_engine.py) names `WorkerExtension` as its workers'
extension class and calls `streamrl_reload` on them over `collective_rpc`
with the path of a safetensors file: each tensor handed to vLLM's loader is a
view of that file (`file_tensors`, `shared_file_tensors`), and vLLM's
expected per-reload messages are filtered out (`ReloadLogFilter`,
`PREFIX_RESET_FILTER`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence

import numpy as np

from streamrl import allocator
from streamrl.models import safetensors_io

log = logging.getLogger(__name__)


# What vLLM logs on every in-place reload that says nothing about our weights:
# (logger, message template). Hidden around our reload only; see
# ReloadLogFilter and WorkerExtension.streamrl_reload.
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_INPLACE_LOGGER = "vllm.model_executor.model_loader.reload.inplace"
_BLOCK_POOL_LOGGER = "vllm.v1.core.block_pool"
NOT_LOADED_MSG = "%s: Failed to load weights"
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


class ReloadLogFilter(logging.Filter):
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
    if record.msg == NOT_LOADED_MSG and record.args and record.args[0] in self.expected:
      self.hidden.add(str(record.args[0]))
      return False
    return record.msg not in _RELOAD_INFO_MSGS


class _DropNextPrefixReset(logging.Filter):
  """Drops the next "Successfully reset prefix cache" message after arm().

  The reset follows every reload (update_weights) as a separate engine call,
  after the reload has returned, so this cannot be a scoped filter like
  ReloadLogFilter: the reload arms it and the reset's message disarms it.
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


PREFIX_RESET_FILTER = _DropNextPrefixReset()


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


def file_tensors(path: str) -> Iterator[tuple[str, "torch.Tensor"]]:
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


def shared_file_tensors(buf, path: str) -> Iterator[tuple[str, "torch.Tensor"]]:
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
    quiet = ReloadLogFilter(layers_without_checkpoint_weights(model))
    loggers = [logging.getLogger(n) for n in (_LAYERWISE_LOGGER, _INPLACE_LOGGER)]
    for lg in loggers:
      lg.addFilter(quiet)
    try:
      if kept:  # The engine's own file, rewritten in place for each update.
        tensors = shared_file_tensors(self._kept_mapping(path), path)
      else:
        tensors = file_tensors(path)
      self.reload_weights(weights_iterator=tensors)
      del tensors  # the last reference to a copy-on-write mapping of the file
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
    logging.getLogger(_BLOCK_POOL_LOGGER).addFilter(PREFIX_RESET_FILTER)
    PREFIX_RESET_FILTER.arm()
    allocator.release_freed()  # the loader's weight-sized temporaries
    return sorted(quiet.hidden)


# Whether update_weights has said why vLLM's reload warnings are hidden.
_explained_hidden_reload_warnings = False


def explain_hidden_reload_warnings(hidden: Sequence[str]) -> None:
  """Says once per process why vLLM's reload warnings for `hidden` (the class
  names `streamrl_reload` returned) are not shown; the engine calls it after
  each reload."""
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
