"""One weight version as bytes: a safetensors file cut into checksummed chunks.

Format choices (and why):

- **The payload is a standard safetensors file** (8-byte little-endian header
  length, JSON header, raw little-endian tensor data). Nothing that crosses a
  process or network boundary is pickled, and any safetensors reader can
  inspect a captured payload. We lay the file out and parse it here rather
  than calling ``safetensors.numpy.save/load`` because ``save`` returns a new
  ``bytes`` object that would be copied once more into the shared-memory
  segment, ``load`` copies every tensor and cannot read ``BF16`` into numpy,
  and the receiver wants zero-copy read-only views of a verified buffer.
  ``tests/transfer/test_manifest.py`` checks both directions of compatibility
  with the library.
- **Layout**: tensors sorted by itemsize (largest first) then name, so every
  tensor starts at a multiple of its itemsize (aligned views) and one schema
  always gives the same byte layout, which delta transfer relies on.
- **Checksum**: XXH3-64 (``xxhash``) per chunk, one pass over the bytes.
  zlib.crc32 is slower than a memcpy of the same bytes, so its checksum
  passes cost more than the copy; XXH3 uses the CPU's vector units and
  costs a fraction of the copy (rates: experiments/RESULTS.md,
  bench_transfer.py). (``google-crc32c``'s binding accepts only ``bytes``, i.e. one more
  copy per chunk, so it was not used.) A 64-bit checksum catches transport
  and memory faults (random damage passes with probability 2^-64 per chunk);
  it is not a defence against a malicious peer, which needs an authenticated
  channel.
- **Digest**: BLAKE3-256 (``blake3``) per chunk, cryptographic, for bytes that left the host:
  the publisher signs a manifest that lists every chunk's digest (security.py) and a TCP
  receiver hashes every chunk it receives. BLAKE3 is the fastest of the cryptographic hashes
  tried (SHA-256 and BLAKE2b are several times slower), within a factor of two of a memcpy,
  so the digest costs about one more copy, and only where bytes crossed a socket: the same-host
  (shared-memory) path verifies XXH3 only, and the publisher hashes a chunk only when a TCP
  stream first sends it.
- **Chunks** (default 4 MiB, ``Transfer.chunk_bytes``): large enough that
  per-chunk Python overhead is negligible (~250 chunks per GB), small enough to
  stay in cache between copy and checksum (copy + XXH3 is faster with 4 MiB chunks
  than with 64 MiB: experiments/RESULTS.md) and to make pipelined forwarding
  through a tree add only one chunk of latency per hop.
- **Manifest** (JSON): version, tensor specs in layout order, total bytes,
  chunk size. It travels ahead of the data so a receiver can refuse a wrong
  schema before downloading anything. Each chunk's checksum travels in that
  chunk's frame: the sender computes it right after writing the chunk, so
  receivers can start verifying (and forwarding) chunk 0 while the sender is
  still copying chunk 1 (``fill_payload`` yields one checksum per chunk). A
  complete payload's manifest carries the list (``Manifest.checksums``).
- **Streaming**: the tensors may be a lazy mapping (``models.hf.HFTensors``:
  each read converts one parameter); its ``specs()`` plan the layout without
  reading anything and ``fill_payload`` reads every tensor exactly once,
  straight into the payload, so publishing never holds a second copy of the
  model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

import blake3
import ml_dtypes
import numpy as np
import xxhash

# safetensors dtype codes <-> numpy dtypes (little-endian).
_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}
_CODES: dict[np.dtype, str] = {v: k for k, v in _DTYPES.items()}
_U64 = struct.Struct("<Q")
MAX_HEADER_BYTES = 100 << 20  # same bound the safetensors library applies
# Largest payload (and so largest dimension) a manifest may describe: far beyond any model,
# and small enough that every size and offset fits numpy's int64.
MAX_PAYLOAD_BYTES = 1 << 50


class TransferError(RuntimeError):
  """A transfer failed (bad bytes, broken stream); the receiver keeps its old version."""


class ChecksumError(TransferError):
  """A chunk's bytes do not match the manifest's checksum."""


class SchemaMismatch(ValueError):
  """A version's tensor names/shapes/dtypes do not match the model."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """Name, shape and safetensors dtype code (e.g. ``"BF16"``) of one tensor."""

  name: str
  shape: tuple[int, ...]
  dtype: str

  @property
  def itemsize(self) -> int:
    return _DTYPES[self.dtype].itemsize

  @property
  def nbytes(self) -> int:
    # Python ints: np.prod in int64 wraps ([2**32, 2**32] -> 0 bytes) or overflows.
    return math.prod(self.shape) * self.itemsize


