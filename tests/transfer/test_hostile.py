"""A hostile peer on loopback: oversized and trickled frames, connection floods, malformed
input, nodes without a secret and a "receiver" that stalls the publisher. Every attack is a
bounded loop with small timeouts, and afterwards the honest receiver gets the next version."""

import dataclasses
import logging
import select
import socket
import threading
import time

import psutil
import pytest

from streamrl.transfer import (
    AuthenticationError,
    Publisher,
    Receiver,
    TransferError,
    planes,
    process,
    security,
    spawn_receiver,
    wire,
)
from streamrl.transfer import manifest as manifest_lib
from streamrl.transfer.manifest import Manifest
from streamrl.transfer.topology import ReceiverInfo, TreeNode
from .conftest import NAMES, config, make_tensors, same, wait_until

pytestmark = [pytest.mark.unit]

FAST = dict(handshake_timeout_s=0.5, io_timeout_s=2.0, connect_timeout_s=0.5)


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
  """True once the other end has closed ``sock`` (EOF or reset) within ``timeout`` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    ready, _, _ = select.select([sock], [], [], 0.05)
    if ready:
      try:
        if not sock.recv(1 << 16):
          return True
      except OSError:
        return True
  return False


def _honest_round(pub, r, seed: int) -> None:
  """The attack left the node serving: the honest receiver loads the next version."""
  v = pub.publish(make_tensors(seed))
  assert r.wait_version(v, 10), r.last_error
  assert r.loads.versions[-1] == v


def _handshake(address) -> socket.socket:
  """A connection that has sent a well-formed hello and read the server's nonce (no secret)."""
  sock = wire.connect(address, 2.0)
  wire.send_json(sock, {"op": "hello", "nonce": "ab" * security.NONCE_BYTES})
  wire.recv_json(sock)
  return sock


def test_huge_frame_headers_cost_no_memory(cluster):
  pub = cluster.publisher(**FAST)
  r = cluster.receiver("r", join=pub, **FAST)
  proc = psutil.Process()
  before = proc.memory_info().rss
  socks = []
  try:
    for _ in range(6):  # each header claims 64 MiB: before the fix, each was allocated at once
      s = wire.connect(pub.address, 2.0)
      s.sendall(wire.FRAME.pack(b"J", wire.MAX_JSON_BYTES) + b'{"op":')
      socks.append(s)
    # A well-formed hello, then a request header far over the pre-authentication cap.
    s = _handshake(pub.address)
    s.sendall(wire.FRAME.pack(b"J", wire.MAX_JSON_BYTES))
    socks.append(s)
    time.sleep(0.3)  # the server has read every header by now
    grown = proc.memory_info().rss - before
    assert grown < 20 << 20, f"RSS grew by {grown >> 20} MiB"
    assert all(_closed_by_peer(s, 2.0) for s in socks)  # refused at the header, not held
  finally:
    for s in socks:
      s.close()
  _honest_round(pub, r, 1)


def test_a_trickled_handshake_is_cut_at_its_deadline(cluster):
  pub = cluster.publisher(**FAST)  # io_timeout_s=2 per recv would never cut a 20 Hz trickle
  r = cluster.receiver("r", join=pub, **FAST)
  with wire.connect(pub.address, 2.0) as s:
    s.sendall(wire.FRAME.pack(b"J", 1000))  # a hello of leading whitespace, 1 B at a time
    start, cut = time.monotonic(), None
    while time.monotonic() - start < 3.0:
      try:
        s.sendall(b" ")
      except OSError:
        cut = time.monotonic() - start
        break
      if _closed_by_peer(s, 0.05):
        cut = time.monotonic() - start
        break
  assert cut is not None and 0.3 < cut < 1.5, cut
  _honest_round(pub, r, 2)


def test_idle_connections_are_capped_per_peer_and_in_total(cluster):
  caps = dict(FAST, handshake_timeout_s=5.0, max_connections=6, max_connections_per_peer=4)
  pub = cluster.publisher(**caps)
  r = cluster.receiver("r", join=pub, **FAST)
  threads = threading.active_count()
  socks = []
  try:
    # 20 from 127.0.0.1 (4 admitted), then 10 from 127.0.0.2 (2 more fill the node).
    for source, n in (("127.0.0.1", 20), ("127.0.0.2", 10)):
      for _ in range(n):
        socks.append(socket.create_connection(pub.address, 2.0, source_address=(source, 0)))
    assert wait_until(lambda: pub.stats.get("connections_refused", 0) >= 24, 5)
    assert pub.stats["connections_refused"] == 24 and pub._serving == 6
    assert threading.active_count() <= threads + 6  # a bounded pool, not a thread per connection
  finally:
    for s in socks:
      s.close()
  assert wait_until(lambda: pub._serving == 0, 5)  # the idle ones hung up: their slots are free
  _honest_round(pub, r, 3)


