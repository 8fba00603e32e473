"""The per-run secret (authenticated requests, signed manifests) and a cross-datacenter edge
emulated on one machine (no shared memory between datacenters, rate limit and deltas apply)."""

import json
import logging
import socket
import threading
import time

import numpy as np
import pytest

from streamrl.transfer import (
    AuthenticationError,
    Publisher,
    Receiver,
    TransferError,
    new_secret,
    planes,
    process,
    security,
    spawn_receiver,
    wire,
)
from streamrl.cluster import is_loopback
from streamrl.transfer.manifest import payload_size
from streamrl.transfer.shm import shm_available
from streamrl.transfer.topology import ReceiverInfo, TreeNode
from .conftest import config, make_tensors, same, wait_until

pytestmark = [pytest.mark.unit]


def _raw(address, *frames):
  """Sends JSON frames on a fresh connection as they are; returns the last frame the node
  answers before it closes the connection, (kind, JSON body)."""
  got = []
  with wire.connect(address, 2.0) as sock:
    for f in frames:
      wire.send_json(sock, f)
    try:
      while True:
        kind, n = wire.recv_frame_header(sock)
        got.append((kind, json.loads(bytes(wire.recv_exact(sock, n)))))
    except TransferError:  # closed
      pass
  return got[-1]


# ---------------------------------------------------------------- binding


def test_every_node_needs_a_secret():
  # Loopback too: any local process can reach 127.0.0.1.
  for bind in ("127.0.0.1", "localhost", "0.0.0.0", "", socket.gethostname()):
    with pytest.raises(ValueError, match=r"secret=streamrl\.transfer\.new_secret\(\)"):
      Publisher(config(), bind=bind)
    with pytest.raises(ValueError, match="needs secret="):
      Receiver("r", "A", lambda t, v: None, config=config(), bind=bind)
  with pytest.raises(ValueError, match="other machines can reach"):
    Publisher(config(), bind="0.0.0.0")
  with pytest.raises(ValueError, match="needs secret="):  # checked before a process is spawned
    spawn_receiver("r", "A", process.relay_only, ("127.0.0.1", 1), bind="0.0.0.0")
  with pytest.raises(ValueError, match="at least 16 bytes"):
    Publisher(config(), secret=b"short")
  assert all(is_loopback(b) for b in ("127.0.0.1", "127.4.5.6", "::1", "localhost"))
  assert not any(is_loopback(b) for b in ("0.0.0.0", "", "::", "10.1.2.3", "vm"))
  for bind in ("127.0.0.1", "localhost"):
    Publisher(config(), bind=bind, secret=new_secret()).close()
  s = new_secret()
  assert isinstance(s, bytes) and len(s) == 32 and s != new_secret()


# ---------------------------------------------------------------- refusing requests


def test_unauthenticated_requests_are_refused_counted_and_never_served(cluster):
  secret = new_secret()
  pub = cluster.publisher(secret=secret)
  r = cluster.receiver("r", join=pub, secret=secret)
  v = pub.publish(make_tensors(1))
  assert pub.wait_acks(v, 10) and r.loads.versions == [v]
  info = {"name": "intruder", "dc": "A", "host": "h", "address": ["127.0.0.1", 9]}
  for req in (
      {"op": "register", "info": info, "version": 0},
      {"op": "get", "want": 0, "name": "intruder", "dc": "A", "host": "h", "shm": False},
      {"op": "hello", "nonce": "00"},  # a handshake without a proper nonce
  ):
    kind, body = _raw(pub.address, req)
    assert kind == b"X" and "authentication" in body["reason"]  # an error reply, no data
  kind, body = _raw(r.address, {"op": "announce", "version": 9, "source": ["127.0.0.1", 9]})
  assert kind == b"X" and "authentication" in body["reason"]
  assert pub.stats["auth_refused"] == 3 and r.stats["auth_refused"] == 1
  assert [i.name for i in pub.receivers()] == ["r"]  # never registered
  assert r._target == v  # the forged announce was not acted on


