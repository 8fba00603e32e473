"""End to end on localhost, receivers in threads: delivery, verification, versions, faults."""

import os
import threading
import time

import numpy as np
import pytest

from streamrl.transfer import SchemaMismatch, TransferError, planes, schema_of
from streamrl.transfer import publisher as publisher_lib
from streamrl.transfer.manifest import payload_size
from .conftest import NAMES, make_tensors, same, wait_until

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("use_shm", [True, False])
def test_tree_delivers_verified_version_to_everyone(cluster, use_shm):
  pub = cluster.publisher(use_shm=use_shm)
  rs = [
      cluster.receiver(f"r{i}", host="trainer" if i < 2 else None, join=pub, use_shm=use_shm)
      for i in range(5)
  ]
  t = make_tensors(1)
  v = pub.publish(t)
  assert v == 1 and pub.wait_acks(v, timeout=10)
  for r in rs:
    assert r.version == 1 and r.loads.versions == [1] and same(r.loads.calls[0][1], t)
  assert pub.stats.get("served_shm", 0) == (2 if use_shm else 0)


def test_corrupted_chunk_is_detected_and_never_loaded(cluster, monkeypatch):
  pub = cluster.publisher()
  rs = [
      cluster.receiver("same-host", host="trainer", join=pub),
      cluster.receiver("remote", join=pub),
  ]
  v1 = pub.publish(make_tensors(1))
  assert pub.wait_acks(v1, 10)
  real = publisher_lib.fill_payload

  def corrupt(
      tensors, manifest, out
  ):  # damage chunk 3 of the published bytes after checksumming it
    for i, value in enumerate(real(tensors, manifest, out)):
      if i == 3:
        out[3 * manifest.chunk_bytes + 5] ^= 0x01
      yield value

  monkeypatch.setattr(publisher_lib, "fill_payload", corrupt)
  v2 = pub.publish(make_tensors(2))
  for r in rs:
    assert wait_until(lambda: v2 in r._gave_up)
    assert r.version == v1 and r.loads.versions == [v1]  # never loaded, still serving v1
    assert "chunk 3" in r.last_error and "corrupted" in r.last_error
    assert r.stats["failed_attempts"] == 3  # 1 + max_retries, shm then TCP
    assert wait_until(lambda: r.name in pub.errors) and "corrupted" in pub.errors[r.name]
  assert not pub.wait_acks(v2, timeout=0.1)
  monkeypatch.setattr(publisher_lib, "fill_payload", real)
  t3 = make_tensors(3)
  v3 = pub.publish(t3)
  assert pub.wait_acks(v3, 10)
  assert all(r.loads.versions == [v1, v3] and same(r.loads.calls[-1][1], t3) for r in rs)


def test_damage_on_the_wire_is_retried_and_then_loaded_exactly(cluster, monkeypatch):
  pub = cluster.publisher(use_shm=False)
  r = cluster.receiver("r0", join=pub)
  real = planes.send_limited
  flips = []

  def flaky(sock, data, limiters):
    if not flips:  # the first chunk ever sent arrives with one bit flipped
      flips.append(1)
      data = bytearray(data)
      data[7] ^= 0x40
      data = memoryview(data)
    real(sock, data, limiters)

  monkeypatch.setattr(planes, "send_limited", flaky)
  t = make_tensors(4)
  v = pub.publish(t)
  assert pub.wait_acks(v, 10)
  assert r.loads.versions == [v] and same(r.loads.calls[0][1], t)
  assert r.stats["failed_attempts"] == 1


def test_interrupted_transfer_leaves_the_old_version(cluster, monkeypatch):
  pub = cluster.publisher(use_shm=False)
  r = cluster.receiver("r0", join=pub)
  child = cluster.receiver("child", join=pub)
  v1 = pub.publish(make_tensors(1))
  assert pub.wait_acks(v1, 10)
  real = planes.send_limited
  sent = {}

  def cut_halfway(sock, data, limiters):  # every stream dies after 4 of its 8 chunks
    sent[sock] = sent.get(sock, 0) + 1
    if sent[sock] > 4:
      sock.shutdown(2)
      raise ConnectionResetError("sender killed")
    real(sock, data, limiters)

  monkeypatch.setattr(planes, "send_limited", cut_halfway)
  v2 = pub.publish(make_tensors(2))
  assert wait_until(lambda: v2 in r._gave_up and v2 in child._gave_up)
  for x in (r, child):
    assert x.version == v1 and x.loads.versions == [v1]
    assert "closed mid-transfer" in x.last_error or "failed" in x.last_error
    assert x._current.version == v1 and x._inflight is None  # old version kept and served
  monkeypatch.setattr(planes, "send_limited", real)
  late = cluster.receiver("late")  # a peer can still pull v1 from r
  assert late._fetch_from(r.address, 1, use_shm=False) == v1 and late.loads.versions == [v1]


