"""Wire protocol, rate limiting and the data planes that move a payload over one edge.

Why TCP + shared memory (and not Ray's object store):
- The control plane and the default data plane are plain TCP streams of
  length-prefixed frames between processes: they work between any two
  machines (generators need not be Ray actors, and a relay in another
  datacenter is reached over an ordinary socket), a frame is received
  straight into the staging buffer (no intermediate copies), and nothing on
  the wire is pickled: control frames are JSON, data frames are raw
  safetensors bytes. Ray's object store would deserialize with pickle from
  the network, which is exactly what we refuse to do, and adds nothing a
  socket does not do here.
- Same-host fast path: the sender writes the payload into a POSIX
  shared-memory file once; a receiver with the same host label and the same
  datacenter label (the sender's host, or the first receiver of a remote
  host, whose staging is such a file too) gets only a small control message
  over TCP, maps the file read-only and
  verifies every chunk's checksum in place as soon as the sender reports it
  written (R frames), so verification overlaps the sender's copy. Four
  receivers then cost one copy plus four checksum passes instead of four
  copies through the kernel, and their engines load that one file.
- A TCP receiver receives each chunk straight into its staging file: the
  received bytes are the safetensors file its engines load.
- Datacenters: bytes between two datacenters always travel over TCP, even
  when both ends carry the same host label, so they go through the
  cross-datacenter rate limiter and delta encoding. One machine can thus
  emulate a real cross-datacenter edge (a publisher in dc0 and receivers in
  dc1, all on one host).

Authentication (``Session``, ``RunKeys``): every node runs with the
run's shared secret (``new_secret()``; ``check_secret`` refuses to start one
without it, on loopback too: any local process can reach 127.0.0.1) and
authenticates every connection with a
challenge-response (HMAC-SHA256 over fresh nonces from both ends and the
message), so neither a request nor a reply of a captured exchange is
accepted on another connection; a node refuses unauthenticated requests
before acting on them.

Versions only the publisher can mint: the secret is every node's, so it proves
membership of the run, never authority. The publisher makes an Ed25519 key per
run and hands its public half out with the secret (``RunKeys``, through whoever
builds the receivers); it signs every announce (``sign_grant``: the version and
the plan below one top-level child, so a receiver knows its parent) and each
version's complete manifest (``sign_manifest``): ``tag`` over every chunk's
XXH3 checksum, and for TCP edges ``full_tag`` over the manifest that also lists
every chunk's BLAKE3 digest (manifest.digest). Relays forward both unchanged
and cannot sign; a receiver verifies them before it loads anything or serves
the version on as complete, and hashes every chunk it received over TCP against
the signed digest, so the bytes themselves are what the publisher signed. A
same-host receiver checks XXH3 only: the file it maps is a regular file of its
own user with a name this service makes (payload.py).

TLS (``Tls``, ``transfer.tls``): on by default where a node binds beyond
loopback. The publisher makes one self-signed certificate and key per run
(``RunKeys.tls_cert``/``tls_key``); every node serves with them (relays serve
children too) and every client pins that certificate, so the bytes on the wire
are encrypted and only nodes of the run answer. The key is shared like the
secret: TLS keeps outsiders out, the publisher's signatures keep insiders honest.

Before a peer has proven the secret it costs little: its frames are capped
(``MAX_HELLO_BYTES``, ``MAX_REQUEST_BYTES``; buffers grow only as bytes
arrive, whatever a header claims), the whole handshake has one deadline
however the bytes are paced, and malformed input of any kind (deep nesting
included) is a TransferError. Servers bound their connections (service.py).

Frames: 1-byte kind + 8-byte big-endian body length, then the body.
  J  JSON control message (requests, replies, the response header with the manifest)
  C  chunk: 4-byte index + 1-byte encoding (delta.RAW / XOR_ZLIB / XOR_SPARSE) + 8-byte checksum
     (manifest.checksum) + 32-byte digest (manifest.digest) of the (reconstructed) chunk + data
  R  shared-memory chunk ready: 4-byte index + 8-byte checksum (the bytes are in the file)
  E  end of payload; body: the publisher's signature of the manifest (64 bytes), then on TCP
     that of the manifest with the digests (64 bytes)
  X  error: JSON {"reason": ...}; the peer aborts this transfer

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
import datetime
import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, ClassVar, Optional

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from streamrl.cluster import is_loopback
from streamrl.transfer import delta as delta_lib
from streamrl.transfer.manifest import Manifest, TransferError
from streamrl.transfer.payload import Payload, Segment, map_shared, staging_payload

Address = tuple[str, int]

_FRAME = struct.Struct("!cQ")
_CHUNK = struct.Struct("!IBQ32s")
_READY = struct.Struct("!IQ")
CHUNK_FRAME_BYTES = _FRAME.size + _CHUNK.size  # wire bytes before each chunk's data (C frame)
MAX_JSON_BYTES = 64 << 20  # an authenticated exchange's control reply (a manifest header)
# Frames read before the peer has proven the secret are small, so a stranger costs little:
# the hello (and the nonce that answers it) is ~60 bytes; the largest request is an announce
# that names the child's subtree, ~155 bytes per receiver with long host names (measured), so
# 64 KiB fits ~400 receivers below one child.
MAX_HELLO_BYTES = 1 << 10
MAX_REQUEST_BYTES = 64 << 10
_RECV_STEP = 64 << 10  # a receive buffer grows by at most its size, and only as bytes arrive
_SEND_PIECE = 256 << 10  # rate-limited sends go out in pieces this big


# ---------------------------------------------------------------- framing


def connect(address: Address, timeout: float) -> socket.socket:
  """TCP connection with Nagle off (control frames are small and latency-bound)."""
  sock = socket.create_connection(tuple(address), timeout=timeout)
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return sock


def _settimeout_until(sock: socket.socket, deadline: Optional[float]) -> None:
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
        "nodes read before authentication; raise transports.MAX_REQUEST_BYTES on every node "
        "(an announce names ~155 bytes per receiver below its child)."
    )
  _settimeout_until(sock, deadline)
  sock.sendall(_FRAME.pack(kind, len(body)) + body)


def recv_exact_into(
    sock: socket.socket, view: memoryview, deadline: Optional[float] = None
) -> None:
  """Fills ``view``; deadline: when all of it must have arrived (else each recv's own timeout)."""
  while len(view):
    _settimeout_until(sock, deadline)
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
  kind, n = _FRAME.unpack(recv_exact(sock, _FRAME.size, deadline))
  return kind, n


def _read_json_body(
    sock: socket.socket, n: int, limit: int = MAX_JSON_BYTES, deadline: Optional[float] = None
) -> dict:
  if n > limit:
    raise TransferError(f"control frame of {n} bytes is over the {limit}-byte limit")
  try:
    obj = json.loads(recv_exact(sock, n, deadline))
  except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
    raise TransferError("control frame is not valid JSON") from None
  if not isinstance(obj, dict):
    raise TransferError("control frame is not a JSON object")
  return obj


class AuthenticationError(TransferError):
  """A peer could not prove it holds the run's transfer secret (or did not try)."""


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
    body = _read_json_body(sock, n, limit, deadline)
    error = AuthenticationError if body.get("auth") else TransferError
    raise error(f"peer error: {body.get('reason')}")
  if kind != b"J":
    raise TransferError(f"expected a control frame, got {kind!r}")
  return _read_json_body(sock, n, limit, deadline)


def send_error(sock: socket.socket, reason: str, auth: bool = False) -> None:
  """Best effort: tell the peer why we abort (it may already be gone); ``auth``: we refused
  its request as unauthenticated."""
  try:
    send_json(sock, {"reason": reason, **({"auth": True} if auth else {})}, kind=b"X")
  except OSError:
    pass


# ---------------------------------------------------------------- authentication


NONCE_BYTES = 16
MIN_SECRET_BYTES = 16


def new_secret() -> bytes:
  """A fresh per-run transfer secret: give the same bytes to the Publisher and every Receiver."""
  return secrets.token_bytes(32)


def check_secret(secret: Optional[bytes], bind: str, who: str) -> bytes:
  """The secret a node at ``bind`` runs with; ValueError if it is missing or unusable.

  Loopback gets no exception: any process on the machine (another user's, a sandboxed one)
  can reach 127.0.0.1, and an unauthenticated node would serve it every version and take
  its acks.
  """
  if secret is None:
    where = "" if is_loopback(bind) else f" (it binds to {bind!r}, which other machines can reach)"
    raise ValueError(
        f"{who} needs secret=streamrl.transfer.new_secret(){where}: pass the same bytes to the "
        "Publisher and every Receiver of the run."
    )
  if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
    raise ValueError(
        f"{who}: secret must be at least {MIN_SECRET_BYTES} bytes; "
        "pass streamrl.transfer.new_secret() (the same bytes to every node of the run)."
    )
  return bytes(secret)


def _canonical(obj: dict) -> bytes:
  return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes, obj: dict) -> str:
  """HMAC-SHA256 (hex) of a message: label, the two nonces (fixed length), canonical JSON."""
  msg = b"streamrl-transfer/" + label + b"\0" + first + second + _canonical(obj)
  return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def _nonce(obj: dict) -> bytes:
  try:
    nonce = bytes.fromhex(obj.get("nonce", ""))
  except (TypeError, ValueError):
    nonce = b""
  if len(nonce) != NONCE_BYTES:
    raise AuthenticationError("authentication failed: the handshake carries no valid nonce")
  return nonce


