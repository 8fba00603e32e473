"""A version's bytes held by one node, plus which chunks are verified so far.

The same object serves three roles: the sender's published payload (complete
from the start), a receiver's staging buffer (filled chunk by chunk, every
chunk checksummed before it counts as ready) and a receiver's current version
(kept to re-serve children and late joiners and as the base for deltas).
Servers stream chunk i to their children as soon as it is ready, which is
what makes forwarding through a tree pipelined.

Memory: private buffers are ``np.empty`` (no page is touched before data
arrives). Shared-memory payloads are POSIX segments in /dev/shm: created once
by the sender (registered with multiprocessing's resource tracker so a crashed
sender does not leak them), mapped read-only by same-host receivers. A
published segment is never written again (each version gets a new one), so a
chunk verified in the mapping stays verified; the sender unlinks retired
segments and the memory is freed when the last mapping goes away.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import secrets
import threading
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

    def __init__(self, manifest: Manifest, buf: memoryview, *, keepalive: Any = None,
                 shm: Optional[shared_memory.SharedMemory] = None, ready: int = 0):
        if len(buf) != manifest.total_bytes:
            raise ValueError("buffer size differs from the manifest")
        self.manifest = manifest
        self.buf = buf
        self.shm_name = shm.name if shm is not None else None
        self._shm = shm
        self._keepalive = keepalive
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

    def unlink(self) -> None:
        """Removes the shared-memory name (existing mappings stay valid)."""
        if self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
            self._shm = None


def private_payload(manifest: Manifest) -> Payload:
    """An empty staging payload in process memory."""
    arr = np.empty(manifest.total_bytes, np.uint8)
    return Payload(manifest, memoryview(arr), keepalive=arr)


def _mmap(name: str, size: int, writable: bool) -> mmap.mmap:
    # MAP_POPULATE: build the page tables in one go instead of one fault per 4 KiB page
    # (measured: faulting 1 GB of fresh shared memory page by page costs 1-2 s here).
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR if writable else os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < size:
            raise TransferError(f"shared-memory segment {name} is smaller than the payload")
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)


def create_shared(size: int) -> tuple[shared_memory.SharedMemory, memoryview]:
    """A new writable, pre-faulted segment of ``size`` bytes (filled by the caller, then wrapped in a Payload).

    We create through SharedMemory (so the resource tracker unlinks it if this
    process dies) but map it with our own mmap: SharedMemory.close() raises
    while numpy views exist, a plain mmap just lives as long as its views.
    """
    shm = shared_memory.SharedMemory(name=f"srl_{os.getpid()}_{secrets.token_hex(6)}", create=True,
                                     size=max(size, 1))
    shm.close()
    return shm, memoryview(_mmap(shm.name, size, writable=True)) if size else memoryview(bytearray())


def map_shared(name: str, manifest: Manifest) -> Payload:
    """Maps a sender's segment read-only; nothing is verified yet (commit each chunk)."""
    if "/" in name or name.startswith("."):
        raise TransferError(f"bad shared-memory name {name!r}")
    try:
        m = _mmap(name, manifest.total_bytes, writable=False)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise TransferError(f"cannot map shared-memory segment {name}: {e}") from None
    return Payload(manifest, memoryview(m), keepalive=m)