def test_a_captured_exchange_cannot_be_replayed(cluster):
  secret = new_secret()
  pub = cluster.publisher(secret=secret)
  ping = {"op": "ping"}
  # A genuine exchange, as a holder of the secret makes it; an eavesdropper records its frames.
  with wire.connect(pub.address, 2.0) as sock:
    nc = "ab" * security.NONCE_BYTES
    wire.send_json(sock, {"op": "hello", "nonce": nc})
    ns = wire.recv_json(sock)["nonce"]
    signed = {
        **ping,
        "mac": security._mac(secret, b"request", bytes.fromhex(ns), bytes.fromhex(nc), ping),
    }
    wire.send_json(sock, signed)
    reply = wire.recv_json(sock)  # signed for this connection's nonces
  assert reply["ok"] and "mac" in reply and pub.stats.get("auth_refused", 0) == 0
  # Replaying the client's frames on a new connection: the server's nonce differs, refused.
  kind, body = _raw(pub.address, {"op": "hello", "nonce": nc}, signed)
  assert kind == b"X" and "not signed" in body["reason"] and pub.stats["auth_refused"] == 1

  # Replaying the server's frames to a new client: the client's nonce differs, not believed.
  def fake_server(sock):
    wire.recv_json(sock)  # hello
    wire.send_json(sock, {"nonce": ns})
    wire.recv_json(sock)  # request
    wire.send_json(sock, reply)  # the captured reply, mac and all

  client, server = socket.socketpair()
  t = threading.Thread(target=fake_server, args=(server,))
  t.start()
  try:
    session = security.Session.request(client, secret, ping)
    with pytest.raises(AuthenticationError, match="cannot prove"):
      session.recv_reply()
  finally:
    t.join(5)
    client.close()
    server.close()


# ---------------------------------------------------------------- never loading from impostors


def test_wrong_secret_receiver_never_loads_and_is_counted(cluster):
  pub = cluster.publisher(secret=new_secret())
  pub.publish(make_tensors(1))
  r = cluster.receiver("r", secret=new_secret())
  with pytest.raises(AuthenticationError):
    r.join(pub.address, timeout=5)
  assert r.loads.calls == [] and r.version == 0
  assert pub.stats["auth_refused"] >= 1 and pub.receivers() == []
  # A server that knows no secret (it answers the hello as a plain request): the handshake
  # fails at once, not by a timeout, and nothing is loaded.
  with socket.create_server(("127.0.0.1", 0)) as plain:

    def answer_plainly():
      conn, _ = plain.accept()
      with conn:
        wire.recv_json(conn)
        wire.send_json(conn, {"ok": True, "version": 1})

    t = threading.Thread(target=answer_plainly, daemon=True)
    t.start()
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="handshake"):
      r.join(plain.getsockname(), timeout=5)
    assert time.monotonic() - start < 2.0
    t.join(5)
  assert r.loads.calls == []


def test_a_source_without_the_secret_is_never_loaded_from(cluster, caplog):
  secret = new_secret()
  pub = cluster.publisher(secret=secret, max_retries=1)
  r = cluster.receiver("r", join=pub, secret=secret, max_retries=1)
  t1 = make_tensors(1)
  assert pub.wait_acks(pub.publish(t1), 10)
  impostor = Publisher(config(), host="trainer", secret=new_secret(), start_version=4)
  cluster.nodes.append(impostor)
  impostor.publish(make_tensors(2))  # version 5
  # The impostor cannot even announce to r: r refuses it.
  node = TreeNode(r.info)
  impostor.announce_subtree(node, impostor._grant(5, node))
  assert r.stats["auth_refused"] == 1 and r._target == 1
  # Told (by an authentic announce that makes it r's parent) to pull version 5 from a source
  # without the secret: the attempt fails on authentication, the source counts the refusal,
  # the retry at the publisher finds no version 5, and r keeps version 1.
  parent = ReceiverInfo("impostor", "A", "trainer", impostor.address)
  grant = pub._grant(5, TreeNode(parent, (node,)))
  with caplog.at_level(logging.INFO, logger="streamrl.transfer.receiver"):
    pub.request(r.address, {"op": "announce", **grant, "source": list(impostor.address)})
    assert wait_until(lambda: 5 in r._gave_up)
  assert any("attempt 1" in m and "authentication" in m for m in caplog.messages)
  assert r.version == 1 and r.loads.versions == [1] and same(r.loads.calls[0][1], t1)
  assert impostor.stats["auth_refused"] >= 1 and impostor.stats.get("served_tcp", 0) == 0


def test_a_bad_manifest_tag_is_never_loaded(cluster, monkeypatch):
  secret = new_secret()
  pub = cluster.publisher(secret=secret, use_shm=False)
  r = cluster.receiver("r", join=pub, secret=secret, use_shm=False)
  t1 = make_tensors(1)
  assert pub.wait_acks(pub.publish(t1), 10)
  real = planes._send_end

  def forged_tag(sock, payload, link, full=False):  # intact chunks, not the publisher's tag
    tag = bytearray(payload.wait_tag(link.timeout) + (link.seal(payload) if full else b""))
    tag[0] ^= 1
    sock.sendall(wire.FRAME.pack(b"E", len(tag)) + bytes(tag))
    return wire.FRAME.size + len(tag)

  monkeypatch.setattr(planes, "_send_end", forged_tag)
  v2 = pub.publish(make_tensors(2))
  assert wait_until(lambda: v2 in r._gave_up)
  assert "authentication failed" in r.last_error and "tag" in r.last_error
  assert r.version == 1 and r.loads.versions == [1]
  monkeypatch.setattr(planes, "_send_end", real)
  t3 = make_tensors(3)
  v3 = pub.publish(t3)
  assert pub.wait_acks(v3, 10) and r.loads.versions == [1, v3] and same(r.loads.calls[-1][1], t3)