def _check_mac(
    secret: bytes, label: bytes, first: bytes, second: bytes, obj: dict, what: str
) -> None:
  """Removes ``obj``'s "mac" and checks it against the rest; AuthenticationError if it differs."""
  got = obj.pop("mac", None)
  if not isinstance(got, str):
    raise AuthenticationError(f"authentication failed: {what}")
  try:
    want = _mac(secret, label, first, second, obj)
  except RecursionError:  # nested deeper than the encoder goes: nobody signed that
    raise AuthenticationError(f"authentication failed: {what}") from None
  if not hmac.compare_digest(got.encode(), want.encode()):
    raise AuthenticationError(f"authentication failed: {what}")


# ---------------------------------------------------------------- the publisher's keys

SIGNATURE_BYTES = 64  # Ed25519
_PUBLIC_KEY_BYTES = 32


@dataclasses.dataclass(frozen=True, repr=False)  # repr=False: tls_key is as secret as the secret
class RunKeys:
  """What every node of a run gets from the publisher, with the secret (``Publisher.run_keys``).

  publisher_key: the raw Ed25519 public key that verifies the publisher's signatures (announces,
  manifests); its private half never leaves the publisher. tls_cert / tls_key: the run's
  self-signed TLS certificate (every client pins it) and its key (every node serves with it), PEM.
  """

  publisher_key: bytes
  tls_cert: bytes
  tls_key: bytes

  def verifies(self, label: bytes, obj: dict, signature: bytes) -> bool:
    """Whether ``signature`` is the publisher's of ``obj`` under ``label`` (``_signed``)."""
    try:
      key = Ed25519PublicKey.from_public_bytes(self.publisher_key)
      key.verify(bytes(signature), _signed(label, obj))
      return True
    except (InvalidSignature, ValueError, TypeError, RecursionError):
      return False


