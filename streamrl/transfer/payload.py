"""A version's bytes held by one node, plus which chunks are verified so far.

The same object serves three roles: the sender's published payload (its
chunks become ready as the sender writes them), a receiver's staging buffer
(filled chunk by chunk, every chunk checksummed before it counts as ready)
and a receiver's current version (kept to re-serve children and late joiners
and as the base for deltas). Servers stream chunk i as soon as it is ready,
which is what makes publishing and forwarding through a tree pipelined.

Memory: a payload is a safetensors file, so its bytes are what an engine
loads. The sender's payloads (shared memory on) and a receiver's staging buffers are POSIX
shared-memory files in /dev/shm (created through multiprocessing's
SharedMemory, so the resource tracker unlinks them if their process dies);
``VersionTensors.path`` names the file, and every engine on that host loads
that one file (``vllm_engine.WorkerExtension`` reads it zero-copy). Same-host
receivers map a sender's file read-only instead of receiving a copy. Without
/dev/shm, buffers are private memory (no path).

Lifetimes: whoever reads a file someone else may rewrite holds a ``Pin`` (a
shared ``flock`` on it, released on close or death) for as long as it needs
the bytes: a receiver for the payloads it maps, a generator from staging a
version until its engine has loaded it (by path). A writer rewrites or
unlinks a file only if no one pins it (``is_pinned``) and its own rules allow
(the sender: the version is retired, no stream reads it and every live
receiver has acked a newer one; a receiver: the version is neither current
nor in flight, no stream reads it); otherwise it takes a fresh file and keeps
the pinned one until it is free. ``close`` unlinks everything (mappings
outlive the name).

Files are recycled. On this machine (a VM without huge pages for tmpfs)
setting up the page tables of a fresh 1 GB mapping costs 0.5-2 s per
process, more than copying and checksumming the bytes, so the sender keeps a
small pool of segments, a receiver reuses its retired staging file, and every
process keeps its mappings of others' files (``SegmentPool``, ``map_shared``).
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Mapping
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

from streamrl.transfer.manifest import (
    Manifest,
    TransferError,
    header_bytes,
    plan_payload,
    read_payload,
    verify_chunk,
    write_tensors,
)

SHM_DIR = "/dev/shm"


def shm_available() -> bool:
  """The shared-memory path needs a POSIX /dev/shm (Linux)."""
  return os.path.isdir(SHM_DIR)


class VersionTensors(dict):
  """Read-only zero-copy views of one verified version, by HF name.

  path: the safetensors file in /dev/shm these bytes are (None when they are
  in private memory); an engine on this host loads that file directly. Pin
  it (``Pin``) before keeping it beyond the ``load_fn`` call.
  """

  def __init__(self, tensors: dict, path: Optional[str], version: int):
    super().__init__(tensors)
    self.path = path
    self.version = version


class Pin:
  """A shared ``flock`` on a /dev/shm file: while any is held, no writer rewrites the file.

  flock locks belong to an open file description, so a pin ends when its
  holder releases it, is collected, or dies: a crashed reader never blocks a
  writer. TransferError if the file is gone or being rewritten.
  """

  def __init__(self, path: str):
    try:
      fd = os.open(path, os.O_RDONLY)
    except OSError as e:
      raise TransferError(f"cannot pin {path}: {e}") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      raise TransferError(f"cannot pin {path}: it is being rewritten") from None
    self.path = path
    self._fd: Optional[int] = fd

  def release(self) -> None:
    fd, self._fd = self._fd, None
    if fd is not None:
      os.close(fd)

  def __del__(self):
    self.release()


def is_pinned(name: str) -> bool:
  """Whether some process holds a ``Pin`` on /dev/shm/``name`` (False if the file is gone)."""
  try:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return False
  except BlockingIOError:
    return True
  finally:
    os.close(fd)  # also drops our exclusive lock, if we got it


class Payload:
  """Bytes of one version and its verification progress (thread-safe).

  segment: the buffer this process owns (sender's payloads, receiver's
  staging); None for a mapping of someone else's file, which then holds
  ``pin`` until ``release``.
  """

  def __init__(
      self,
      manifest: Manifest,
      buf: memoryview,
      *,
      keepalive: Any = None,
      shm_name: Optional[str] = None,
      segment: Optional["Segment"] = None,
      pin: Optional[Pin] = None,
      ready: int = 0,
  ):
    if len(buf) != manifest.total_bytes:
      raise ValueError("buffer size differs from the manifest")
    self.manifest = manifest
    self.buf = buf
    self.keepalive = keepalive
    self.shm_name = shm_name
    self.segment = segment
    self.pin = pin
    self.streams = (
        0  # servers streaming from this payload now (keeps its segment from being recycled)
    )
    self.checksums: list[Optional[int]] = list(manifest.checksums) or [None] * manifest.num_chunks
    self._ready = ready
    self._error: Optional[str] = None
    self._cond = threading.Condition()
    self._tensors: Optional[VersionTensors] = None
    self.delta_cache: dict[int, list] = {}  # base version -> per-chunk (encoding, bytes|None)
    self.tag: Optional[bytes] = None  # the publisher's manifest tag, once known (with a secret)

  @property
  def version(self) -> int:
    return self.manifest.version

  @property
  def path(self) -> Optional[str]:
    """The /dev/shm file holding this payload (None for private memory)."""
    return os.path.join(SHM_DIR, self.shm_name) if self.shm_name else None

  @property
  def complete(self) -> bool:
    return self._ready == self.manifest.num_chunks

  @property
  def ready(self) -> int:
    return self._ready

  def chunk(self, i: int) -> memoryview:
    a, b = self.manifest.chunk_range(i)
    return self.buf[a:b]

  @property
  def full_manifest(self) -> Manifest:
    """The manifest with every chunk's checksum (only once complete)."""
    if not self.complete:
      raise TransferError("payload is not complete")
    return dataclasses.replace(self.manifest, checksums=tuple(self.checksums))

  def commit(self, i: int, expected: Optional[int] = None) -> None:
    """Verifies chunk i (the next one in order) against ``expected`` (default: the known checksum), marks it ready.

    ChecksumError if the bytes do not match.
    """
    if i != self._ready:
      raise TransferError(f"chunk {i} arrived out of order (expected {self._ready})")
    expected = self.checksums[i] if expected is None else expected
    if expected is None:
      raise TransferError(f"no checksum for chunk {i}")
    verify_chunk(self.buf, self.manifest, i, expected)
    self._mark(i, expected)

  def add_written(self, i: int, value: int) -> None:
    """Sender side: chunk i was just written here and checksummed (nothing to verify)."""
    if i != self._ready:
      raise TransferError(f"chunk {i} written out of order (expected {self._ready})")
    self._mark(i, value)

  def _mark(self, i: int, value: int) -> None:
    with self._cond:
      self.checksums[i] = value
      self._ready += 1
      self._cond.notify_all()

  def set_tag(self, tag: bytes) -> None:
    """The publisher's tag of the complete manifest (computed there, checked here first)."""
    with self._cond:
      self.tag = bytes(tag)
      self._cond.notify_all()

  def wait_tag(self, timeout: float) -> bytes:
    """Blocks until the tag is known; TransferError on failure or timeout."""
    with self._cond:
      if not self._cond.wait_for(lambda: self.tag is not None or self._error is not None, timeout):
        raise TransferError(f"timed out waiting for the tag of version {self.version}")
      if self.tag is None:
        raise TransferError(f"upstream transfer of version {self.version} failed: {self._error}")
      return self.tag

  def fail(self, reason: str) -> None:
    """Marks the transfer failed: everyone streaming from this payload aborts."""
    with self._cond:
      if self._error is None:
        self._error = reason
      self._cond.notify_all()

  def wait_ready(self, n: int, timeout: float) -> None:
    """Blocks until the first n chunks are verified; TransferError on failure or timeout."""
    with self._cond:
      if not self._cond.wait_for(lambda: self._ready >= n or self._error is not None, timeout):
        raise TransferError(f"timed out waiting for chunk {n - 1} of version {self.version}")
      if self._ready < n:
        raise TransferError(f"upstream transfer of version {self.version} failed: {self._error}")

  def tensors(self) -> VersionTensors:
    """Read-only zero-copy views and the file's path (only once complete)."""
    if not self.complete:
      raise TransferError("payload is not complete")
    if self._tensors is None:
      self._tensors = VersionTensors(read_payload(self.buf, self.manifest), self.path, self.version)
    return self._tensors

  def open_stream(self) -> None:
    with self._cond:
      self.streams += 1

  def close_stream(self) -> None:
    with self._cond:
      self.streams -= 1

  def release(self) -> None:
    """This process no longer needs a mapped payload's bytes: drops its pin."""
    if self.pin is not None:
      self.pin.release()

  @property
  def failed(self) -> bool:
    return self._error is not None


