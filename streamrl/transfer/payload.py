"""A version's bytes held by one node, plus which chunks are verified so far.

The same object serves three roles: the sender's published payload (its
chunks become ready as the sender writes them), a receiver's staging buffer
(filled chunk by chunk, every chunk checksummed before it counts as ready)
and a receiver's current version (kept to re-serve children and late joiners
and as the base for deltas). Servers stream chunk i as soon as it is ready,
which is what makes publishing and forwarding through a tree pipelined.

The bytes are a safetensors file: a buffer this node owns (``shm.Segment``),
or a same-host peer's file mapped read-only and pinned (``map_shared``); where
they live and how long a file stays as it is, see shm.py.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Optional

from streamrl.transfer.manifest import (
    ChecksumError,
    Manifest,
    TransferError,
    digest,
    read_payload,
    verify_chunk,
)
from streamrl.transfer.shm import SHM_DIR, Pin, Segment, map_pinned


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
      segment: Optional[Segment] = None,
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
    # Cryptographic digests (manifest.digest): verified for chunks that came over TCP, computed on
    # demand where ``digestible`` (the publisher's own bytes), unknown for a mapped file.
    self.digests: list[Optional[bytes]] = list(manifest.digests) or [None] * manifest.num_chunks
    self.digestible = False
    self._ready = ready
    self._error: Optional[str] = None
    self._cond = threading.Condition()
    self._tensors: Optional[VersionTensors] = None
    self.delta_cache: dict[int, list] = {}  # base version -> per-chunk (encoding, bytes|None)
    # The publisher's signatures (security.sign_manifest), once known: ``tag`` of the manifest
    # with the checksums, ``full_tag`` of the one with the digests too (what TCP edges carry).
    self.tag: Optional[bytes] = None
    self.full_tag: Optional[bytes] = None

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

  def signed_manifest(self, full: bool) -> Manifest:
    """What the publisher signs: the complete manifest, with every chunk's digest when ``full``
    (a mapped file's node has none: TransferError)."""
    m = self.full_manifest
    if not full:
      return m
    return dataclasses.replace(m, digests=tuple(self.digest(i) for i in range(m.num_chunks)))

  def digest(self, i: int) -> bytes:
    """Chunk i's cryptographic digest: the verified one, or computed here on first use where
    ``digestible`` (so the same-host path never pays for it); TransferError otherwise."""
    d = self.digests[i]
    if d is None:
      if not self.digestible:
        raise TransferError(
            f"version {self.version} came to this node as a same-host file, without digests; "
            "fetch it from the publisher"
        )
      d = self.digests[i] = digest(self.chunk(i))  # racing threads compute the same value
    return d

  def commit(
      self, i: int, expected: Optional[int] = None, expected_digest: Optional[bytes] = None
  ) -> None:
    """Verifies chunk i (the next one in order) against ``expected`` (default: the known checksum)
    and, if given, ``expected_digest`` (bytes that crossed a socket), marks it ready.

    ChecksumError if the bytes do not match.
    """
    if i != self._ready:
      raise TransferError(f"chunk {i} arrived out of order (expected {self._ready})")
    expected = self.checksums[i] if expected is None else expected
    if expected is None:
      raise TransferError(f"no checksum for chunk {i}")
    verify_chunk(self.buf, self.manifest, i, expected)
    if expected_digest is not None:
      if digest(self.chunk(i)) != expected_digest:
        raise ChecksumError(
            f"chunk {i} of version {self.version} is corrupted (its digest does not match)"
        )
      self.digests[i] = bytes(expected_digest)
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

  def set_tag(self, tag: bytes, full_tag: Optional[bytes] = None) -> None:
    """The publisher's signatures of the complete manifest (made there, checked here first)."""
    with self._cond:
      self.tag = bytes(tag)
      if full_tag is not None:
        self.full_tag = bytes(full_tag)
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


def map_shared(name: str, manifest: Manifest) -> Payload:
  """A read-only view of another node's file on this host, pinned until ``release``.

  The name comes from a peer: only a name this service makes, of a regular
  file of this user with exactly the payload's size, is mapped
  (``shm.map_pinned``); TransferError otherwise. While its writer still
  rewrites it the pin is not held yet: hold it (``payload.pin.hold``) before
  the sender's stream ends, as ``ShmPlane.fill`` does (the stream keeps the
  file from being recycled until then). Nothing is verified yet: commit each
  chunk.
  """
  pin, m = map_pinned(name, manifest.total_bytes)
  return Payload(
      manifest, memoryview(m)[: manifest.total_bytes], keepalive=m, shm_name=name, pin=pin
  )