def _signed(label: bytes, obj: dict) -> bytes:
  return b"streamrl-transfer/" + label + b"\0" + _canonical(obj)


def new_run_keys() -> tuple[Ed25519PrivateKey, RunKeys]:
  """The publisher's fresh per-run signing key and the ``RunKeys`` it hands out."""
  signer = Ed25519PrivateKey.generate()
  public = signer.public_key().public_bytes(
      serialization.Encoding.Raw, serialization.PublicFormat.Raw
  )
  tls_key = ec.generate_private_key(ec.SECP256R1())
  name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "streamrl-transfer run")])
  now = datetime.datetime.now(datetime.timezone.utc)
  cert = (
      x509.CertificateBuilder()
      .subject_name(name)
      .issuer_name(name)
      .public_key(tls_key.public_key())
      .serial_number(x509.random_serial_number())
      .not_valid_before(now - datetime.timedelta(days=1))  # clocks of a run's machines differ
      .not_valid_after(now + datetime.timedelta(days=3650))  # pinned: its lifetime is the run's
      # Self-signed and pinned: it is its own trust anchor.
      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
      .sign(tls_key, hashes.SHA256())
  )
  keys = RunKeys(
      public,
      cert.public_bytes(serialization.Encoding.PEM),
      tls_key.private_bytes(
          serialization.Encoding.PEM,
          serialization.PrivateFormat.PKCS8,
          serialization.NoEncryption(),
      ),
  )
  return signer, keys