Schema = tuple[TensorSpec, ...]
SchemaLike = Union[Sequence[TensorSpec], Mapping[str, Any]]


def dtype_code(dtype: Any) -> str:
  """safetensors code of a numpy dtype; ValueError naming the supported ones."""
  dt = np.dtype(dtype)
  if dt.byteorder == ">":
    dt = dt.newbyteorder("<")
  code = _CODES.get(dt)
  if code is None:
    raise ValueError(
        f"dtype {dt} cannot be transferred; convert the tensor to one of "
        f"{sorted(_DTYPES)} (numpy names or ml_dtypes.bfloat16)."
    )
  return code


def numpy_dtype(code: str) -> np.dtype:
  """numpy dtype of a safetensors code."""
  try:
    return _DTYPES[code]
  except KeyError:
    raise TransferError(f"unknown safetensors dtype code {code!r}") from None


def checksum(data: Any) -> int:
  """XXH3-64 of a bytes-like object (any contiguous buffer), as an unsigned int."""
  return xxhash.xxh3_64_intdigest(data)


DIGEST_BYTES = 32


def digest(data: Any) -> bytes:
  """BLAKE3-256 of a bytes-like object: a chunk's cryptographic digest (signed by the publisher)."""
  return blake3.blake3(data).digest()


def schema_of(tensors: Mapping[str, np.ndarray]) -> Schema:
  """Specs of a dict of arrays, sorted by name.

  A lazy mapping that has ``specs()`` (``{name: (shape, dtype)}``, as
  ``models.hf.HFTensors``) is described from those, without reading a tensor.
  """
  specs = getattr(tensors, "specs", None)
  if callable(specs):
    return as_schema(specs())
  return tuple(
      TensorSpec(name, tuple(int(d) for d in np.shape(t)), dtype_code(np.asarray(t).dtype))
      for name, t in sorted(tensors.items())
  )


def as_schema(schema: SchemaLike) -> Schema:
  """Accepts TensorSpecs or ``{name: (shape, dtype)}`` / ``{name: array}``; returns sorted specs."""
  if isinstance(schema, Mapping):
    specs = []
    for name, value in schema.items():
      if isinstance(value, TensorSpec):
        specs.append(value)
      elif hasattr(value, "shape") and hasattr(value, "dtype"):
        specs.append(TensorSpec(name, tuple(int(d) for d in value.shape), dtype_code(value.dtype)))
      else:
        shape, dtype = value
        code = dtype if isinstance(dtype, str) and dtype in _DTYPES else dtype_code(dtype)
        specs.append(TensorSpec(name, tuple(int(d) for d in shape), code))
    return tuple(sorted(specs, key=lambda s: s.name))
  return tuple(sorted(schema, key=lambda s: s.name))


def check_schema(got: Sequence[TensorSpec], expected: SchemaLike, version: int) -> None:
  """Raises SchemaMismatch naming the first (by name) parameter that differs.

  got: the specs a version carries. expected: the model's specs.
  """
  have = {s.name: s for s in got}
  want = as_schema(expected)
  fix = "publish tensors converted for this model's configuration."
  for spec in want:
    g = have.get(spec.name)
    if g is None:
      raise SchemaMismatch(
          f"Refusing weight version {version}: parameter {spec.name!r} is missing; {fix}"
      )
    if g.shape != spec.shape:
      raise SchemaMismatch(
          f"Refusing weight version {version}: parameter {spec.name!r} has shape "
          f"{g.shape} but the model expects {spec.shape}; {fix}"
      )
    if g.dtype != spec.dtype:
      raise SchemaMismatch(
          f"Refusing weight version {version}: parameter {spec.name!r} has dtype "
          f"{g.dtype} but the model expects {spec.dtype}; {fix}"
      )
  extra = sorted(set(have) - {s.name for s in want})
  if extra:
    raise SchemaMismatch(
        f"Refusing weight version {version}: parameter {extra[0]!r} is not a "
        f"parameter of this model; {fix}"
    )


