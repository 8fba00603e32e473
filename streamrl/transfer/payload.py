"""A version's bytes held by one node, plus which chunks are verified so far.

The same object serves three roles: the sender's published payload (its
chunks become ready as the sender writes them), a receiver's staging buffer
(filled chunk by chunk, every chunk checksummed before it counts as ready)
and a receiver's current version (kept to re-serve children and late joiners
and as the base for deltas). Servers stream chunk i as soon as it is ready,
which is what makes publishing and forwarding through a tree pipelined.

Memory: private buffers are ``np.empty``. Shared-memory payloads live in
POSIX segments in /dev/shm, created by the sender (registered with
multiprocessing's resource tracker, so a crashed sender does not leak them)
and mapped read-only by same-host receivers.

Segments are recycled. On this machine (a VM without huge pages for tmpfs)
setting up the page tables of a fresh 1 GB mapping costs 0.5-2 s per
process, more than copying and checksumming the bytes, so the sender keeps a
small pool of segments and every process keeps its mappings
(``SegmentPool``, ``map_shared``); private staging buffers are recycled
too (first-touching fresh memory is nearly as slow). A segment is rewritten only when it holds
a version that is retired (not among the versions the sender serves), that
no stream is reading, and that every live receiver has moved past (acked a
newer version); otherwise the sender takes a fresh segment. So a chunk a
receiver verified cannot change while any receiver may still use it.
"""

from __future__ import annotations

import collections
import dataclasses
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

from streamrl.transfer.manifest import Manifest, TransferError, read_payload, verify_chunk

SHM_DIR = "/dev/shm"


def shm_available() -> bool:
  """The shared-memory path needs a POSIX /dev/shm (Linux)."""
  return os.path.isdir(SHM_DIR)


class Payload:
  """Bytes of one version and its verification progress (thread-safe)."""

  def __init__(
      self,
      manifest: Manifest,
      buf: memoryview,
      *,
      keepalive: Any = None,
      shm_name: Optional[str] = None,
      ready: int = 0,
  ):
    if len(buf) != manifest.total_bytes:
      raise ValueError("buffer size differs from the manifest")
    self.manifest = manifest
    self.buf = buf
    self.keepalive = keepalive
    self.shm_name = shm_name
    self.streams = (
        0  # servers streaming from this payload now (keeps its segment from being recycled)
    )
    self.crcs: list[Optional[int]] = list(manifest.crcs) or [None] * manifest.num_chunks
    self._ready = ready
    self._error: Optional[str] = None
    self._cond = threading.Condition()
    self._tensors: Optional[dict[str, np.ndarray]] = None
    self.delta_cache: dict[int, list] = {}  # base version -> per-chunk (encoding, bytes|None)

  @property
  def version(self) -> int:
    return self.manifest.version

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
    """The manifest with every chunk's crc (only once complete)."""
    if not self.complete:
      raise TransferError("payload is not complete")
    return dataclasses.replace(self.manifest, crcs=tuple(self.crcs))

  def commit(self, i: int, crc: Optional[int] = None) -> None:
    """Verifies chunk i (the next one in order) against ``crc`` (default: the known one), marks it ready.

    ChecksumError if the bytes do not match.
    """
    if i != self._ready:
      raise TransferError(f"chunk {i} arrived out of order (expected {self._ready})")
    expected = self.crcs[i] if crc is None else crc
    if expected is None:
      raise TransferError(f"no checksum for chunk {i}")
    verify_chunk(self.buf, self.manifest, i, expected)
    self._mark(i, expected)

  def add_written(self, i: int, crc: int) -> None:
    """Sender side: chunk i was just written here and checksummed (nothing to verify)."""
    if i != self._ready:
      raise TransferError(f"chunk {i} written out of order (expected {self._ready})")
    self._mark(i, crc)

  def _mark(self, i: int, crc: int) -> None:
    with self._cond:
      self.crcs[i] = crc
      self._ready += 1
      self._cond.notify_all()

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

  def tensors(self) -> dict[str, np.ndarray]:
    """Read-only zero-copy views (only once complete)."""
    if not self.complete:
      raise TransferError("payload is not complete")
    if self._tensors is None:
      self._tensors = read_payload(self.buf, self.manifest)
    return self._tensors

  def open_stream(self) -> None:
    with self._cond:
      self.streams += 1

  def close_stream(self) -> None:
    with self._cond:
      self.streams -= 1

  @property
  def failed(self) -> bool:
    return self._error is not None