def _mmap(name: str, size: int, writable: bool) -> mmap.mmap:
  # MAP_POPULATE: build the page tables in one go instead of one fault per 4 KiB page.
  flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
  fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR if writable else os.O_RDONLY)
  try:
    if os.fstat(fd).st_size < size:
      raise TransferError(f"shared-memory segment {name} is smaller than the payload")
    return mmap.mmap(
        fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    )
  finally:
    os.close(fd)


@dataclasses.dataclass
class Segment:
  """A buffer this process owns: a shared-memory file (``shm`` set: its name, for crash cleanup,
  and our writable mapping) or private memory (``shm`` None). payload: the version it holds (None
  while free).
  """

  buf: memoryview
  shm: Optional[shared_memory.SharedMemory] = None
  keepalive: Any = None
  payload: Optional[Payload] = None

  @property
  def name(self) -> Optional[str]:
    return self.shm.name if self.shm is not None else None

  def pinned(self) -> bool:
    """Someone reads this file and it must not be rewritten (see ``Pin``)."""
    return self.shm is not None and is_pinned(self.shm.name)

  def unlink(self) -> None:
    """Removes the file's name (mappings, ours included, stay valid until dropped)."""
    if self.shm is not None:
      try:
        self.shm.unlink()
      except FileNotFoundError:
        pass