@dataclasses.dataclass(frozen=True)
class Manifest:
  """Describes one version's payload.

  tensors: specs in layout order. checksums[i]: ``checksum`` of bytes
  [i * chunk_bytes, min((i + 1) * chunk_bytes, total_bytes)); empty while
  the payload is still being written (they then come with the chunks).
  digests[i]: ``digest`` of the same bytes, where known (the manifest signed for TCP edges).
  """

  version: int
  tensors: Schema
  total_bytes: int
  chunk_bytes: int
  checksums: tuple[int, ...] = ()
  digests: tuple[bytes, ...] = ()

  @property
  def num_chunks(self) -> int:
    return -(-self.total_bytes // self.chunk_bytes)

  def without_checksums(self) -> "Manifest":
    return dataclasses.replace(self, checksums=(), digests=())

  def chunk_range(self, i: int) -> tuple[int, int]:
    start = i * self.chunk_bytes
    return start, min(start + self.chunk_bytes, self.total_bytes)

  @property
  def layout(self) -> tuple:
    """Equal layouts <=> chunk i of both versions holds the same bytes' roles (delta-compatible)."""
    return (self.tensors, self.total_bytes, self.chunk_bytes)

  @property
  def word_bytes(self) -> int:
    """Smallest itemsize: every chunk is a whole number of such words (delta byte-shuffle unit)."""
    return min((s.itemsize for s in self.tensors), default=1)

  def to_json(self) -> dict:
    d = {
        "version": self.version,
        "total_bytes": self.total_bytes,
        "chunk_bytes": self.chunk_bytes,
        "tensors": [[s.name, list(s.shape), s.dtype] for s in self.tensors],
    }
    if self.checksums:
      d["checksums"] = list(self.checksums)
    if self.digests:
      d["digests"] = [x.hex() for x in self.digests]
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "Manifest":
    """Validates a manifest that came from the network; TransferError if malformed."""
    try:
      tensors = tuple(
          TensorSpec(str(n), tuple(int(x) for x in shape), str(dt)) for n, shape, dt in d["tensors"]
      )
      chunk_bytes = int(d["chunk_bytes"])
      if chunk_bytes <= 0 or chunk_bytes % 8:
        raise ValueError("chunk size must be a positive multiple of 8")
      m = cls(
          int(d["version"]),
          tensors,
          int(d["total_bytes"]),
          chunk_bytes,
          tuple(int(c) for c in d.get("checksums", ())),
          tuple(bytes.fromhex(x) for x in d.get("digests", ())),
      )
    except (KeyError, TypeError, ValueError) as e:
      raise TransferError(f"malformed manifest: {e!r}") from None
    for s in m.tensors:
      numpy_dtype(s.dtype)
      if any(x < 0 for x in s.shape):
        raise TransferError(f"malformed manifest: negative shape for {s.name!r}")
      if any(x > MAX_PAYLOAD_BYTES for x in s.shape):
        raise TransferError(f"malformed manifest: shape of {s.name!r} is out of range")
    if m.total_bytes > MAX_PAYLOAD_BYTES:
      raise TransferError(f"malformed manifest: {m.total_bytes} bytes is out of range")
    if m.checksums and len(m.checksums) != m.num_chunks:
      raise TransferError("malformed manifest: chunk table does not cover the payload")
    if m.digests and (
        len(m.digests) != m.num_chunks or any(len(x) != DIGEST_BYTES for x in m.digests)
    ):
      raise TransferError("malformed manifest: digest table does not cover the payload")
    data = sum(t.nbytes for t in m.tensors)
    if not 8 + data <= m.total_bytes <= 8 + data + MAX_HEADER_BYTES:  # also bounds what we allocate
      raise TransferError("malformed manifest: payload size does not match its tensors")
    return m


def _header(specs: Sequence[TensorSpec]) -> bytes:
  pos, entries = 0, {}
  for s in specs:
    entries[s.name] = {
        "dtype": s.dtype,
        "shape": list(s.shape),
        "data_offsets": [pos, pos + s.nbytes],
    }
    pos += s.nbytes
  raw = json.dumps(entries, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # like safetensors: data starts 8-byte aligned
  return _U64.pack(len(raw)) + raw


def header_bytes(manifest: Manifest) -> bytes:
  """The safetensors header that starts ``manifest``'s payload."""
  return _header(manifest.tensors)


def tensor_offsets(manifest: Manifest) -> dict[str, int]:
  """{name: offset of its first byte in the payload}."""
  pos, out = len(_header(manifest.tensors)), {}
  for s in manifest.tensors:
    out[s.name] = pos
    pos += s.nbytes
  return out


def layout_order(tensors: Mapping[str, np.ndarray]) -> Schema:
  """Specs in payload order: itemsize descending, then name."""
  return tuple(sorted(schema_of(tensors), key=lambda s: (-s.itemsize, s.name)))


def payload_nbytes(schema: SchemaLike) -> int:
  """Bytes of the payload of a version with this schema (what a receiver must hold)."""
  specs = tuple(sorted(as_schema(schema), key=lambda s: (-s.itemsize, s.name)))
  return len(_header(specs)) + sum(s.nbytes for s in specs)


def payload_size(tensors: Mapping[str, np.ndarray]) -> int:
  """Bytes of the safetensors payload of these tensors."""
  specs = layout_order(tensors)
  return len(_header(specs)) + sum(s.nbytes for s in specs)


def plan_payload(tensors: Mapping[str, np.ndarray], version: int, chunk_bytes: int) -> Manifest:
  """Manifest (without checksums) of the payload these tensors make; validates dtypes."""
  if chunk_bytes <= 0 or chunk_bytes % 8:
    raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of 8.")
  specs = layout_order(tensors)
  return Manifest(version, specs, len(_header(specs)) + sum(s.nbytes for s in specs), chunk_bytes)


def write_tensors(
    tensors: Mapping[str, np.ndarray], manifest: Manifest, out: memoryview
) -> Iterator[int]:
  """Writes the safetensors payload into ``out``; yields how many bytes are written after each piece.

  Reads every tensor once, in layout order (a lazy mapping thus converts one
  parameter at a time), and copies it straight to its offset in pieces that
  end at chunk boundaries.
  """
  header = _header(manifest.tensors)
  if len(out) != manifest.total_bytes or manifest.total_bytes != len(header) + sum(
      s.nbytes for s in manifest.tensors
  ):
    raise ValueError(f"output buffer has {len(out)} bytes, payload needs {manifest.total_bytes}.")
  dst = np.frombuffer(out, np.uint8)
  step = manifest.chunk_bytes
  pos = 0

  def write(src: np.ndarray) -> Iterator[int]:
    nonlocal pos
    off = 0
    while off < src.size:
      n = min(src.size - off, (pos // step + 1) * step - pos)
      np.copyto(dst[pos : pos + n], src[off : off + n])
      pos, off = pos + n, off + n
      yield pos

  yield from write(np.frombuffer(header, np.uint8))
  for s in manifest.tensors:
    arr = np.asarray(tensors[s.name])
    if arr.shape != s.shape or arr.dtype != _DTYPES[s.dtype]:
      raise ValueError(
          f"tensor {s.name!r} is {arr.shape} {arr.dtype}, its spec says {s.shape} {s.dtype}; "
          "the tensors changed while being published."
      )
    yield from write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def fill_payload(
    tensors: Mapping[str, np.ndarray], manifest: Manifest, out: memoryview
) -> Iterator[int]:
  """Writes the payload into ``out`` (``write_tensors``); yields each chunk's checksum as soon as
  the chunk is written, while it is still in cache. Once the generator is exhausted the caller
  may change its tensors (the payload is a snapshot)."""
  step, done = manifest.chunk_bytes, 0  # done: chunks whose checksum was yielded
  for pos in write_tensors(tensors, manifest, out):
    while (done + 1) * step <= pos:
      yield checksum(out[done * step : (done + 1) * step])
      done += 1
  if done < manifest.num_chunks:
    yield checksum(out[done * step : manifest.total_bytes])


def write_payload(
    tensors: Mapping[str, np.ndarray], out: memoryview, version: int, chunk_bytes: int
) -> Manifest:
  """Writes the whole payload into ``out`` (exactly ``payload_size`` bytes); returns the manifest with checksums."""
  m = plan_payload(tensors, version, chunk_bytes)
  return dataclasses.replace(m, checksums=tuple(fill_payload(tensors, m, out)))


def verify_chunk(
    buf: memoryview, manifest: Manifest, i: int, expected: Optional[int] = None
) -> int:
  """Checks chunk i of ``buf`` against ``expected`` (default: the manifest's); ChecksumError if it differs."""
  expected = manifest.checksums[i] if expected is None else expected
  a, b = manifest.chunk_range(i)
  got = checksum(buf[a:b])
  if got != expected:
    # Which chunk, never its digest: the message goes to peers (nacks, error frames), and the
    # XXH3 of a small chunk gives its bytes away (a peer could have named a file to checksum).
    raise ChecksumError(
        f"chunk {i} of version {manifest.version} is corrupted (its checksum does not match)"
    )
  return got


def read_payload(buf: memoryview, manifest: Manifest) -> dict[str, np.ndarray]:
  """Zero-copy read-only views of the tensors of a verified payload.

  Checks that the embedded safetensors header agrees with the manifest (names,
  shapes, dtypes, contiguous in-bounds offsets); TransferError otherwise.
  """
  if len(buf) != manifest.total_bytes or len(buf) < 8:
    raise TransferError("payload size does not match its manifest")
  (n,) = _U64.unpack(buf[:8])
  if n > min(MAX_HEADER_BYTES, len(buf) - 8):
    raise TransferError("safetensors header length is out of bounds")
  try:
    header = json.loads(bytes(buf[8 : 8 + n]))
  except ValueError:
    raise TransferError("safetensors header is not valid JSON") from None
  header.pop("__metadata__", None)
  base = 8 + n
  out, pos = {}, 0
  if set(header) != {s.name for s in manifest.tensors}:
    raise TransferError("safetensors header names differ from the manifest")
  for s in manifest.tensors:
    e = header[s.name]
    if (
        not isinstance(e, dict)
        or e.get("dtype") != s.dtype
        or tuple(e.get("shape", ())) != s.shape
        or list(e.get("data_offsets", ())) != [pos, pos + s.nbytes]
    ):
      raise TransferError(f"safetensors header entry {s.name!r} differs from the manifest")
    dt = _DTYPES[s.dtype]
    if s.nbytes:
      arr = np.frombuffer(buf, dtype=dt, count=s.nbytes // dt.itemsize, offset=base + pos).reshape(
          s.shape
      )
    else:
      arr = np.empty(s.shape, dt)
    arr.flags.writeable = False
    out[s.name] = arr
    pos += s.nbytes
  if base + pos != len(buf):
    raise TransferError("safetensors data does not fill the payload exactly")
  return out


def describe_payload(buf: memoryview, version: int, chunk_bytes: int) -> Manifest:
  """Manifest of an existing safetensors file (e.g. one written by the safetensors library)."""
  (n,) = _U64.unpack(buf[:8])
  header = json.loads(bytes(buf[8 : 8 + n]))
  header.pop("__metadata__", None)
  entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
  specs = tuple(TensorSpec(k, tuple(e["shape"]), e["dtype"]) for k, e in entries)
  sums = tuple(checksum(buf[i : i + chunk_bytes]) for i in range(0, len(buf), chunk_bytes))
  m = Manifest(version, specs, len(buf), chunk_bytes, sums)
  read_payload(buf, m)  # validates offsets
  return m