def private_payload(manifest: Manifest, recycle: Optional[np.ndarray] = None) -> Payload:
  """A staging payload in process memory; reuses ``recycle`` (a retired buffer) when the size fits.

  Recycling matters here for the same reason as segments do: first-touching
  1 GB of fresh memory costs more than receiving it.
  """
  if recycle is not None and recycle.size == manifest.total_bytes:
    arr = recycle
  else:
    arr = np.empty(manifest.total_bytes, np.uint8)
  return Payload(manifest, memoryview(arr), keepalive=arr)


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
  """A sender's buffer: a shared-memory segment (``shm`` set: its name, for crash cleanup, and our
  writable mapping) or private memory (``shm`` None). payload: the version it holds (None while free).
  """

  buf: memoryview
  shm: Optional[shared_memory.SharedMemory] = None
  keepalive: Any = None
  payload: Optional[Payload] = None

  @property
  def name(self) -> Optional[str]:
    return self.shm.name if self.shm is not None else None

  def unlink(self) -> None:
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
  return Segment(memoryview(_mmap(shm.name, size, writable=True)), shm=shm)


class SegmentPool:
  """The sender's buffers, recycled under the safety rule in the module docstring.

  Steady state: ``min_segments`` buffers (the versions still served plus the
  one being written) take turns. A receiver that lags keeps its segment from
  being rewritten, so new ones are made; the pool then forgets (unlinks) the
  oldest beyond ``max_segments``; a receiver still mapping one keeps its
  memory until it lets go. ``shared=False``: private buffers (the TCP-only
  path), recycled for the same reason: first-touching fresh memory is slow.
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
    which ``reusable(its payload)`` holds, else a new one (and None)."""
    with self._lock:
      free = [
          s
          for s in self._segments
          if len(s.buf) == size and (s.payload is None or reusable(s.payload))
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
    with self._lock:
      self._segments.append(seg)
      while len(self._segments) > self.max_segments:  # forget the oldest other buffer
        old = min((s for s in self._segments if s is not seg), key=self._age)
        self._segments.remove(old)
        old.unlink()
    return seg, None

  def close(self) -> None:
    with self._lock:
      for seg in self._segments:
        seg.unlink()
      self._segments.clear()


_MAPS: "collections.OrderedDict[str, mmap.mmap]" = collections.OrderedDict()
_MAPS_LOCK = threading.Lock()
MAX_CACHED_MAPS = 4


def map_shared(name: str, manifest: Manifest) -> Payload:
  """A read-only view of a sender's segment (this process keeps the mapping for later versions).

  Nothing is verified yet: commit each chunk.
  """
  if "/" in name or name.startswith(".") or not name:
    raise TransferError(f"bad shared-memory name {name!r}")
  with _MAPS_LOCK:
    m = _MAPS.get(name)
    if m is not None and len(m) >= manifest.total_bytes:
      _MAPS.move_to_end(name)
    else:
      try:
        m = _mmap(name, manifest.total_bytes, writable=False)
      except (FileNotFoundError, ValueError, OSError) as e:
        raise TransferError(f"cannot map shared-memory segment {name}: {e}") from None
      _MAPS[name] = m
      while len(_MAPS) > MAX_CACHED_MAPS:
        _MAPS.popitem(last=False)  # unmapped once no payload view uses it
  return Payload(manifest, memoryview(m)[: manifest.total_bytes], keepalive=m)