def test_versions_stay_monotonic_under_concurrent_publishes(cluster):
  pub = cluster.publisher()
  rs = [cluster.receiver(f"r{i}", host="trainer" if i == 0 else None, join=pub) for i in range(4)]
  published = {}
  lock = threading.Lock()

  def worker(seed):
    for k in range(6):
      t = make_tensors(seed * 100 + k)
      v = pub.publish(t)
      with lock:
        published[v] = t

  threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  final = pub.latest_version
  assert final == max(published) == 12
  assert pub.wait_acks(final, 10)
  for r in rs:
    vs = r.loads.versions
    assert vs == sorted(set(vs)) and vs[-1] == final  # strictly increasing, ends at the newest
    assert same(r.loads.calls[-1][1], published[final])
  assert (
      pub.publish(make_tensors(0), version=5) == 5 and pub.latest_version == final
  )  # stale: ignored


def test_relay_topology_delivers_once_and_crosses_each_datacenter_once(cluster):
  pub = cluster.publisher(dc="A")
  layout = {"A": 3, "B": 4, "C": 2}
  rs = [cluster.receiver(f"{dc}{i}", dc=dc, join=pub) for dc, n in layout.items() for i in range(n)]
  t = make_tensors(5)
  v = pub.publish(t)
  assert pub.wait_acks(v, 10)
  assert all(r.loads.versions == [v] and same(r.loads.calls[0][1], t) for r in rs)
  assert pub.stats["served_cross_dc"] == 2  # one relay per far datacenter pulled from the sender
  far = [r for r in rs if r.dc != "A"]
  assert (
      sum(r.stats.get("served_tcp", 0) for r in far) == 4
  )  # the other far receivers got it locally
  assert all(r.stats.get("served_cross_dc", 0) == 0 for r in rs)


def test_delta_across_datacenters_is_bit_exact(cluster):
  pub = cluster.publisher(dc="A", delta_cross_dc=True)
  rs = [cluster.receiver(f"B{i}", dc="B", join=pub, delta_cross_dc=True) for i in range(3)]
  t1 = make_tensors(1)
  assert pub.wait_acks(pub.publish(t1), 10)
  assert wait_until(lambda: "cross_dc_full_bytes" in pub.stats)
  full = pub.stats["cross_dc_full_bytes"]
  rng = np.random.default_rng(0)
  t2 = {
      k: (x.astype(np.float32) * (1 + (rng.random(x.shape) < 0.05) * 0.01)).astype(x.dtype)
      for k, x in t1.items()
  }  # 5% of the weights move
  v2 = pub.publish(t2)
  assert pub.wait_acks(v2, 10)
  assert wait_until(lambda: "cross_dc_delta_bytes" in pub.stats)  # counted when the stream ends
  d = pub.stats["cross_dc_delta_bytes"]
  assert 0 < d < 0.5 * full
  for r in rs:
    assert r.loads.versions == [1, 2] and same(r.loads.calls[-1][1], t2)


def test_shape_mismatch_is_refused_naming_the_first_parameter(cluster):
  pub = cluster.publisher()
  t = make_tensors(1)
  expected = {k: (x.shape, x.dtype) for k, x in t.items()}
  expected[NAMES[1]] = ((48, 32), t[NAMES[1]].dtype)
  expected[NAMES[3]] = ((31,), t[NAMES[3]].dtype)
  r = cluster.receiver("r0", schema=expected, join=pub)
  ok = cluster.receiver("r1", schema=schema_of(t), join=pub)
  v = pub.publish(t)
  assert not pub.wait_acks(v, 10)
  assert ok.loads.versions == [v] and r.loads.versions == [] and r.version == 0
  assert wait_until(lambda: "r0" in pub.errors)
  msg = pub.errors["r0"]
  assert msg == (
      f"Refusing weight version 1: parameter '{NAMES[1]}' has shape (32, 48) but the model "
      "expects (48, 32); publish tensors converted for this model's configuration."
  )
  assert (
      r.stats.get("failed_attempts", 0) == 0
  )  # refused at the manifest, no data pulled, no retries
  with pytest.raises(SchemaMismatch, match=NAMES[1]):
    cluster.receiver("late", schema=expected, join=pub)


def test_late_joiner_loads_the_current_version_before_join_returns(cluster):
  pub = cluster.publisher()
  cluster.receiver("r0", join=pub)
  pub.publish(make_tensors(1))
  t2 = make_tensors(2)
  v2 = pub.publish(t2)
  late = cluster.receiver("late")
  assert late.join(pub.address, timeout=10) == v2
  assert late.loads.versions == [v2] and same(late.loads.calls[0][1], t2)
  assert pub.wait_acks(v2, 10) and "late" in pub.acked_versions()