def test_the_accept_loop_survives_a_failed_submit(cluster, monkeypatch, caplog):
  pub = cluster.publisher(**FAST)
  r = cluster.receiver("r", join=pub, **FAST)
  real, failures = pub._conn_pool.submit, []

  def submit_fails_once(*args, **kwargs):
    if not failures:
      failures.append(1)
      raise RuntimeError("can't start new thread")
    return real(*args, **kwargs)

  monkeypatch.setattr(pub._conn_pool, "submit", submit_fails_once)
  with caplog.at_level(logging.WARNING, logger="streamrl.transfer.node"):
    with wire.connect(pub.address, 2.0) as s:
      assert _closed_by_peer(s, 2.0)  # that one connection is closed...
  assert failures and pub._accept_thread.is_alive()
  assert wait_until(lambda: pub._serving == 0, 2)  # its slot was freed (r's ack may be in flight)
  took = [rec for rec in caplog.records if "could not take a connection" in rec.getMessage()]
  assert len(took) == 1 and took[0].exc_info is None
  late = cluster.receiver("late", join=pub, **FAST)  # ...and the node still accepts
  _honest_round(pub, r, 4)
  assert late.wait_version(r.version, 10), late.last_error


def test_malformed_input_is_one_log_line_without_a_traceback(cluster, caplog):
  pub = cluster.publisher(**FAST)
  r = cluster.receiver("r", join=pub, **FAST)
  deep = b"[" * 30000 + b"]" * 30000  # within the request cap, far deeper than the parser goes
  frames = [
      (True, wire.FRAME.pack(b"J", len(deep)) + deep),  # after a well-formed hello
      (False, wire.FRAME.pack(b"J", 600) + b"[" * 300 + b"]" * 300),  # a deep hello
      (False, wire.FRAME.pack(b"J", 5) + b"\xff\xfe{]!"),  # not JSON
      (False, wire.FRAME.pack(b"J", 2) + b"[]"),  # not an object
      (False, wire.FRAME.pack(b"C", 4) + b"abcd"),  # not a control frame
      (False, b"J\x00\x00"),  # a cut header
  ]
  with caplog.at_level(logging.DEBUG, logger="streamrl.transfer"):
    for after_hello, data in frames:
      s = _handshake(pub.address) if after_hello else wire.connect(pub.address, 2.0)
      with s:
        s.sendall(data)
        if data == b"J\x00\x00":
          s.shutdown(socket.SHUT_WR)
        assert _closed_by_peer(s, 2.0)

    def lines():
      return [rec for rec in caplog.records if rec.name == "streamrl.transfer.node"]

    assert wait_until(lambda: len(lines()) >= len(frames), 3)
    time.sleep(0.1)
    assert len(lines()) == len(frames), [rec.getMessage() for rec in lines()]
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
  assert "not valid JSON" in lines()[0].getMessage()
  _honest_round(pub, r, 5)


@pytest.mark.parametrize("shape", [[2**32, 2**32], [2**62, 4], [2**70]])
def test_oversized_shapes_are_a_transfer_error(shape):
  # [2**32, 2**32] wrapped to 0 bytes in int64 and was accepted; [2**70] overflowed.
  d = {"version": 1, "total_bytes": 1024, "chunk_bytes": 1024, "tensors": [["w", shape, "F32"]]}
  with pytest.raises(TransferError, match="malformed manifest"):
    Manifest.from_json(d)


def test_nodes_without_a_secret_refuse_to_start():
  with pytest.raises(ValueError, match=r"needs secret=streamrl\.transfer\.new_secret\(\)"):
    Publisher(config())
  with pytest.raises(ValueError, match=r"needs secret=streamrl\.transfer\.new_secret\(\)"):
    Receiver("r", "A", lambda t, v: None, config=config())
  with pytest.raises(ValueError, match="needs secret="):
    spawn_receiver("r", "A", process.relay_only, ("127.0.0.1", 1))


