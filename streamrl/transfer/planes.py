"""The data planes that move one payload over one edge, and the emulated link rates they obey.

Why TCP + shared memory (and not Ray's object store):
- The control plane and the default data plane are plain TCP streams of
  length-prefixed frames between processes (wire.py): they work between any
  two machines (generators need not be Ray actors, and a relay in another
  datacenter is reached over an ordinary socket), a frame is received
  straight into the staging buffer (no intermediate copies), and nothing on
  the wire is pickled: control frames are JSON, data frames are raw
  safetensors bytes. Ray's object store would deserialize with pickle from
  the network, which is exactly what we refuse to do, and adds nothing a
  socket does not do here.
- Same-host fast path (``ShmPlane``): the sender writes the payload into a
  POSIX shared-memory file once; a receiver with the same host label and the
  same datacenter label (the sender's host, or the first receiver of a remote
  host, whose staging is such a file too) gets only a small control message
  over TCP, maps the file read-only and verifies every chunk's checksum in
  place as soon as the sender reports it written (R frames), so verification
  overlaps the sender's copy. Several receivers then cost one copy plus one
  checksum pass each instead of one copy each through the kernel, and their
  engines load that one file.
- A TCP receiver (``TcpPlane``) receives each chunk straight into its staging
  file: the received bytes are the safetensors file its engines load.
- Datacenters: bytes between two datacenters always travel over TCP, even
  when both ends carry the same host label, so they go through the
  cross-datacenter rate limiter (``RateLimiter``) and delta encoding. One
  machine can thus emulate a real cross-datacenter edge (a publisher in dc0
  and receivers in dc1, all on one host).

Frames of the data planes (after the J header that names the plane; wire.py):
  C  chunk: 4-byte index + 1-byte encoding (delta.RAW / XOR_ZLIB / XOR_SPARSE) + 8-byte checksum
     (manifest.checksum) + 32-byte digest (manifest.digest) of the (reconstructed) chunk + data
  R  shared-memory chunk ready: 4-byte index + 8-byte checksum (the bytes are in the file)
  P  (receiver -> sender, shared memory) the receiver holds its pin; empty body
  E  end of payload; body: the publisher's signature of the manifest (64 bytes), then on TCP
     that of the manifest with the digests (64 bytes)

Where a GPU path plugs in: a ``DataPlane`` subclass (say ``"nccl"``) whose
``offer`` answers only when client and server share a NCCL/CUDA-IPC group
(the response header then carries the group id and rank instead of a
segment name), whose ``send`` broadcasts the payload from device memory, and
whose ``open``/``fill`` receive into a device staging buffer and verify each
chunk's checksum on the device before ``commit``-style readiness. On vLLM
that maps onto the weight-transfer engine API (start_weight_update /
update_weights / finish_weight_update). It is not implemented here because
nothing on this machine can test it; the control plane, manifests, versions,
topology and acks would stay unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import ClassVar, Optional

from streamrl.transfer import delta as delta_lib
from streamrl.transfer.manifest import Manifest, TransferError
from streamrl.transfer.payload import Payload, map_shared, staging_payload
from streamrl.transfer.security import SIGNATURE_BYTES
from streamrl.transfer.shm import Segment
from streamrl.transfer.wire import (
    FRAME,
    read_json_body,
    recv_exact,
    recv_exact_into,
    recv_frame_header,
)

_CHUNK = struct.Struct("!IBQ32s")
_READY = struct.Struct("!IQ")
CHUNK_FRAME_BYTES = FRAME.size + _CHUNK.size  # wire bytes before each chunk's data (C frame)
_SEND_PIECE = 256 << 10  # rate-limited sends go out in pieces this big
MAX_TAG_BYTES = 2 * SIGNATURE_BYTES

# ---------------------------------------------------------------- rate limiting


class RateLimiter:
  """Token bucket (GCRA form) shared by every stream that crosses one emulated link.

  rate: bytes/s; burst: bytes that may go out back to back before pacing.
  clock/sleep are injectable so the pacing is testable without wall time.
  ``consumed`` (bytes) and ``waited_s`` (time spent sleeping) say what the link carried.
  """

  def __init__(
      self,
      rate: float,
      burst: int = 1 << 20,
      clock: Callable[[], float] = time.monotonic,
      sleep: Callable[[float], None] = time.sleep,
  ):
    if rate <= 0:
      raise ValueError(f"rate={rate} bytes/s must be positive.")
    self.rate, self.burst_s = float(rate), burst / float(rate)
    self._clock, self._sleep = clock, sleep
    self._tat = clock()  # theoretical arrival time of the next byte
    self._lock = threading.Lock()
    self.consumed, self.waited_s = 0, 0.0

  def consume(self, n: int) -> float:
    """Reserves n bytes of link time and sleeps until they may be sent; returns the delay."""
    with self._lock:
      now = self._clock()
      self._tat = max(self._tat, now) + n / self.rate
      delay = self._tat - now - self.burst_s
      self.consumed += n
      self.waited_s += max(delay, 0.0)
    if delay > 0:
      self._sleep(delay)
    return max(delay, 0.0)


def send_limited(sock: socket.socket, data: memoryview, limiters: Sequence[RateLimiter]) -> None:
  """Sends ``data`` whole, in pieces that each first take their link time from every limiter."""
  if not limiters:
    sock.sendall(data)
    return
  for start in range(0, len(data), _SEND_PIECE):
    piece = data[start : start + _SEND_PIECE]
    for lim in limiters:
      lim.consume(len(piece))
    sock.sendall(piece)


# ---------------------------------------------------------------- data planes


@dataclasses.dataclass(frozen=True)
class Link:
  """How one server->client edge is driven.

  limiters: token buckets this edge shares (uplink, cross-datacenter link).
  delta_base: the client's current version, held by the server, when deltas are on for this edge.
  seal: the publisher's: signs a payload's manifest with its digests, once (``full_tag``).
  """

  limiters: tuple[RateLimiter, ...] = ()
  delta_base: Optional[Payload] = None
  delta_level: int = 1
  executor: Optional[Executor] = None
  timeout: float = 30.0
  seal: Optional[Callable[[Payload], bytes]] = None


class DataPlane(abc.ABC):
  """Moves one payload over one edge; the control plane (node.py) is the same for all planes."""

  name: ClassVar[str]
  copies: ClassVar[bool]  # the client writes the payload into memory of its own

  @abc.abstractmethod
  def offer(
      self, payload: Payload, request: dict, server_host: str, server_dc: str, use_shm: bool
  ) -> Optional[dict]:
    """Server side: header fields if this plane can carry ``payload`` to the requester, else None."""

  @abc.abstractmethod
  def send(self, sock: socket.socket, payload: Payload, link: Link) -> int:
    """Server side, after the header: streams the payload and the end frame (the publisher's
    signatures); returns bytes put on the wire."""

  @abc.abstractmethod
  def open(self, header: dict, manifest: Manifest, buffer: Callable[[int], Segment]) -> Payload:
    """Client side: the payload the data will land in (``buffer(nbytes)``: a staging buffer of ours)."""

  @abc.abstractmethod
  def fill(
      self,
      sock: socket.socket,
      header: dict,
      payload: Payload,
      base: Optional[Payload],
      timeout: float,
  ) -> tuple[int, bytes]:
    """Client side: receives and commits (verifies) every chunk in order; returns (wire bytes,
    the end frame's body: the publisher's signatures). The caller checks them."""


def _send_end(sock: socket.socket, payload: Payload, link: Link, full: bool = False) -> int:
  """The end frame: the publisher's signature of the manifest (passed on as it came), and when
  ``full`` (TCP) that of the manifest with the digests."""
  tag = payload.wait_tag(link.timeout)
  if full:
    full_tag = payload.full_tag
    if full_tag is None:
      if link.seal is None:
        raise TransferError(f"version {payload.version} has no signed digests here")
      full_tag = link.seal(payload)
    tag += full_tag
  sock.sendall(FRAME.pack(b"E", len(tag)) + tag)
  return FRAME.size + len(tag)


def _recv_end(sock: socket.socket) -> tuple[int, bytes]:
  kind, n = recv_frame_header(sock)
  if kind == b"X":
    raise TransferError(f"sender aborted: {read_json_body(sock, n).get('reason')}")
  if kind != b"E":
    raise TransferError(f"expected end of payload, got frame {kind!r}")
  if n > MAX_TAG_BYTES:
    raise TransferError(f"end frame of {n} bytes is too large")
  return FRAME.size + n, bytes(recv_exact(sock, n))


def _encoded_chunks(payload: Payload, link: Link, lookahead: int = 4):
  """Yields (encoding, bytes|None) per chunk, encoding ahead on the executor; cached per base."""
  base = link.delta_base
  n = payload.manifest.num_chunks
  cache = payload.delta_cache.setdefault(base.version, [None] * n)
  word = payload.manifest.word_bytes

  def encode(i: int):
    if cache[i] is None:
      cache[i] = delta_lib.encode_chunk(payload.chunk(i), base.chunk(i), word, link.delta_level)
    return cache[i]

  pending: deque = deque()
  nxt = 0
  for i in range(n):
    while nxt < n and nxt < i + lookahead:
      payload.wait_ready(nxt + 1, link.timeout)
      pending.append(link.executor.submit(encode, nxt) if link.executor else None)
      nxt += 1
    fut = pending.popleft()
    yield fut.result() if fut is not None else encode(i)


class TcpPlane(DataPlane):
  """Chunks as frames on the socket, optionally delta-encoded, paced by the edge's limiters."""

  name = "tcp"
  copies = True

  def offer(self, payload, request, server_host, server_dc, use_shm):
    return {}

  def send(self, sock, payload, link):
    m = payload.manifest
    sent = 0
    encoded = _encoded_chunks(payload, link) if link.delta_base is not None else None
    for i in range(m.num_chunks):
      payload.wait_ready(i + 1, link.timeout)
      enc, blob = next(encoded) if encoded is not None else (delta_lib.RAW, None)
      data = payload.chunk(i) if blob is None else memoryview(blob)
      head = FRAME.pack(b"C", _CHUNK.size + len(data)) + _CHUNK.pack(
          i, enc, payload.checksums[i], payload.digest(i)
      )
      sock.sendall(head)
      send_limited(sock, data, link.limiters)
      sent += len(head) + len(data)
    return sent + _send_end(sock, payload, link, full=True)

  def open(self, header, manifest, buffer):
    return staging_payload(manifest, buffer(manifest.total_bytes))

  def fill(self, sock, header, payload, base, timeout):
    m = payload.manifest
    received = 0
    for i in range(m.num_chunks):
      kind, n = recv_frame_header(sock)
      if kind == b"X":
        raise TransferError(f"sender aborted: {read_json_body(sock, n).get('reason')}")
      if kind != b"C" or n < _CHUNK.size:
        raise TransferError(f"expected chunk {i}, got frame {kind!r}")
      idx, enc, expected, expected_digest = _CHUNK.unpack(recv_exact(sock, _CHUNK.size))
      a, b = m.chunk_range(i)
      size = n - _CHUNK.size
      if idx != i:
        raise TransferError(f"expected chunk {i}, got chunk {idx}")
      if enc == delta_lib.RAW:
        if size != b - a:
          raise TransferError(f"chunk {i} has {size} bytes, manifest says {b - a}")
        recv_exact_into(sock, payload.buf[a:b])
      elif enc in (delta_lib.XOR_ZLIB, delta_lib.XOR_SPARSE):
        if base is None or size > 2 * (b - a) + 1024:
          raise TransferError(f"unexpected or oversized delta chunk {i}")
        blob = recv_exact(sock, size)
        delta_lib.decode_chunk(enc, bytes(blob), base.chunk(i), payload.buf[a:b], m.word_bytes)
      else:
        raise TransferError(f"unknown chunk encoding {enc}")
      # Checksum and digest of the (reconstructed) chunk: these bytes crossed a socket.
      payload.commit(i, expected, expected_digest)
      received += FRAME.size + n
    n, tag = _recv_end(sock)
    return received + n, tag


