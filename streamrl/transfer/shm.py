"""This host's shared-memory files: checked names and opens, pins, the buffers a node owns,
their pool, mappings of other processes' files, and weights files.

Memory: a payload is a safetensors file, so its bytes are what an engine
loads. The sender's payloads (shared memory on) and a receiver's staging buffers are POSIX
shared-memory files in /dev/shm (created through multiprocessing's
SharedMemory, so the resource tracker unlinks them if their process dies);
``VersionTensors.path`` names the file, and every engine on that host loads
that one file (``vllm_worker.WorkerExtension`` reads it zero-copy). Same-host
receivers map a sender's file read-only instead of receiving a copy. Without
/dev/shm, buffers are private memory (no path).

Which files a node maps: the name comes from a peer, so ``map_pinned``
takes only names this service makes (``lifecycle.shm_name``:
``srl_<pid>_<start ticks>_<pid namespace>_<random>``), opens them without
following a symlink or blocking on a FIFO, and maps only a regular file of
this user with exactly the payload's size. A process killed with its
resource tracker (a whole process group: Ray, systemd, docker) leaves its
files behind; ``sweep_orphans`` removes those of dead processes when a
node starts or makes a file, and so does the watchdog (``lifecycle``).

Lifetimes: whoever reads a file someone else may rewrite holds a ``Pin`` (a
shared ``flock`` on it, released on close or death) for as long as it needs
the bytes: a receiver for the payloads it maps, a generator from staging a
version until its engine has loaded it (by path). A writer rewrites or
unlinks a file only if no one pins it and its own rules allow (the sender:
the version is retired, no stream reads it and every live receiver has
acked a newer one, and never its newest version; a receiver: the version is
neither current nor in flight, no stream reads it); otherwise it takes a
fresh file and keeps the pinned one until it is free. A rewrite holds an
exclusive ``flock`` from the check to the last byte (``Segment.begin_rewrite``),
so no pin starts meanwhile; a reader verifies chunks as they are written and
holds its pin before the sender's stream ends (which keeps the file from
being recycled), so what it verified stays as it was. ``close`` unlinks
everything (mappings outlive the name).

Files are recycled. On a VM without huge pages for tmpfs, setting up the page
tables of a fresh mapping of a large file costs more than copying and
checksumming its bytes, so the sender keeps a small pool of segments, a
receiver reuses its retired staging file, and every process keeps its
mappings of others' files (``SegmentPool``, ``map_pinned``).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing import shared_memory
from typing import Any, Optional

import numpy as np

from streamrl import lifecycle
from streamrl.transfer.manifest import (
    Manifest,
    TransferError,
    header_bytes,
    plan_payload,
    read_payload,
    write_tensors,
)

SHM_DIR = lifecycle.SHM_DIR
SWEEP_EVERY_S = 60.0  # a process looks for dead processes' files at most this often

log = logging.getLogger(__name__)
_last_sweep = -float("inf")


def shm_available() -> bool:
  """The shared-memory path needs a POSIX /dev/shm (Linux)."""
  return os.path.isdir(SHM_DIR)


def sweep_orphans(force: bool = False) -> list[str]:
  """Removes this service's /dev/shm files whose creating process is gone (``lifecycle.sweep_shm``).

  At most once every ``SWEEP_EVERY_S`` per process unless ``force``. Returns the names removed.
  """
  global _last_sweep
  now = time.monotonic()
  if not shm_available() or (not force and now - _last_sweep < SWEEP_EVERY_S):
    return []
  _last_sweep = now
  removed = lifecycle.sweep_shm()
  if removed:
    log.info("removed %d /dev/shm files of dead processes: %s", len(removed), ", ".join(removed))
  return removed


def segment_path(name: str) -> str:
  """/dev/shm/``name`` if ``name`` is one this service makes; TransferError if not (names come
  from peers: nothing else of this host may be mapped through one)."""
  if not lifecycle.is_shm_name(name):
    raise TransferError(
        f"refusing shared-memory segment {name[:80]!r}: not a name this service makes"
    )
  return os.path.join(SHM_DIR, name)


def _open_checked(path: str, writable: bool, size: Optional[int] = None) -> int:
  """An fd of ``path`` if it is a regular file of this user (of exactly ``size`` bytes).

  O_NOFOLLOW: a symlink planted under the name is refused, not followed;
  O_NONBLOCK: a FIFO cannot block the open (it then fails the regular-file
  check). The checks run on the open fd, so the file cannot change between
  check and use. TransferError otherwise.
  """
  flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
  try:
    fd = os.open(path, flags)
  except OSError as e:
    why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
    raise TransferError(f"cannot open shared-memory file {path}: {why}") from None
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      why = "it is not a regular file"
    elif st.st_uid != os.geteuid():
      why = f"it belongs to uid {st.st_uid}, not to this process's user"
    elif size is not None and st.st_size != size:
      why = f"it has {st.st_size} bytes, the payload {size}"
    else:
      return fd
  except OSError as e:
    why = e.strerror
  os.close(fd)
  raise TransferError(f"refusing shared-memory file {path}: {why}")


class Pin:
  """A shared ``flock`` on a /dev/shm file: while any is held, no writer rewrites the file.

  flock locks belong to an open file description, so a pin ends when its
  holder releases it, is collected, or dies: a crashed reader never blocks a
  writer. A writer holds an exclusive lock for its whole rewrite, so a pin
  waits up to ``wait`` seconds for the rewrite to end. TransferError if the
  file is gone, is not a regular file of this user (a symlink is not
  followed), or is still being rewritten.
  """

  def __init__(self, path: str, wait: float = 0.0):
    self.path, self._fd, self.held = path, None, False
    self._fd = _open_checked(path, writable=False)
    try:
      self.hold(wait)
    except BaseException:
      self.release()
      raise

  @classmethod
  def _of_fd(cls, path: str, fd: int) -> "Pin":
    """A pin, not held yet, on an fd the caller opened and checked (it closes with the pin)."""
    pin = cls.__new__(cls)
    pin.path, pin._fd, pin.held = path, fd, False
    return pin

  def hold(self, wait: float) -> None:
    """Takes the shared lock if not held yet, waiting up to ``wait`` seconds for a rewrite."""
    deadline, pause = time.monotonic() + wait, 0.001
    while not self.held:
      if self._fd is None:
        raise TransferError(f"cannot pin {self.path}: the pin was released")
      try:
        fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        self.held = True
      except BlockingIOError:
        if time.monotonic() >= deadline:
          raise TransferError(f"cannot pin {self.path}: it is being rewritten") from None
        time.sleep(pause)
        pause = min(2 * pause, 0.01)

  def release(self) -> None:
    fd, self._fd, self.held = self._fd, None, False
    if fd is not None:
      os.close(fd)

  def __del__(self):
    self.release()


def is_pinned(name: str) -> bool:
  """Whether some process holds a ``Pin`` on /dev/shm/``name`` (False if the file is gone)."""
  try:
    fd = os.open(
        os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    )
  except FileNotFoundError:
    return False
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return False
  except BlockingIOError:
    return True
  finally:
    os.close(fd)  # also drops our exclusive lock, if we got it


def _map_fd(fd: int, size: int, writable: bool) -> mmap.mmap:
  # MAP_POPULATE: build the page tables in one go instead of one fault per 4 KiB page.
  flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
  try:
    return mmap.mmap(
        fd, size, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    )
  except (OSError, ValueError) as e:
    raise TransferError(f"cannot map shared memory: {e}") from None


def _mmap(name: str, size: int, writable: bool) -> mmap.mmap:
  """A mapping of our /dev/shm file ``name`` of exactly ``size`` bytes (``_open_checked``)."""
  fd = _open_checked(segment_path(name), writable, size)
  try:
    return _map_fd(fd, size, writable)
  finally:
    os.close(fd)


@dataclasses.dataclass
class Segment:
  """A buffer this process owns: a shared-memory file (``shm`` set: its name, for crash cleanup,
  and our writable mapping; ``fd``: the file, held open for the rewrite lock) or private memory
  (``shm`` None). payload: the version it holds (a ``payload.Payload``; None while free).
  """

  buf: memoryview
  shm: Optional[shared_memory.SharedMemory] = None
  keepalive: Any = None
  payload: Any = None
  fd: Optional[int] = None
  rewriting: bool = False

  @property
  def name(self) -> Optional[str]:
    return self.shm.name if self.shm is not None else None

  def pinned(self) -> bool:
    """Someone reads this file and it must not be rewritten (see ``Pin``)."""
    return self.shm is not None and is_pinned(self.shm.name)

  def begin_rewrite(self) -> bool:
    """Takes the file for a rewrite: an exclusive ``flock`` until ``end_rewrite``, so no reader
    pins it meanwhile (``Pin`` waits or fails). False, and nothing taken, if someone pins it.

    The check and the lock are one step: a pin cannot slip in between them.
    """
    if self.fd is None or self.rewriting:
      return True  # private memory (nobody else can see it), or ours already
    try:
      fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      return False
    self.rewriting = True
    return True

  def end_rewrite(self) -> None:
    """The new bytes are all written (or abandoned): readers may pin the file again."""
    if self.rewriting:
      self.rewriting = False
      if self.fd is not None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

  def unlink(self) -> None:
    """Removes the file's name (mappings, ours included, stay valid until dropped)."""
    if self.shm is not None:
      try:
        self.shm.unlink()
      except FileNotFoundError:
        pass
    self._close()

  def _close(self) -> None:
    # Unlock first: our mapping holds a dup of this fd (mmap does), so the lock would outlive it.
    self.end_rewrite()
    fd, self.fd = self.fd, None
    if fd is not None:
      os.close(fd)

  def __del__(self):
    self._close()