def create_segment(size: int, shared: bool = True) -> Segment:
  """A new writable buffer of ``size`` bytes with its pages already mapped.

  Shared: created through SharedMemory (so the resource tracker unlinks it if
  this process dies) but mapped with our own mmap: SharedMemory.close()
  raises while numpy views exist, a plain mmap just lives as long as its views.
  """
  if not shared:
    arr = np.empty(size, np.uint8)
    return Segment(memoryview(arr), keepalive=arr)
  shm = shared_memory.SharedMemory(
      name=f"srl_{os.getpid()}_{secrets.token_hex(6)}", create=True, size=max(size, 1)
  )
  shm.close()
  m = _mmap(shm.name, size, writable=True)
  return Segment(memoryview(m)[:size], shm=shm, keepalive=m)


class WeightsFile:
  """One set of weights written once, tensor by tensor, into a new safetensors file in /dev/shm.

  For weights handed to generators without the transfer service: the engines
  of this host load ``path`` (``vllm_engine.GeneratorInstance.update_weights_from_file``).
  ``tensors`` may be lazy (``models.hf.HFTensors``): each is read once and
  copied straight into the file, in payload layout (every tensor aligned to
  its itemsize). ``unlink`` removes the file (the resource tracker does if
  this process dies); readers that still map it keep their mapping.
  ``nbytes``: the file's size, i.e. the bytes copied to write it.

  ``WeightsFile.empty(manifest)`` lays out the file with its header only, for
  writers that fill the tensors' bytes themselves (several trainer processes,
  each writing the ranges it holds: ``streamrl.trainer.multihost``; they open
  it with ``open_weights_file``).
  """

  def __init__(self, tensors: Mapping[str, np.ndarray] | None, manifest: Manifest | None = None):
    if not shm_available():
      raise RuntimeError(f"weights files need {SHM_DIR} (Linux shared memory); none was found.")
    self.manifest = manifest if manifest is not None else plan_payload(tensors, 0, 4 << 20)
    self._segment = create_segment(self.manifest.total_bytes, shared=True)
    try:
      if tensors is None:
        header = header_bytes(self.manifest)
        self._segment.buf[: len(header)] = header
      else:
        for _ in write_tensors(tensors, self.manifest, self._segment.buf):
          pass
    except BaseException:
      self._segment.unlink()
      raise

  @classmethod
  def empty(cls, manifest: Manifest) -> "WeightsFile":
    """A file laid out for ``manifest`` with only its header written."""
    return cls(None, manifest)

  @property
  def name(self) -> str:
    return self._segment.name

  @property
  def path(self) -> str:
    return os.path.join(SHM_DIR, self._segment.name)

  @property
  def buf(self) -> memoryview:
    """The file's bytes, writable."""
    return self._segment.buf

  @property
  def segment(self) -> Segment:
    """The buffer behind the file (a transfer ``Publisher`` adopts it as a version's payload)."""
    return self._segment

  @property
  def nbytes(self) -> int:
    return self.manifest.total_bytes

  def tensors(self) -> dict[str, np.ndarray]:
    """Zero-copy read-only views of the file's tensors."""
    return read_payload(self._segment.buf, self.manifest)

  def rewrite(self, tensors: Mapping[str, np.ndarray]) -> bool:
    """Writes `tensors` over this file's bytes, in place, when they have its
    layout (same names, shapes and dtypes); False (nothing written) if not.
    Readers must not be reading it meanwhile (an engine reloads only between
    updates)."""
    manifest = plan_payload(tensors, 0, self.manifest.chunk_bytes)
    if manifest.tensors != self.manifest.tensors:
      return False
    for _ in write_tensors(tensors, self.manifest, self._segment.buf):
      pass
    return True

  def unlink(self) -> None:
    self._segment.unlink()