def check_run_keys(keys: Optional[RunKeys], who: str) -> RunKeys:
  """The publisher's keys a receiver runs with; ValueError if they are missing or unusable."""
  if not isinstance(keys, RunKeys) or len(keys.publisher_key) != _PUBLIC_KEY_BYTES:
    raise ValueError(
        f"{who} needs run_keys=publisher.run_keys: pass the Publisher's keys to every Receiver "
        "of the run, with the secret."
    )
  return keys


def sign_manifest(signer: Ed25519PrivateKey, manifest: Manifest) -> bytes:
  """The publisher's Ed25519 signature of a complete manifest: version, layout, every chunk's
  checksum and, when the manifest lists them, every chunk's digest (``tag`` / ``full_tag``)."""
  return signer.sign(_signed(b"manifest", manifest.to_json()))


def sign_grant(signer: Ed25519PrivateKey, grant: dict) -> str:
  """The publisher's signature (hex) of an announce's grant: {"version", "publisher", "tree"}."""
  return signer.sign(_signed(b"announce", grant)).hex()


def tls_enabled(mode: str, bind: str) -> bool:
  """``transfer.tls``: "auto" is on where ``bind`` is reachable from other machines."""
  return mode == "on" or (mode == "auto" and not is_loopback(bind))


_TLS_RECORD_HANDSHAKE = b"\x16"  # the first byte of every TLS ClientHello


class Tls:
  """TLS 1.3 with the run's certificate: servers present it, clients pin it (no CA, no names)."""

  def __init__(self, keys: RunKeys):
    self.server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    self.server.minimum_version = ssl.TLSVersion.TLSv1_3
    # The ssl module loads a key only from a file: a private directory, gone once it is read.
    with tempfile.TemporaryDirectory(prefix="streamrl-tls-") as d:
      path = os.path.join(d, "run.pem")
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
      with os.fdopen(fd, "wb") as f:
        f.write(keys.tls_key + keys.tls_cert)
      self.server.load_cert_chain(path)
    self.client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    self.client.minimum_version = ssl.TLSVersion.TLSv1_3
    self.client.check_hostname = False  # the pinned certificate is the identity, not a name
    self.client.verify_mode = ssl.CERT_REQUIRED
    self.client.load_verify_locations(cadata=keys.tls_cert.decode())
    self._pinned = x509.load_pem_x509_certificate(keys.tls_cert).public_bytes(
        serialization.Encoding.DER
    )

  def accept(self, conn: socket.socket, deadline: float) -> ssl.SSLSocket:
    """Server side, before anything else is read: TransferError for a plain peer (told so in a
    plain error frame) or a failed handshake; the whole of it by ``deadline``."""
    _settimeout_until(conn, deadline)
    first = conn.recv(1, socket.MSG_PEEK)
    if first != _TLS_RECORD_HANDSHAKE:
      send_error(
          conn,
          "this node speaks TLS (transfer.tls); give every node of the run the same "
          "transfer.tls and transfer.bind",
      )
      raise TransferError("a plain connection to a TLS node; refused")
    tls = self.server.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
    try:
      _tls_handshake(tls, deadline)
    except BaseException:
      tls.close()
      raise
    return tls

  def connect(self, sock: socket.socket, deadline: float) -> ssl.SSLSocket:
    """Client side: the TLS connection over ``sock``; AuthenticationError unless the server
    presents the run's certificate."""
    tls = self.client.wrap_socket(sock, server_side=False, do_handshake_on_connect=False)
    try:
      try:
        _tls_handshake(tls, deadline)
      except ssl.SSLCertVerificationError:
        raise AuthenticationError(
            "authentication failed: the peer's TLS certificate is not this run's; give every "
            "node the publisher's run_keys"
        ) from None
      except (ssl.SSLError, ConnectionError) as e:
        raise TransferError(
            f"TLS handshake failed ({e}); give every node of the run the same transfer.tls and "
            "transfer.bind"
        ) from None
      if not hmac.compare_digest(tls.getpeercert(binary_form=True) or b"", self._pinned):
        raise AuthenticationError(
            "authentication failed: the peer's TLS certificate is not this run's; give every "
            "node the publisher's run_keys"
        )
    except BaseException:
      tls.close()
      raise
    return tls


