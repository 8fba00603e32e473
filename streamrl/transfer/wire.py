"""The wire: length-prefixed frames on a socket, read with bounded buffers and deadlines.

Frames: 1-byte kind + 8-byte big-endian body length, then the body. Nothing on
the wire is pickled: control frames are JSON, data frames raw bytes.
  J  JSON control message (requests, replies, the response header with the manifest)
  X  error: JSON {"reason": ...}; the peer aborts this transfer
The data planes add their own kinds (planes.py: C, R, P, E).

Reads cost what the peer sent, not what it claimed: a buffer grows only as
bytes arrive, whatever a header says, every control frame has a size limit
(``MAX_HELLO_BYTES`` and ``MAX_REQUEST_BYTES`` before a peer has proven the
run's secret, ``MAX_JSON_BYTES`` after), a deadline holds for a whole exchange
however the bytes are paced, and malformed input of any kind (deep nesting
included) is a TransferError.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any, Optional

from streamrl.transfer.manifest import TransferError
from streamrl.transfer.topology import Address

FRAME = struct.Struct("!cQ")  # kind, body length
MAX_JSON_BYTES = 64 << 20  # an authenticated exchange's control reply (a manifest header)
# Frames read before the peer has proven the secret are small, so a stranger costs little:
# the hello (and the nonce that answers it) is a few dozen bytes; the largest request is an
# announce that names the child's subtree (a few hundred bytes per receiver below that child).
MAX_HELLO_BYTES = 1 << 10
MAX_REQUEST_BYTES = 64 << 10
_RECV_STEP = 64 << 10  # a receive buffer grows by at most its size, and only as bytes arrive


class AuthenticationError(TransferError):
  """A peer could not prove it holds the run's transfer secret (or did not try)."""


def connect(address: Address, timeout: float) -> socket.socket:
  """TCP connection with Nagle off (control frames are small and latency-bound)."""
  sock = socket.create_connection(tuple(address), timeout=timeout)
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return sock


def settimeout_until(sock: socket.socket, deadline: Optional[float]) -> None:
  """Lets the next socket call wait only until ``deadline`` (time.monotonic); TransferError once
  it has passed, so a peer that trickles bytes cannot stretch an exchange past it."""
  if deadline is None:
    return
  left = deadline - time.monotonic()
  if left <= 0:
    raise TransferError("the peer did not finish the exchange before its deadline")
  sock.settimeout(left)


def send_json(
    sock: socket.socket,
    obj: Any,
    kind: bytes = b"J",
    deadline: Optional[float] = None,
    limit: Optional[int] = None,
) -> None:
  """One JSON frame; ``limit``: TransferError instead of sending a body the peer would refuse."""
  body = json.dumps(obj, separators=(",", ":")).encode()
  if limit is not None and len(body) > limit:
    raise TransferError(
        f"a {obj.get('op')!r} request of {len(body)} bytes is over the {limit}-byte limit that "
        "nodes read before authentication; raise wire.MAX_REQUEST_BYTES on every node "
        "(an announce names ~155 bytes per receiver below its child)."
    )
  settimeout_until(sock, deadline)
  sock.sendall(FRAME.pack(kind, len(body)) + body)


def recv_exact_into(
    sock: socket.socket, view: memoryview, deadline: Optional[float] = None
) -> None:
  """Fills ``view``; deadline: when all of it must have arrived (else each recv's own timeout)."""
  while len(view):
    settimeout_until(sock, deadline)
    n = sock.recv_into(view)
    if n == 0:
      raise TransferError("connection closed mid-transfer")
    view = view[n:]


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
  """The next ``n`` bytes. The buffer grows as they arrive (at most doubling), so a frame header
  that claims more than the peer sends costs memory for what it sent, not what it claimed."""
  buf = bytearray(min(n, _RECV_STEP))
  start = 0
  while True:
    recv_exact_into(sock, memoryview(buf)[start:], deadline)
    if len(buf) == n:
      return buf
    start = len(buf)
    buf.extend(bytes(min(n - start, start)))


def recv_frame_header(sock: socket.socket, deadline: Optional[float] = None) -> tuple[bytes, int]:
  """The next frame's (kind, body length); its body is still to be read."""
  kind, n = FRAME.unpack(recv_exact(sock, FRAME.size, deadline))
  return kind, n


def read_json_body(
    sock: socket.socket, n: int, limit: int = MAX_JSON_BYTES, deadline: Optional[float] = None
) -> dict:
  """A frame's JSON object body of ``n`` bytes (its header already read); TransferError if it is
  over ``limit`` (refused before any of it is read), not JSON or not an object."""
  if n > limit:
    raise TransferError(f"control frame of {n} bytes is over the {limit}-byte limit")
  try:
    obj = json.loads(recv_exact(sock, n, deadline))
  except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
    raise TransferError("control frame is not valid JSON") from None
  if not isinstance(obj, dict):
    raise TransferError("control frame is not a JSON object")
  return obj


def recv_json(
    sock: socket.socket, limit: int = MAX_JSON_BYTES, deadline: Optional[float] = None
) -> dict:
  """Next frame as JSON; TransferError if the peer sent an error frame or something else
  (AuthenticationError if it refused to serve us for want of the secret).

  limit: the largest body accepted (a larger frame is refused before its body is read).
  deadline: time.monotonic() by which the whole frame must have arrived.
  """
  kind, n = recv_frame_header(sock, deadline)
  if kind == b"X":
    body = read_json_body(sock, n, limit, deadline)
    error = AuthenticationError if body.get("auth") else TransferError
    raise error(f"peer error: {body.get('reason')}")
  if kind != b"J":
    raise TransferError(f"expected a control frame, got {kind!r}")
  return read_json_body(sock, n, limit, deadline)


def send_error(sock: socket.socket, reason: str, auth: bool = False) -> None:
  """Best effort: tell the peer why we abort (it may already be gone); ``auth``: we refused
  its request as unauthenticated."""
  try:
    send_json(sock, {"reason": reason, **({"auth": True} if auth else {})}, kind=b"X")
  except OSError:
    pass
