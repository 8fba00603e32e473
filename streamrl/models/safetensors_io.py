"""Reading and writing safetensors files with explicit dtypes.

`safetensors.numpy` maps bfloat16 through `np.dtype("bfloat16")`, which exists
only once some other import (JAX) has registered ml_dtypes with numpy. Here
the dtype table names ml_dtypes' types itself, so a bf16 or fp16 checkpoint
loads bit-exactly whatever was imported first.

Format: 8 bytes little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the tensors' bytes (offsets relative to the end of the header).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping

import ml_dtypes
import numpy as np

from streamrl.errors import UserError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
_ALIGN = 8


def numpy_dtype(name: str | np.dtype | type) -> np.dtype:
  """ "bfloat16" / "float16" / "float32" (or a numpy dtype) -> numpy dtype."""
  if isinstance(name, str) and name in ("bfloat16", "bf16"):
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def read_header(path: str) -> tuple[dict, int]:
  """(header dict without "__metadata__", offset where the data starts)."""
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise UserError(f"{path} is too short to be a safetensors file; re-save the checkpoint.")
    (n,) = struct.unpack("<Q", raw)
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
      raise UserError(f"{path} has a corrupt safetensors header; re-save the checkpoint.") from None
  header.pop("__metadata__", None)
  return header, 8 + n


def load(path: str) -> dict[str, np.ndarray]:
  """{name: read-only array} memory-mapped from `path`, dtypes exactly as stored."""
  header, start = read_header(path)
  size = os.path.getsize(path)
  if size == start:
    return {}
  with open(path, "rb") as f:
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  out = {}
  for name, info in header.items():
    code = info["dtype"]
    if code not in DTYPES:
      raise UserError(
          f"Tensor {name!r} in {path} has dtype {code}, which StreamRL does not read; "
          f"save it as one of {sorted(DTYPES)}."
      )
    begin, end = info["data_offsets"]
    dtype, shape = DTYPES[code], tuple(info["shape"])
    if start + end > size or end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
      raise UserError(f"Tensor {name!r} in {path} is truncated; re-save the checkpoint.")
    out[name] = np.frombuffer(buf, dtype, count=int(np.prod(shape)), offset=start + begin).reshape(
        shape
    )
  return out


def header_for(specs: Iterable[tuple[str, tuple, np.dtype]], metadata: Mapping | None) -> bytes:
  """The encoded header (length prefix included) for tensors of these shapes."""
  header: dict = {"__metadata__": dict(metadata)} if metadata else {}
  offset = 0
  for name, shape, dtype in specs:
    dtype = np.dtype(dtype)
    if dtype not in CODES:
      raise UserError(f"Tensor {name!r} has dtype {dtype}; safetensors holds {sorted(DTYPES)}.")
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    header[name] = {
        "dtype": CODES[dtype],
        "shape": list(shape),
        "data_offsets": [offset, offset + nbytes],
    }
    offset += nbytes
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % _ALIGN)
  return struct.pack("<Q", len(raw)) + raw


def save(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping | None = None) -> None:
  """Writes `tensors` to `path`, one tensor at a time.

  `tensors` may be lazy (values computed on access, as `hf.HFTensors`): each
  value is requested once, written, and dropped, so at most one tensor is
  held beyond what the mapping itself keeps.
  """
  names = list(tensors)
  specs = getattr(tensors, "specs", None)
  if specs is not None:
    shapes = specs()
  else:
    shapes = {k: (np.shape(tensors[k]), np.asarray(tensors[k]).dtype) for k in names}
  with open(path, "wb") as f:
    f.write(header_for(((k, *shapes[k]) for k in names), metadata))
    for k in names:
      value = np.ascontiguousarray(tensors[k])
      if value.shape != tuple(shapes[k][0]) or value.dtype != shapes[k][1]:
        raise ValueError(f"{k}: got {value.shape} {value.dtype}, promised {shapes[k]}.")
      f.write(value.reshape(-1).view(np.uint8).data)