def _tls_handshake(tls: ssl.SSLSocket, deadline: float) -> None:
  """Drives the handshake without blocking, so it ends by ``deadline`` however the peer paces
  its bytes (a blocking one waits per read, which a trickle stretches)."""
  tls.setblocking(False)
  try:
    while True:
      try:
        tls.do_handshake()
        return
      except ssl.SSLWantReadError:
        want = ([tls], [])
      except ssl.SSLWantWriteError:
        want = ([], [tls])
      left = deadline - time.monotonic()
      if left <= 0:
        raise TransferError("the peer did not finish the TLS handshake before its deadline")
      select.select(*want, [], left)
  finally:
    tls.setblocking(True)


class Session:
  """One connection's request and reply, authenticated with the run's secret (every node has
  one: ``check_secret``), mutually, per connection, nothing replayable:
    client -> server  {"op": "hello", "nonce": Nc}
    server -> client  {"nonce": Ns}
    client -> server  request + "mac": HMAC(secret, "request" | Ns | Nc | request)
    server -> client  reply + "mac": HMAC(secret, "reply" | Nc | Ns | reply)
  Both nonces are fresh random bytes, so a captured exchange proves nothing
  on another connection; the server refuses a request whose mac is wrong
  before acting on it, and the client believes no reply whose mac is wrong.
  A request without a reply (ack, nack, suspect) is authenticated the same way.
  """

  def __init__(self, sock: socket.socket, secret: bytes, client_nonce=b"", server_nonce=b""):
    self.sock, self.secret = sock, secret
    self._nc, self._ns = client_nonce, server_nonce

  @classmethod
  def accept(
      cls, sock: socket.socket, secret: bytes, deadline: Optional[float] = None
  ) -> tuple["Session", dict]:
    """Server side: (session, the verified request). AuthenticationError if it is not authentic.

    Everything read here comes from a peer that has proven nothing yet: each frame is capped
    (MAX_HELLO_BYTES, MAX_REQUEST_BYTES) and the whole exchange must end by ``deadline``
    (time.monotonic()), however the peer paces its bytes.
    """
    hello = recv_json(sock, MAX_HELLO_BYTES, deadline)
    if hello.get("op") != "hello":
      raise AuthenticationError(
          "authentication required: this node serves only requests signed with the run's "
          "transfer secret"
      )
    nc, ns = _nonce(hello), secrets.token_bytes(NONCE_BYTES)
    send_json(sock, {"nonce": ns.hex()}, deadline=deadline)
    req = recv_json(sock, MAX_REQUEST_BYTES, deadline)
    _check_mac(
        secret,
        b"request",
        ns,
        nc,
        req,
        "the request is not signed with this node's transfer secret",
    )
    return cls(sock, secret, nc, ns), req

  @classmethod
  def request(
      cls,
      sock: socket.socket,
      secret: bytes,
      obj: dict,
      deadline: Optional[float] = None,
  ) -> "Session":
    """Client side: sends ``obj`` after the handshake, all of it by ``deadline``
    (time.monotonic()): whoever answers at the address may be anyone."""
    nc = secrets.token_bytes(NONCE_BYTES)
    send_json(sock, {"op": "hello", "nonce": nc.hex()}, deadline=deadline)
    try:
      ns = _nonce(recv_json(sock, MAX_HELLO_BYTES, deadline))
    except AuthenticationError:
      raise
    except TransferError as e:
      raise AuthenticationError(
          f"authentication handshake failed ({e}); does the peer run with this run's secret?"
      ) from None
    signed = {**obj, "mac": _mac(secret, b"request", ns, nc, obj)}
    send_json(sock, signed, deadline=deadline, limit=MAX_REQUEST_BYTES)
    return cls(sock, secret, nc, ns)

  def reply(self, obj: dict) -> None:
    """Server side: the reply to the request, signed."""
    send_json(self.sock, {**obj, "mac": _mac(self.secret, b"reply", self._nc, self._ns, obj)})

  def recv_reply(self, deadline: Optional[float] = None) -> dict:
    """Client side: the server's reply (whole by ``deadline``, if given); AuthenticationError
    unless it proves the secret. Its buffer grows only as the bytes arrive."""
    obj = recv_json(self.sock, MAX_JSON_BYTES, deadline)
    _check_mac(
        self.secret,
        b"reply",
        self._nc,
        self._ns,
        obj,
        "the peer cannot prove it holds this run's transfer secret",
    )
    return obj


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
  """Moves one payload over one edge; the control plane (service.py) is the same for all planes."""

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