# ---------------------------------------------------------------- an emulated cross-DC edge


def test_cross_dc_edge_on_one_host_with_a_secret(cluster):
  """Publisher in dc0 and two receivers in dc1, all on this machine, everyone bound to 0.0.0.0."""
  secret, host, rate = new_secret(), socket.gethostname(), 20000.0
  kw = dict(delta_cross_dc=True, cross_dc_bytes_per_s=rate, bind="0.0.0.0", secret=secret)
  pub = cluster.publisher(dc="dc0", host=host, **kw)
  b0, b1 = (cluster.receiver(f"b{i}", dc="dc1", host=host, join=pub, **kw) for i in range(2))
  plan = pub.plan()  # one edge crosses to the relay b0; b1 hangs off b0 (same host, same dc)
  assert [(c.info.name, [g.info.name for g in c.children]) for c in plan.children] == [
      ("b0", ["b1"])
  ]
  t1 = make_tensors(1)
  start = time.monotonic()
  v1 = pub.publish(t1)
  assert pub.wait_acks(v1, 20)
  elapsed = time.monotonic() - start
  st = pub.stats
  # One copy crossed, over TCP although both ends are on one host, through the rate limiter.
  assert st["served_cross_dc"] == 1 and st["served_tcp"] == 1 and "served_shm" not in st
  assert "served_local" not in st
  nbytes = payload_size(t1)
  assert st["cross_dc_limited_bytes"] == nbytes and st["cross_dc_limited_ms"] > 0
  burst = int(min(256 << 10, rate * 0.01))
  assert elapsed >= (nbytes - burst) / rate  # a lower bound: the limiter cannot be beaten
  # b1 got it from the relay in dc1, locally (shared memory: same host, same datacenter).
  assert b0.stats["served_local"] == 1 and "served_cross_dc" not in b0.stats
  local = "served_shm" if shm_available() else "served_tcp"
  assert b0.stats[local] == 1 and b1.stats["bytes_copied"] == (0 if shm_available() else nbytes)
  for r in (b0, b1):
    assert r.loads.versions == [v1] and same(r.loads.calls[0][1], t1)

  # Version 2 crosses as a delta against the relay's version 1, once.
  assert wait_until(lambda: "cross_dc_full_bytes" in pub.stats)
  full = pub.stats["cross_dc_full_bytes"]
  rng = np.random.default_rng(0)
  t2 = {
      k: (x.astype(np.float32) * (1 + (rng.random(x.shape) < 0.05) * 0.01)).astype(x.dtype)
      for k, x in t1.items()
  }
  v2 = pub.publish(t2)
  assert pub.wait_acks(v2, 20)
  assert wait_until(lambda: "cross_dc_delta_bytes" in pub.stats)
  st = pub.stats
  assert st["served_cross_dc"] == 2 and st["cross_dc_full_bytes"] == full  # not resent in full
  assert 0 < st["cross_dc_delta_bytes"] < 0.5 * full
  assert nbytes < st["cross_dc_limited_bytes"] < 1.5 * nbytes  # only the delta went through
  assert b0.stats["served_local"] == 2
  for r in (b0, b1):
    assert r.loads.versions == [v1, v2] and same(r.loads.calls[-1][1], t2)
  assert all(n.stats.get("auth_refused", 0) == 0 for n in (pub, b0, b1))
  # transfer.tls="auto" off loopback: every connection above was TLS (the relay's too).
  assert all(isinstance(n._tls, security.Tls) for n in (pub, b0, b1))


def test_spawned_receiver_with_the_secret(cluster):
  secret = new_secret()
  pub = cluster.publisher(secret=secret, bind="0.0.0.0")
  cfg = config(use_shm=False)
  proc = spawn_receiver(
      "p0",
      "A",
      process.relay_only,
      pub.address,
      config=cfg,
      bind="0.0.0.0",
      secret=secret,
      run_keys=pub.run_keys,
  )
  try:
    assert pub.wait_receivers(1, timeout=60)
    v = pub.publish(make_tensors(8))
    assert pub.wait_acks(v, timeout=20) and pub.stats.get("auth_refused", 0) == 0
  finally:
    proc.terminate()
    proc.join(10)
