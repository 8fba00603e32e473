"""Who may do what: the run's secret, the publisher's keys and TLS.

Authentication (``Session``): every node runs with the run's shared secret
(``new_secret()``; ``check_secret`` refuses to start one without it, on
loopback too: any local process can reach 127.0.0.1) and authenticates every
connection with a challenge-response (HMAC-SHA256 over fresh nonces from both
ends and the message), so neither a request nor a reply of a captured exchange
is accepted on another connection; a node refuses unauthenticated requests
before acting on them.

Versions only the publisher can mint (``RunKeys``): the secret is every node's,
so it proves membership of the run, never authority. The publisher makes an
Ed25519 key per run and hands its public half out with the secret (through
whoever builds the receivers); it signs every announce (``sign_grant``: the
version and the plan below one top-level child, so a receiver knows its parent)
and each version's complete manifest (``sign_manifest``): ``tag`` over every
chunk's XXH3 checksum, and for TCP edges ``full_tag`` over the manifest that
also lists every chunk's BLAKE3 digest (manifest.digest). Relays forward both
unchanged and cannot sign; a receiver verifies them before it loads anything or
serves the version on as complete, and hashes every chunk it received over TCP
against the signed digest, so the bytes themselves are what the publisher
signed. A same-host receiver checks XXH3 only: the file it maps is a regular
file of its own user with a name this service makes (shm.py).

TLS (``Tls``, ``transfer.tls``): on by default where a node binds beyond
loopback. The publisher makes one self-signed certificate and key per run
(``RunKeys.tls_cert``/``tls_key``); every node serves with them (relays serve
children too) and every client pins that certificate, so the bytes on the wire
are encrypted and only nodes of the run answer. The key is shared like the
secret: TLS keeps outsiders out, the publisher's signatures keep insiders honest.
"""

from __future__ import annotations

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
import tempfile
import time
from typing import Optional

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from streamrl.cluster import is_loopback
from streamrl.transfer.manifest import Manifest, TransferError
from streamrl.transfer.wire import (
    MAX_HELLO_BYTES,
    MAX_JSON_BYTES,
    MAX_REQUEST_BYTES,
    AuthenticationError,
    recv_json,
    send_error,
    send_json,
    settimeout_until,
)

# ---------------------------------------------------------------- the run's secret


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


# ---------------------------------------------------------------- TLS


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
    settimeout_until(conn, deadline)
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


# ---------------------------------------------------------------- authenticated exchanges


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