def create_segment(size: int, shared: bool = True) -> Segment:
  """A new writable buffer of ``size`` bytes with its pages already mapped.

  Shared: created through SharedMemory (so the resource tracker unlinks it if
  this process dies) but mapped with our own mmap: SharedMemory.close()
  raises while numpy views exist, a plain mmap just lives as long as its views.
  Its name says which process made it (``lifecycle.shm_name``), so that a
  sweep can remove it if that process dies with its resource tracker; making
  one runs that sweep for others' files (``sweep_orphans``, rate-limited).
  """
  if not shared:
    arr = np.empty(size, np.uint8)
    return Segment(memoryview(arr), keepalive=arr)
  sweep_orphans()
  shm = shared_memory.SharedMemory(name=lifecycle.shm_name(), create=True, size=max(size, 1))
  shm.close()
  try:
    fd = _open_checked(os.path.join(SHM_DIR, shm.name), writable=True, size=max(size, 1))
    try:
      m = _map_fd(fd, max(size, 1), writable=True)
    except BaseException:
      os.close(fd)
      raise
  except BaseException:
    shm.unlink()
    raise
  return Segment(memoryview(m)[:size], shm=shm, keepalive=m, fd=fd)


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
    if shared:
      sweep_orphans()  # a Publisher starts: what dead predecessors left in /dev/shm goes

  @staticmethod
  def _age(seg: Segment) -> int:
    return seg.payload.version if seg.payload is not None else -1

  def acquire(self, size: int, reusable: Callable[[Any], bool]) -> tuple[Segment, Any]:
    """A buffer for a new version and the payload it held (a ``payload.Payload``): the newest
    buffer for which ``reusable(its payload)`` holds and no reader pins, else a new one (and
    None).

    A reused buffer comes locked for its rewrite (``Segment.begin_rewrite``): the caller
    calls ``end_rewrite`` once the new version is written.
    """
    with self._lock:
      free = [
          s
          for s in self._segments
          if len(s.buf) == size and (s.payload is None or reusable(s.payload))
      ]
      chosen = next(
          (s for s in sorted(free, key=self._age, reverse=True) if s.begin_rewrite()), None
      )
      if chosen is not None:
        for extra in sorted(free, key=self._age):  # idle extras left by a laggard: let them go
          if extra is not chosen and len(self._segments) > self.min_segments and not extra.pinned():
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
    layout (same names, shapes and dtypes); False (nothing written) if not,
    or if someone pins the file (``Pin``; none can start while it is written).
    Readers must not be reading it meanwhile (an engine reloads only between
    updates)."""
    manifest = plan_payload(tensors, 0, self.manifest.chunk_bytes)
    if manifest.tensors != self.manifest.tensors or not self._segment.begin_rewrite():
      return False
    try:
      for _ in write_tensors(tensors, self.manifest, self._segment.buf):
        pass
    finally:
      self._segment.end_rewrite()
    return True

  def unlink(self) -> None:
    self._segment.unlink()


def open_weights_file(name: str, size: int) -> memoryview:
  """A writable mapping of another process's ``WeightsFile`` (by its ``name``) on this host."""
  return memoryview(_mmap(name, size, writable=True))[:size]