def test_dead_receiver_does_not_block_the_others(cluster):
  # chain sender -> r0 -> r1 -> r2 -> r3, every hop paced so the transfer takes ~1 s; r1 dies midway
  kw = dict(fanout=1, use_shm=False, uplink_bytes_per_s=8000.0, repair_interval_s=0.5)
  pub = cluster.publisher(**kw)
  rs = [cluster.receiver(f"r{i}", join=pub, **kw) for i in range(4)]
  t = make_tensors(6)
  start = time.monotonic()
  v = pub.publish(t)
  assert time.monotonic() - start < 1.0  # publish does not wait for the data to flow
  assert wait_until(lambda: rs[1]._inflight is not None and rs[1]._inflight.ready >= 2)
  rs[1].close()  # dies mid-transfer: its sockets drop
  assert pub.wait_acks(v, timeout=20)
  assert pub.missing_acks(v) == [] and "r1" not in [i.name for i in pub.receivers()]
  for r in (rs[0], rs[2], rs[3]):
    assert r.loads.versions == [v] and same(r.loads.calls[0][1], t)
  assert rs[1].loads.versions == []
  assert rs[2].stats["failed_attempts"] >= 1  # its stream from r1 broke; it fell back to the sender


def test_load_fn_failure_keeps_old_version(cluster):
  pub = cluster.publisher()
  r = cluster.receiver("r0", join=pub)

  def broken(tensors, version):
    raise RuntimeError("engine rejected weights")

  r.load_fn = broken
  v = pub.publish(make_tensors(1))
  assert wait_until(lambda: v in r._gave_up)
  assert r.version == 0 and "engine rejected weights" in r.last_error
  with pytest.raises(TransferError):
    r.join(pub.address, timeout=5)


def test_segments_are_recycled_only_after_every_receiver_moved_on(cluster):
  pub = cluster.publisher(keep_versions=2)
  fast = cluster.receiver("fast", host="trainer", join=pub)
  release, held, held_version = threading.Event(), {}, []

  def slow_load(tensors, version):  # keeps zero-copy views of the first version it gets, blocked
    if not held_version:
      held.update(tensors)
      held_version.append(version)
      release.wait(20)

  slow = cluster.receiver("slow", host="trainer", join=pub)
  slow.load_fn = slow_load
  versions = {v: make_tensors(v) for v in range(1, 7)}
  for v, t in versions.items():
    assert pub.publish(t) == v
    assert fast.wait_version(v, 10)
    if v == 1:
      assert wait_until(
          lambda: held_version == [1]
      )  # "slow" now sits in load_fn holding views of v1
  assert same(held, versions[1])  # nobody rewrote the segment "slow" still reads
  assert len(pub._pool._segments) <= 4  # bounded: older segments were unlinked, not rewritten
  release.set()
  assert pub.wait_acks(6, 10) and slow.version == 6
  names = set()
  for t in (make_tensors(10), make_tensors(11), make_tensors(12), make_tensors(13)):
    v = pub.publish(t)
    assert pub.wait_acks(v, 10)
    names.add(pub._newest().shm_name)
    assert same(fast.loads.calls[-1][1], t)
  assert len(names) == 2  # everyone moved on: two segments alternate


def test_private_staging_buffers_are_recycled_without_corrupting_data(cluster):
  pub = cluster.publisher(use_shm=False)
  r = cluster.receiver("r", join=pub)
  bufs = []
  for seed in range(1, 5):
    t = make_tensors(seed)
    assert pub.wait_acks(pub.publish(t), 10)
    assert same(r.loads.calls[-1][1], t)
    bufs.append(r._current.path)
  assert bufs[2] == bufs[0] and bufs[3] == bufs[1]  # version 3 reused version 1's buffer, ...


def test_receiver_with_a_schema_faults_in_its_staging_memory_at_join(cluster):
  pub = cluster.publisher(use_shm=False)
  t = make_tensors(1)
  r = cluster.receiver("r", schema=schema_of(t), join=pub)
  spare = r._spare
  assert spare is not None and len(spare.buf) == payload_size(t)
  assert pub.wait_acks(pub.publish(t), 10)
  assert r._current.segment is spare and same(r.loads.calls[0][1], t)
  shm_r = cluster.receiver(
      "s", host="trainer", schema=schema_of(t)
  )  # same host: data stays in the segment
  pub_shm = cluster.publisher()
  shm_r.join(pub_shm.address, timeout=10)
  assert shm_r._spare is None


def test_a_filled_weights_file_is_published_in_place(cluster):
  # A multi-process trainer's export: the file becomes the payload, no copy.
  from streamrl.transfer import WeightsFile  # pylint: disable=g-import-not-at-top

  pub = cluster.publisher()
  rs = [cluster.receiver(f"r{i}", join=pub) for i in range(2)]
  t = make_tensors(3)
  f = WeightsFile(t)
  v = pub.publish(f, 5)
  assert v == 5 and pub.wait_acks(v, timeout=10)
  # Only the receivers copied (each into its staging); the publisher did not.
  assert pub.copied_bytes(v) == len(rs) * payload_size(t)
  for r in rs:
    assert r.loads.versions == [5] and same(r.loads.calls[0][1], t)
  # An ignored (old) version's file is removed, not leaked.
  g = WeightsFile(t)
  pub.publish(g, 4)
  assert not os.path.exists(g.path)
