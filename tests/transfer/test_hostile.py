"""A hostile peer on loopback: oversized and trickled frames, connection floods, malformed
input, nodes without a secret and a "receiver" that stalls the publisher. Every attack is a
bounded loop with small timeouts, and afterwards the honest receiver gets the next version."""

import logging
import select
import socket
import threading
import time

import psutil
import pytest

from streamrl.transfer import (
    Publisher,
    Receiver,
    TransferError,
    service,
    spawn_receiver,
    transports,
)
from streamrl.transfer.manifest import Manifest
from streamrl.transfer.topology import ReceiverInfo
from .conftest import config, make_tensors, wait_until

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
  sock = transports.connect(address, 2.0)
  transports.send_json(sock, {"op": "hello", "nonce": "ab" * transports.NONCE_BYTES})
  transports.recv_json(sock)
  return sock


def test_huge_frame_headers_cost_no_memory(cluster):
  pub = cluster.publisher(**FAST)
  r = cluster.receiver("r", join=pub, **FAST)
  proc = psutil.Process()
  before = proc.memory_info().rss
  socks = []
  try:
    for _ in range(6):  # each header claims 64 MiB: before the fix, each was allocated at once
      s = transports.connect(pub.address, 2.0)
      s.sendall(transports._FRAME.pack(b"J", transports.MAX_JSON_BYTES) + b'{"op":')
      socks.append(s)
    # A well-formed hello, then a request header far over the pre-authentication cap.
    s = _handshake(pub.address)
    s.sendall(transports._FRAME.pack(b"J", transports.MAX_JSON_BYTES))
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
  with transports.connect(pub.address, 2.0) as s:
    s.sendall(transports._FRAME.pack(b"J", 1000))  # a hello of leading whitespace, 1 B at a time
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
  with caplog.at_level(logging.WARNING, logger="streamrl.transfer.service"):
    with transports.connect(pub.address, 2.0) as s:
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
      (True, transports._FRAME.pack(b"J", len(deep)) + deep),  # after a well-formed hello
      (False, transports._FRAME.pack(b"J", 600) + b"[" * 300 + b"]" * 300),  # a deep hello
      (False, transports._FRAME.pack(b"J", 5) + b"\xff\xfe{]!"),  # not JSON
      (False, transports._FRAME.pack(b"J", 2) + b"[]"),  # not an object
      (False, transports._FRAME.pack(b"C", 4) + b"abcd"),  # not a control frame
      (False, b"J\x00\x00"),  # a cut header
  ]
  with caplog.at_level(logging.DEBUG, logger="streamrl.transfer"):
    for after_hello, data in frames:
      s = _handshake(pub.address) if after_hello else transports.connect(pub.address, 2.0)
      with s:
        s.sendall(data)
        if data == b"J\x00\x00":
          s.shutdown(socket.SHUT_WR)
        assert _closed_by_peer(s, 2.0)

    def lines():
      return [rec for rec in caplog.records if rec.name == "streamrl.transfer.service"]

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
    spawn_receiver("r", "A", service.relay_only, ("127.0.0.1", 1))


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
          conns[-1].sendall(transports._FRAME.pack(b"J", 900))
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