# name -> ((st_dev, st_ino) of the file mapped, the mapping)
_MAPS: "collections.OrderedDict[str, tuple[tuple[int, int], mmap.mmap]]" = collections.OrderedDict()
_MAPS_LOCK = threading.Lock()
MAX_CACHED_MAPS = 4


def map_pinned(name: str, size: int) -> tuple[Pin, mmap.mmap]:
  """A read-only mapping of another process's file /dev/shm/``name`` on this host, and a pin on
  it that the caller releases once done with the bytes.

  The name comes from a peer: only a name this service makes, of a regular
  file of this user with exactly ``size`` bytes, is mapped (``segment_path``,
  ``_open_checked``); TransferError otherwise. The pin and the mapping are of
  that one open file. While its writer still rewrites it the pin is not held
  yet: hold it (``Pin.hold``) before relying on the bytes. This process keeps
  the mapping for later versions.
  """
  path = segment_path(name)
  pin = Pin._of_fd(path, _open_checked(path, writable=False, size=size))
  try:
    try:
      pin.hold(0.0)
    except TransferError:
      pass  # being rewritten: the reader waits for it before it verifies a chunk
    st = os.fstat(pin._fd)
    key = (st.st_dev, st.st_ino)
    with _MAPS_LOCK:
      cached = _MAPS.get(name)
      if cached is not None and cached[0] == key and len(cached[1]) == size:
        m = cached[1]
        _MAPS.move_to_end(name)
      else:
        # Not from the pin's fd: an mmap keeps a dup of its fd, and a flock belongs to the open
        # file, so a cached mapping would hold the pin for good. A second open of the same file.
        fd = _open_checked(path, writable=False, size=size)
        try:
          st = os.fstat(fd)
          if (st.st_dev, st.st_ino) != key:
            raise TransferError(f"shared-memory file {path} was replaced while being opened")
          m = _map_fd(fd, size, writable=False)
        finally:
          os.close(fd)
        _MAPS[name] = (key, m)
        while len(_MAPS) > MAX_CACHED_MAPS:
          _MAPS.popitem(last=False)  # unmapped once no payload view uses it
  except BaseException:
    pin.release()
    raise
  return pin, m