def test_publish_returns_while_a_hostile_receiver_trickles(cluster):
  pub = cluster.publisher(**FAST)
  r = cluster.receiver("r", join=pub, **FAST)
  stop = threading.Event()
  evil = socket.create_server(("127.0.0.1", 0))
  evil.settimeout(0.1)

  def trickle():  # answers every hello with a nonce frame, one byte per 50 ms, for 4 s at most
    conns, end = [], time.monotonic() + 4.0
    try:
      while not stop.is_set() and time.monotonic() < end:
        try:
          conns.append(evil.accept()[0])
          conns[-1].sendall(wire.FRAME.pack(b"J", 900))
        except socket.timeout:
          pass
        for c in conns:
          try:
            c.sendall(b" ")
          except OSError:
            pass
        stop.wait(0.05)
    finally:
      for c in conns:
        c.close()

  t = threading.Thread(target=trickle, daemon=True)
  t.start()
  try:
    pub.add_receiver(ReceiverInfo("evil", "A", "evil-host", evil.getsockname()))
    start = time.monotonic()
    v = pub.publish(make_tensors(6))
    took = time.monotonic() - start
    assert took < 1.5, f"publish took {took:.1f}s"
    assert r.wait_version(v, 10), r.last_error
    # The trickler is cut at the client's deadline and marked dead, so acks settle without it.
    assert pub.wait_acks(v, 5) and "evil" not in [i.name for i in pub.receivers()]
  finally:
    stop.set()
    t.join(5)
    evil.close()
  _honest_round(pub, r, 7)


# ---------------------------------------------------------------- versions only the publisher mints


def test_a_version_minted_without_the_signing_key_is_refused(cluster):
  pub = cluster.publisher(use_shm=False, **FAST)
  r = cluster.receiver("r", join=pub, use_shm=False, **FAST)
  _honest_round(pub, r, 1)
  # A node of the run (the secret, so its manifests carry what used to be a valid HMAC tag) that
  # signs with a key of its own: its announce of a version of its own is ignored...
  mint = Publisher(
      config(use_shm=False, **FAST), host="mint", secret=cluster.secret, start_version=1
  )
  cluster.nodes.append(mint)
  assert mint.publish(make_tensors(99)) == 2  # its own "version 2"
  node = TreeNode(r.info)
  mint.announce_subtree(node, mint._grant(1000001, node))
  assert r.stats["announces_refused"] == 1 and r._target == 1
  # ...and so is its version 2 where the publisher's plan made it r's parent: r refuses the
  # forgery and falls back to the publisher's version 2.
  pub.forget("r")  # r is not in version 2's plan: only the forged announce reaches it
  t2 = make_tensors(2)
  assert pub.publish(t2) == 2
  parent = ReceiverInfo("mint", "A", "mint", mint.address)
  grant = pub._grant(2, TreeNode(parent, (node,)))
  mint.request(r.address, {"op": "announce", **grant, "source": list(mint.address)})
  assert r.wait_version(2, 10), r.last_error
  assert same(r.loads.calls[-1][1], t2) and r.stats["failed_attempts"] == 1
  assert mint.stats["served_tcp"] == 1 and r.loads.versions == [1, 2]
  assert wait_until(lambda: pub.acked_versions()["r"] == 2)  # its ack makes it live again
  _honest_round(pub, r, 3)


def test_a_bogus_high_version_does_not_stall_a_receiver(cluster):
  pub = cluster.publisher(**FAST)
  r = cluster.receiver("r", join=pub, max_retries=0, **FAST)
  evil = cluster.receiver("evil", **FAST)  # holds the secret; it never joined, so it has nothing
  _honest_round(pub, r, 1)
  bogus = 10**15
  legacy = {"version": bogus, "publisher": list(evil.address), "children": []}
  # From a node that is not r's parent: unsigned, and a signed plan that names another parent.
  other = ReceiverInfo("other", "A", "other", ("127.0.0.1", 9))
  for signed in ({}, pub._grant(bogus, TreeNode(other, (TreeNode(r.info),)))):
    evil.request(r.address, {"op": "announce", **legacy, **signed, "source": list(evil.address)})
  assert r.stats["announces_refused"] == 2 and r._target == 1
  # From r's parent in a signed plan, whose fetch then fails: r gives the version up and the
  # next real version still arrives.
  parent = ReceiverInfo("evil", "A", "evil", evil.address)
  grant = pub._grant(bogus, TreeNode(parent, (TreeNode(r.info),)))
  evil.request(r.address, {"op": "announce", **legacy, **grant, "source": list(evil.address)})
  assert wait_until(lambda: bogus in r._gave_up and not r._fetching, 5)
  assert r._target == 1
  _honest_round(pub, r, 2)