def open_weights_file(name: str, size: int) -> memoryview:
  """A writable mapping of another process's ``WeightsFile`` (by its ``name``) on this host."""
  return memoryview(_mmap(name, size, writable=True))[:size]


def staging_payload(manifest: Manifest, segment: Segment) -> Payload:
  """A receiver's staging payload in a buffer it owns (a fresh one or its retired one)."""
  segment.payload = Payload(
      manifest,
      segment.buf[: manifest.total_bytes],
      keepalive=segment.keepalive,
      shm_name=segment.name,
      segment=segment,
  )
  return segment.payload


class SegmentPool:
  """The sender's buffers, recycled under the safety rule in the module docstring.

  Steady state: ``min_segments`` buffers (the versions still served plus the
  one being written) take turns. A receiver that lags or pins keeps its
  segment from being rewritten, so new ones are made; the pool then forgets
  (unlinks) the oldest unpinned ones beyond ``max_segments``; a receiver still
  mapping one keeps its memory until it lets go. ``shared=False`` (shared
  memory off, or no /dev/shm): private buffers, recycled for the same reason:
  first-touching fresh memory is slow.
  """

  def __init__(self, min_segments: int, max_segments: int, shared: bool = True):
    self.min_segments, self.max_segments = min_segments, max(max_segments, min_segments)
    self.shared = shared
    self._segments: list[Segment] = []
    self._lock = threading.Lock()

  @staticmethod
  def _age(seg: Segment) -> int:
    return seg.payload.version if seg.payload is not None else -1

  def acquire(
      self, size: int, reusable: Callable[["Payload"], bool]
  ) -> tuple[Segment, Optional[Payload]]:
    """A buffer for a new version and the payload it held: the newest buffer for
    which ``reusable(its payload)`` holds and no reader pins, else a new one (and None)."""
    with self._lock:
      free = [
          s
          for s in self._segments
          if len(s.buf) == size and (s.payload is None or reusable(s.payload)) and not s.pinned()
      ]
      if free:
        chosen = max(free, key=self._age)
        for extra in sorted(free, key=self._age):  # idle extras left by a laggard: let them go
          if extra is not chosen and len(self._segments) > self.min_segments:
            self._segments.remove(extra)
            extra.unlink()
        old, chosen.payload = chosen.payload, None
        return chosen, old
    seg = create_segment(size, self.shared)
    self.adopt(seg)
    return seg, None

  def adopt(self, seg: Segment) -> None:
    """Takes a buffer written elsewhere (a ``WeightsFile``) into the pool."""
    with self._lock:
      self._segments.append(seg)
      while len(self._segments) > self.max_segments:  # forget the oldest other unpinned buffer
        idle = [s for s in self._segments if s is not seg and not s.pinned()]
        if not idle:
          break
        old = min(idle, key=self._age)
        self._segments.remove(old)
        old.unlink()

  def close(self) -> None:
    with self._lock:
      for seg in self._segments:
        seg.unlink()
      self._segments.clear()


_MAPS: "collections.OrderedDict[str, mmap.mmap]" = collections.OrderedDict()
_MAPS_LOCK = threading.Lock()
MAX_CACHED_MAPS = 4


def map_shared(name: str, manifest: Manifest) -> Payload:
  """A read-only view of another node's file on this host, pinned until ``release``.

  This process keeps the mapping for later versions. Nothing is verified
  yet: commit each chunk.
  """
  if "/" in name or name.startswith(".") or not name:
    raise TransferError(f"bad shared-memory name {name!r}")
  pin = Pin(os.path.join(SHM_DIR, name))
  with _MAPS_LOCK:
    m = _MAPS.get(name)
    if m is not None and len(m) >= manifest.total_bytes:
      _MAPS.move_to_end(name)
    else:
      try:
        m = _mmap(name, manifest.total_bytes, writable=False)
      except (FileNotFoundError, ValueError, OSError) as e:
        pin.release()
        raise TransferError(f"cannot map shared-memory segment {name}: {e}") from None
      _MAPS[name] = m
      while len(_MAPS) > MAX_CACHED_MAPS:
        _MAPS.popitem(last=False)  # unmapped once no payload view uses it
  return Payload(
      manifest, memoryview(m)[: manifest.total_bytes], keepalive=m, shm_name=name, pin=pin
  )