MAX_TAG_BYTES = 2 * SIGNATURE_BYTES


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
  sock.sendall(_FRAME.pack(b"E", len(tag)) + tag)
  return _FRAME.size + len(tag)


def _recv_end(sock: socket.socket) -> tuple[int, bytes]:
  kind, n = recv_frame_header(sock)
  if kind == b"X":
    raise TransferError(f"sender aborted: {_read_json_body(sock, n).get('reason')}")
  if kind != b"E":
    raise TransferError(f"expected end of payload, got frame {kind!r}")
  if n > MAX_TAG_BYTES:
    raise TransferError(f"end frame of {n} bytes is too large")
  return _FRAME.size + n, bytes(recv_exact(sock, n))


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
      head = _FRAME.pack(b"C", _CHUNK.size + len(data)) + _CHUNK.pack(
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
        raise TransferError(f"sender aborted: {_read_json_body(sock, n).get('reason')}")
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
      received += _FRAME.size + n
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
          _FRAME.pack(b"R", _READY.size) + _READY.pack(i, payload.checksums[i])
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
    # (map_shared); the receiver refuses this plane where it did not ask for it (service.py).
    return map_shared(str(header.get("shm", "")), manifest)

  def fill(self, sock, header, payload, base, timeout):
    # Chunks are verified as the writer reports them written, also in a recycled file it is
    # still rewriting (no pin can start then): while this stream is open the sender neither
    # recycles the file nor writes a reported chunk again. The pin is taken before the stream
    # ends (the "P" frame), so no chunk verified here can change afterwards.
    for i in range(payload.manifest.num_chunks):
      kind, n = recv_frame_header(sock)
      if kind == b"X":
        raise TransferError(f"sender aborted: {_read_json_body(sock, n).get('reason')}")
      if kind != b"R" or n != _READY.size:
        raise TransferError(f"expected chunk {i} ready, got frame {kind!r}")
      idx, expected = _READY.unpack(recv_exact(sock, n))
      if idx != i:
        raise TransferError(f"expected chunk {i}, got chunk {idx}")
      payload.commit(i, expected)
    if payload.pin is not None:
      payload.pin.hold(timeout)  # waits for the writer's end_rewrite, right after its last chunk
    sock.sendall(_FRAME.pack(b"P", 0))
    n, tag = _recv_end(sock)
    return (_FRAME.size + _READY.size) * payload.manifest.num_chunks + _FRAME.size + n, tag


PLANES: dict[str, DataPlane] = {p.name: p for p in (ShmPlane(), TcpPlane())}  # preference order


def choose_plane(
    payload: Payload, request: dict, server_host: str, server_dc: str, use_shm: bool
) -> tuple[DataPlane, dict]:
  for plane in PLANES.values():
    fields = plane.offer(payload, request, server_host, server_dc, use_shm)
    if fields is not None:
      return plane, fields
  raise TransferError("no data plane can reach this client")