def test_a_tcp_receiver_checks_each_chunk_against_the_signed_digest(cluster, monkeypatch):
  pub = cluster.publisher(use_shm=False, **FAST)
  r = cluster.receiver("r", join=pub, use_shm=False, max_retries=0, **FAST)
  _honest_round(pub, r, 1)
  real_sum, real_send, collisions = manifest_lib.checksum, planes.TcpPlane.send, {}

  class Tampered:
    """Version 2 as a serving path that flips a byte of chunk 0 would send it."""

    def __init__(self, payload):
      self._p = payload

    def __getattr__(self, name):
      return getattr(self._p, name)

    def chunk(self, i):
      view = self._p.chunk(i)
      if i != 0:
        return view
      forged = bytearray(view)
      forged[-1] ^= 1
      collisions[bytes(forged)] = real_sum(view)  # XXH3 "collides": the check cannot tell
      return memoryview(forged)

  def send(plane, sock, payload, link):
    return real_send(plane, sock, Tampered(payload) if payload.version == 2 else payload, link)

  monkeypatch.setattr(manifest_lib, "checksum", lambda b: collisions.get(bytes(b)) or real_sum(b))
  monkeypatch.setattr(planes.TcpPlane, "send", send)
  v2 = pub.publish(make_tensors(2))
  assert wait_until(lambda: v2 in r._gave_up and not r._fetching, 5)
  assert collisions and "chunk 0" in r.last_error and "digest does not match" in r.last_error
  assert r.version == 1 and r.loads.versions == [1]
  monkeypatch.undo()
  _honest_round(pub, r, 3)


# ---------------------------------------------------------------- TLS


class _Tap:
  """A forwarding proxy in front of ``upstream`` that keeps every byte it forwards."""

  def __init__(self, upstream):
    self.upstream, self.seen = upstream, bytearray()
    self._server = socket.create_server(("127.0.0.1", 0))
    self.address = self._server.getsockname()[:2]
    threading.Thread(target=self._accept, daemon=True).start()

  def _accept(self):
    while True:
      try:
        conn, _ = self._server.accept()
      except OSError:
        return
      up = socket.create_connection(self.upstream, 2.0)
      for a, b in ((conn, up), (up, conn)):
        threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

  def _pump(self, src, dst):
    try:
      while data := src.recv(1 << 16):
        self.seen += data
        dst.sendall(data)
    except OSError:
      pass
    finally:
      for s in (src, dst):
        try:
          s.shutdown(socket.SHUT_RDWR)
        except OSError:
          pass

  def close(self):
    self._server.close()


def test_tls_refuses_plain_peers_and_encrypts_the_wire(cluster):
  assert security.tls_enabled("auto", "0.0.0.0") and not security.tls_enabled("auto", "::1")
  with pytest.raises(ValueError, match="transfer.tls"):
    config(tls="yes").check()
  pub = cluster.publisher(use_shm=False, tls="on", **FAST)
  t1 = make_tensors(1)
  pub.publish(t1)
  # A client that speaks plain TCP (it even holds the secret) is refused before its request.
  with wire.connect(pub.address, 2.0) as s, pytest.raises(AuthenticationError, match="TLS"):
    security.Session.request(s, cluster.secret, {"op": "ping"})
  assert wait_until(lambda: pub.stats.get("tls_refused") == 1)
  assert "auth_refused" not in pub.stats
  tap = _Tap(pub.address)  # everything r and the publisher say to each other goes through it
  try:
    r = cluster.receiver("r", use_shm=False, tls="on", **FAST)
    assert r.join(tap.address, timeout=5) == 1 and same(r.loads.calls[0][1], t1)
  finally:
    tap.close()
  seen = bytes(tap.seen)
  raw = t1[NAMES[1]].tobytes()
  assert len(seen) > len(raw) and seen[:1] == b"\x16"  # a TLS handshake record
  for plain in (raw[:64], raw[-64:], NAMES[1].encode(), b'"op"', b'"register"'):
    assert plain not in seen


def test_a_receiver_that_pins_another_certificate_refuses(cluster):
  pub = cluster.publisher(tls="on", **FAST)
  pub.publish(make_tensors(1))
  _, theirs = security.new_run_keys()
  wrong = dataclasses.replace(pub.run_keys, tls_cert=theirs.tls_cert, tls_key=theirs.tls_key)
  r = cluster.receiver("r", tls="on", run_keys=wrong, **FAST)
  with pytest.raises(AuthenticationError, match="TLS certificate is not this run's"):
    r.join(pub.address, timeout=5)
  assert r.loads.calls == [] and r.version == 0 and pub.receivers() == []