class ShmPlane(DataPlane):
  """Same host and same datacenter: the data is in the sender's segment; the socket only
  carries the header and the end. Between datacenters it never answers, even on one host, so
  a cross-datacenter edge always goes over TCP (rate limits, deltas), real or emulated."""

  name = "shm"
  copies = False

  def offer(self, payload, request, server_host, server_dc, use_shm):
    if (
        use_shm
        and payload.shm_name
        and request.get("shm", False)
        and request.get("host") == server_host
        and request.get("dc") == server_dc
    ):
      return {"shm": payload.shm_name}
    return None

  def send(self, sock, payload, link):
    n, sent, wire = payload.manifest.num_chunks, 0, 0
    while sent < n:  # report newly written chunks in batches
      payload.wait_ready(sent + 1, link.timeout)
      ready = payload.ready
      frames = b"".join(
          FRAME.pack(b"R", _READY.size) + _READY.pack(i, payload.checksums[i])
          for i in range(sent, ready)
      )
      sock.sendall(frames)
      wire += len(frames)
      sent = ready
    # The stream (which keeps the file from being recycled) ends only once the receiver holds
    # its pin: between the two, nothing may rewrite what it verified.
    kind, n = recv_frame_header(sock)
    if kind != b"P" or n != 0:
      raise TransferError(f"expected the receiver's pin, got frame {kind!r}")
    return wire + _send_end(sock, payload, link)

  def open(self, header, manifest, buffer):
    # Only a regular file of ours of the payload's size, whatever name the header gives
    # (map_shared); the receiver refuses this plane where it did not ask for it (receiver.py).
    return map_shared(str(header.get("shm", "")), manifest)

  def fill(self, sock, header, payload, base, timeout):
    # Chunks are verified as the writer reports them written, also in a recycled file it is
    # still rewriting (no pin can start then): while this stream is open the sender neither
    # recycles the file nor writes a reported chunk again. The pin is taken before the stream
    # ends (the "P" frame), so no chunk verified here can change afterwards.
    for i in range(payload.manifest.num_chunks):
      kind, n = recv_frame_header(sock)
      if kind == b"X":
        raise TransferError(f"sender aborted: {read_json_body(sock, n).get('reason')}")
      if kind != b"R" or n != _READY.size:
        raise TransferError(f"expected chunk {i} ready, got frame {kind!r}")
      idx, expected = _READY.unpack(recv_exact(sock, n))
      if idx != i:
        raise TransferError(f"expected chunk {i}, got chunk {idx}")
      payload.commit(i, expected)
    if payload.pin is not None:
      payload.pin.hold(timeout)  # waits for the writer's end_rewrite, right after its last chunk
    sock.sendall(FRAME.pack(b"P", 0))
    n, tag = _recv_end(sock)
    return (FRAME.size + _READY.size) * payload.manifest.num_chunks + FRAME.size + n, tag


PLANES: dict[str, DataPlane] = {p.name: p for p in (ShmPlane(), TcpPlane())}  # preference order


def choose_plane(
    payload: Payload, request: dict, server_host: str, server_dc: str, use_shm: bool
) -> tuple[DataPlane, dict]:
  """The first plane of ``PLANES`` (in preference order) that can carry ``payload`` to the
  requester, with its header fields; TransferError if none can."""
  for plane in PLANES.values():
    fields = plane.offer(payload, request, server_host, server_dc, use_shm)
    if fields is not None:
      return plane, fields
  raise TransferError("no data plane can reach this client")
