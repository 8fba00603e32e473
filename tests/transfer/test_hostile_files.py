"""A peer that holds the run's secret cannot make a receiver read a file of its choosing, hang on
one, or learn its bytes; dead processes' files leave /dev/shm; a file being rewritten is never
pinned (the newest version is never recycled).

The hostile "publisher" here speaks the real protocol (it has the secret: a compromised or buggy
node of the run) and answers every get with a header that names a file it picked.
"""

import dataclasses
import json
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from streamrl import lifecycle
from streamrl.models import safetensors_io
from streamrl.transfer import Pin, TransferError, WeightsFile, new_secret, security, wire
from streamrl.transfer import payload as payload_lib
from streamrl.transfer import publisher as publisher_lib
from streamrl.transfer import shm as shm_lib
from streamrl.transfer.manifest import checksum, plan_payload
from streamrl.transfer.topology import ReceiverInfo, TreeNode
from .conftest import make_tensors, same, wait_until

SHM = shm_lib.SHM_DIR
pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not shm_lib.shm_available(), reason="needs /dev/shm"),
]


def _ready_frames(checksums) -> bytes:
  """R frames (planes.py: kind, length, then index and checksum), one per chunk."""
  return b"".join(struct.pack("!cQIQ", b"R", 12, i, c) for i, c in enumerate(checksums))


def _end_frame(tag: bytes = b"") -> bytes:
  return struct.pack("!cQ", b"E", len(tag)) + tag


class Hostile:
  """A node with the run's secret that lies: a receiver ``publisher`` planned as another's
  parent (its announces carry that publisher's signed plan), it announces a version with itself
  as source, and answers a get with ``fields`` (the plane, a file name) and then ``frames``.

  ``received``: every request it was sent, as JSON text, and any bytes that followed a get's
  header on that connection: all a receiver ever told it.
  """

  def __init__(self, secret: bytes, manifest, fields: dict, frames: bytes = b"", publisher=None):
    self.secret, self.manifest, self.fields, self.frames = secret, manifest, fields, frames
    self.publisher = publisher
    self.received: list[str] = []
    self._server = socket.create_server(("127.0.0.1", 0))
    self._server.settimeout(0.1)
    self.address = self._server.getsockname()[:2]
    self._stop = threading.Event()
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self):
    while not self._stop.is_set():
      try:
        conn, _ = self._server.accept()
      except OSError:
        continue
      threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

  def _handle(self, conn):
    with conn:
      conn.settimeout(5.0)
      try:
        session, req = security.Session.accept(conn, self.secret)
      except (OSError, TransferError):
        return
      self.received.append(json.dumps(req))
      if req.get("op") != "get":
        return
      session.reply(
          {
              "status": "ok",
              "manifest": self.manifest.without_checksums().to_json(),
              "base": None,
              **self.fields,
          }
      )
      try:
        conn.sendall(self.frames)
        while True:
          data = conn.recv(1 << 16)
          if not data:
            return
          self.received.append(data.decode("latin-1"))
      except OSError:
        return

  def announce(self, receiver, version: int, host=None, dc=None, source=None):
    """An authentic announce: pull ``version`` from ``source`` (default: us), the receiver's
    parent in the publisher's signed plan. ``host``/``dc``: where we claim the source is (left
    out when None)."""
    source = tuple(source or self.address)
    parent = ReceiverInfo("hostile", receiver.dc, "hostile-host", source)
    grant = self.publisher._grant(version, TreeNode(parent, (TreeNode(receiver.info),)))
    msg = {"op": "announce", **grant, "source": list(source)}
    if host is not None:
      msg.update(source_host=host, source_dc=dc)
    with wire.connect(receiver.address, 2.0) as sock:
      security.Session.request(sock, self.secret, msg).recv_reply()

  def ops(self) -> list:
    return [json.loads(r).get("op") for r in self.received if r.startswith("{")]

  def close(self):
    self._stop.set()
    self._server.close()


@pytest.fixture
def shm_paths():
  """/dev/shm paths a test plants (symlinks, FIFOs, foreign files), removed afterwards."""
  paths = []
  yield paths
  for p in paths:
    try:
      if stat.S_ISFIFO(os.lstat(p).st_mode):  # let a reader stuck opening it (the bug) go
        os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
      pass
    try:
      os.unlink(p)
    except FileNotFoundError:
      pass


@pytest.fixture
def hostile():
  made = []

  def make(*args, **kwargs):
    h = Hostile(*args, **kwargs)
    made.append(h)
    return h

  yield make
  for h in made:
    h.close()


def _gave_up(r, version: int) -> bool:
  """``r`` gave ``version`` up and its fetch thread is idle again. (An announce of that version
  that comes while the thread still winds down is dropped, and these tests' publisher repairs
  only once a minute: so the next honest publish waits for this.)"""
  return version in r._gave_up and not r._fetching


def _joined(cluster, secret, **cfg):
  """An honest publisher on host "trainer" and a receiver there that holds version 1."""
  pub = cluster.publisher(secret=secret)
  r = cluster.receiver("r", host="trainer", join=pub, secret=secret, **cfg)
  t1 = make_tensors(1)
  assert pub.wait_acks(pub.publish(t1), 10) and r.version == 1
  return pub, r, t1


# ---------------------------------------------------------------- which file a receiver maps


def test_a_symlink_named_by_a_peer_is_refused_read_never_and_reported_nowhere(
    cluster, hostile, shm_paths, tmp_path
):
  secret = new_secret()
  pub, r, t1 = _joined(cluster, secret, max_retries=0)
  manifest = plan_payload(make_tensors(2), 2, 1024)
  # A file the receiver's user can read but that is not ours (root: owned by nobody), with
  # the payload's size and 8-byte chunks' worth of XXH3 to leak, planted as a symlink.
  target = tmp_path / "not-ours.bin"
  target.write_bytes(secrets.token_bytes(manifest.total_bytes))
  if os.geteuid() == 0:
    os.chown(target, 65534, 65534)
  link = lifecycle.shm_name()  # a name of ours, so only the symlink check stands in the way
  shm_paths.append(os.path.join(SHM, link))
  os.symlink(target, os.path.join(SHM, link))
  frames = _ready_frames([0] * manifest.num_chunks) + _end_frame()
  h = hostile(secret, manifest, {"plane": "shm", "shm": link}, frames, publisher=pub)
  # It claims to be on our host and datacenter, so the receiver does ask it for shared memory.
  h.announce(r, 2, host="trainer", dc="A")
  assert wait_until(lambda: _gave_up(r, 2), 5)
  assert "symbolic link" in r.last_error
  # Read nothing: no mapping of the target, in the cache or anywhere in the process.
  assert link not in shm_lib._MAPS
  with open("/proc/self/maps") as f:
    assert str(target) not in f.read()
  # Sent no digest anywhere: the hostile peer heard a get and nothing more (no nack, no ack);
  # the nack went to the publisher the receiver joined, and names no checksum either.
  data = target.read_bytes()
  digests = {checksum(data[a:b]) for a, b in map(manifest.chunk_range, range(manifest.num_chunks))}
  assert h.ops() == ["get"] and json.loads(h.received[0])["shm"] is True
  assert wait_until(lambda: r.name in pub.errors) and "symbolic link" in pub.errors[r.name]
  for text in (*h.received, pub.errors[r.name], r.last_error):
    assert not any(f"{d:x}" in text or str(d) in text for d in digests)
  # Kept its version; the honest publisher's next version still arrives.
  assert r.version == 1 and r.loads.versions == [1] and same(r.loads.calls[0][1], t1)
  t2 = make_tensors(2)
  assert pub.publish(t2) == 2 and r.wait_version(2, 10)
  assert same(r.loads.calls[-1][1], t2) and pub.wait_acks(2, 10)


def test_a_fifo_named_by_a_peer_fails_the_fetch_at_once(cluster, hostile, shm_paths):
  secret = new_secret()
  pub, r, _ = _joined(cluster, secret, max_retries=0, io_timeout_s=2.0)
  manifest = plan_payload(make_tensors(2), 2, 1024)
  fifo = lifecycle.shm_name()
  shm_paths.append(os.path.join(SHM, fifo))
  os.mkfifo(os.path.join(SHM, fifo), 0o600)
  h = hostile(secret, manifest, {"plane": "shm", "shm": fifo}, _end_frame(), publisher=pub)
  start = time.monotonic()
  h.announce(r, 2, host="trainer", dc="A")
  assert wait_until(lambda: _gave_up(r, 2), 4), "the fetch thread hangs on the FIFO"
  assert time.monotonic() - start < 2.0  # well within its io timeout
  assert "not a regular file" in r.last_error and r.version == 1
  assert pub.publish(make_tensors(3)) == 2 and r.wait_version(2, 10)  # the thread is free


@pytest.mark.parametrize(
    "claim", [(None, None), ("elsewhere", "A"), ("trainer", "B")], ids=["unknown", "host", "dc"]
)
def test_a_shm_header_the_receiver_did_not_ask_for_is_refused(cluster, hostile, claim):
  secret = new_secret()
  pub, r, t1 = _joined(cluster, secret, max_retries=0)
  # A genuine, complete, correctly signed file of ours: only the plane is wrong.
  t2 = make_tensors(2)
  f = WeightsFile(t2)
  try:
    m = dataclasses.replace(f.manifest, version=2)
    sums = [checksum(f.buf[a:b]) for a, b in map(m.chunk_range, range(m.num_chunks))]
    tag = security.sign_manifest(pub._signer, dataclasses.replace(m, checksums=tuple(sums)))
    frames = _ready_frames(sums) + _end_frame(tag)
    h = hostile(secret, m, {"plane": "shm", "shm": f.name}, frames, publisher=pub)
    h.announce(r, 2, *claim)  # not known to be on our host and datacenter
    assert wait_until(lambda: 2 in r._gave_up, 5)
  finally:
    f.unlink()
  assert json.loads(h.received[0])["shm"] is False  # it did not ask...
  assert "did not ask" in r.last_error  # ...so it refused the answer
  assert r.version == 1 and r.loads.versions == [1] and same(r.loads.calls[0][1], t1)


def test_only_regular_files_of_ours_with_our_names_and_the_payload_size_are_mapped(shm_paths):
  t = make_tensors(1)
  f = WeightsFile(t)
  try:
    m = f.manifest
    mapped = payload_lib.map_shared(f.name, m)  # the genuine article
    assert mapped.pin is not None and bytes(mapped.buf) == bytes(f.buf) and mapped.path == f.path
    mapped.release()
    # Wrong size: a manifest of a smaller payload, and one of a larger one.
    for other in (
        plan_payload({"x": np.zeros(4, np.float32)}, 1, 1024),
        plan_payload({"x": np.zeros(8192, np.float32)}, 1, 1024),
    ):
      with pytest.raises(TransferError, match="bytes, the payload"):
        payload_lib.map_shared(f.name, other)
    # Not a name this service makes (another program's file in /dev/shm), same size.
    foreign = f"notours_{secrets.token_hex(6)}"
    shm_paths.append(os.path.join(SHM, foreign))
    with open(os.path.join(SHM, foreign), "wb") as out:
      out.write(bytes(f.buf))
    with pytest.raises(TransferError, match="not a name this service makes"):
      payload_lib.map_shared(foreign, m)
    with pytest.raises(TransferError, match="not a name"):
      payload_lib.map_shared("../../etc/passwd", m)
    # A pin never follows a symlink either.
    link = lifecycle.shm_name()
    shm_paths.append(os.path.join(SHM, link))
    os.symlink(f.path, os.path.join(SHM, link))
    with pytest.raises(TransferError, match="symbolic link"):
      Pin(os.path.join(SHM, link))
    with pytest.raises(TransferError, match="symbolic link"):
      payload_lib.map_shared(link, m)
    # Another user's file, with our name and the right size (only root can make one here).
    if os.geteuid() == 0:
      theirs = lifecycle.shm_name()
      shm_paths.append(os.path.join(SHM, theirs))
      with open(os.path.join(SHM, theirs), "wb") as out:
        out.write(bytes(f.buf))
      os.chown(os.path.join(SHM, theirs), 65534, 65534)
      with pytest.raises(TransferError, match="belongs to uid 65534"):
        payload_lib.map_shared(theirs, m)
  finally:
    f.unlink()


# ---------------------------------------------------------------- where reports go


def test_acks_and_nacks_go_only_to_the_publisher_the_receiver_joined(cluster, hostile):
  secret = new_secret()
  pub, r, _ = _joined(cluster, secret, max_retries=0)
  # Another honest node that has version 2 (any source will do); r is left out of its plan.
  other = cluster.receiver("other", join=pub, secret=secret)
  pub.forget("r")
  t2 = make_tensors(2)
  assert pub.publish(t2) == 2 and other.wait_version(2, 10) and r.version == 1
  h = hostile(secret, other._current.manifest, {"status": "notfound"}, publisher=pub)
  # "Pull 2 from that node; I am your publisher": r loads it and acks to the one it joined.
  h.announce(r, 2, source=other.address)
  assert r.wait_version(2, 10) and same(r.loads.calls[-1][1], t2)
  assert wait_until(lambda: pub.acked_versions()["r"] == 2)
  # "Pull 3 from me": nothing there, so r gives up, and the nack goes to the one it joined.
  h.announce(r, 3)
  assert wait_until(lambda: 3 in r._gave_up, 5)
  assert wait_until(lambda: r.name in pub.errors) and "no version >= 3" in pub.errors[r.name]
  assert "ack" not in h.ops() and "nack" not in h.ops() and "suspect" not in h.ops()


# ---------------------------------------------------------------- orphaned files


def _plant(name: str, owner=None) -> str:
  path = os.path.join(SHM, name)
  with open(path, "wb") as f:
    f.write(b"\0" * 64)
  if owner is not None:
    os.chown(path, owner, owner)
  return path


def test_the_sweep_removes_dead_processes_files_and_keeps_the_living_ones(shm_paths):
  dead = subprocess.Popen(["true"])
  dead_ticks = lifecycle.start_ticks(dead.pid)  # readable until it is reaped
  dead.wait()
  alive = subprocess.Popen(["sleep", "30"])
  try:
    ns = os.stat("/proc/self/ns/pid").st_ino
    me, my_ticks = os.getpid(), lifecycle.start_ticks(os.getpid())
    hexes = iter(secrets.token_hex(6) for _ in range(16))
    gone = {  # the creator is not alive
        "dead": f"srl_{dead.pid}_{dead_ticks}_{ns}_{next(hexes)}",
        "pid reused": f"srl_{me}_{my_ticks - 1}_{ns}_{next(hexes)}",  # our pid, another start
        "old name": f"srl_{dead.pid}_{next(hexes)}",
    }
    kept = {  # the creator lives, or it is not ours to judge or remove
        "ours": lifecycle.shm_name(),
        "alive child": f"srl_{alive.pid}_{lifecycle.start_ticks(alive.pid)}_{ns}_{next(hexes)}",
        "other namespace": f"srl_{dead.pid}_{dead_ticks}_{ns + 1}_{next(hexes)}",
        "pinned": f"srl_{dead.pid}_{dead_ticks}_{ns}_{next(hexes)}",
        "not our pattern": f"srl_{dead.pid}_x_{next(hexes)}",
    }
    for name in (*gone.values(), *kept.values()):
      shm_paths.append(_plant(name))
    if os.geteuid() == 0:  # another user's file: never removed, whoever made it
      kept["other user"] = f"srl_{dead.pid}_{dead_ticks}_{ns}_{next(hexes)}"
      shm_paths.append(_plant(kept["other user"], owner=65534))
    pin = Pin(os.path.join(SHM, kept["pinned"]))  # a generator still to load it
    removed = shm_lib.sweep_orphans(force=True)
    assert sorted(set(removed) & set((*gone.values(), *kept.values()))) == sorted(gone.values())
    assert not any(os.path.exists(os.path.join(SHM, n)) for n in gone.values())
    assert all(os.path.exists(os.path.join(SHM, n)) for n in kept.values())
    pin.release()
    assert kept["pinned"] in lifecycle.sweep_shm()  # once let go, it goes too
  finally:
    alive.kill()
    alive.wait()


def test_the_watchdog_sweeps_when_its_process_group_is_killed(shm_paths):
  # A run whose whole process group is killed (its resource tracker too): its file is left;
  # the watchdog, in a session of its own, survives and removes it.
  code = (
      "import os, sys, time\n"
      "from streamrl import lifecycle\n"
      "lifecycle.guard_children(poll_s=0.1)\n"
      "name = lifecycle.shm_name()\n"
      "open(os.path.join(lifecycle.SHM_DIR, name), 'wb').close()\n"
      "print(name, flush=True)\n"
      "time.sleep(60)\n"
  )
  proc = subprocess.Popen(
      [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
  )
  try:
    name = proc.stdout.readline().strip()
    assert lifecycle.is_shm_name(name)
    path = os.path.join(SHM, name)
    shm_paths.append(path)
    assert os.path.exists(path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not os.path.exists(path), 8)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


# ---------------------------------------------------------------- rewriting a file


def test_a_file_being_rewritten_cannot_be_pinned_until_it_is_written():
  pool = shm_lib.SegmentPool(1, 3, shared=True)
  try:
    first, _ = pool.acquire(4096, lambda p: True)  # fresh: nobody has seen it
    path = os.path.join(SHM, first.name)
    Pin(path).release()
    again, _ = pool.acquire(4096, lambda p: True)  # reused: locked for the whole rewrite
    assert again is first and again.rewriting
    with pytest.raises(TransferError, match="being rewritten"):
      Pin(path)
    got = []
    waiter = threading.Thread(target=lambda: got.append(Pin(path, wait=5.0)))
    waiter.start()  # a reader pins first (it waits), then verifies
    time.sleep(0.1)
    assert not got
    again.end_rewrite()
    waiter.join(5)
    assert got and got[0].held
    # Pinned, it is not taken for the next version: a fresh file is.
    third, _ = pool.acquire(4096, lambda p: True)
    assert third is not first and not first.rewriting
    got[0].release()
  finally:
    pool.close()


def test_the_newest_version_is_never_recycled_and_a_rewrite_holds_its_lock(cluster, monkeypatch):
  pub = cluster.publisher(secret=new_secret(), keep_versions=1)  # no receivers at all
  t1, t2, t3 = make_tensors(1), make_tensors(2), make_tensors(3)
  assert pub.publish(t1) == 1
  v1_path = pub._newest().path
  real, gate, paused = publisher_lib.fill_payload, threading.Event(), threading.Event()

  def slow(tensors, manifest, out):  # stops after two chunks until the test lets it go on
    for i, value in enumerate(real(tensors, manifest, out)):
      yield value
      if i == 1:
        paused.set()
        gate.wait(10)

  monkeypatch.setattr(publisher_lib, "fill_payload", slow)
  writer = threading.Thread(target=pub.publish, args=(t2,))
  writer.start()
  assert paused.wait(5)
  # Version 1 is still the newest served: its file was not taken for version 2.
  pin = Pin(v1_path)
  assert same(safetensors_io.load(v1_path), t1)
  pin.release()
  gate.set()
  writer.join(5)
  assert pub.latest_version == 2 and pub._newest().path != v1_path
  # Version 3 reuses version 1's file (retired, nobody reads it): locked until it is written.
  gate.clear()
  paused.clear()
  writer = threading.Thread(target=pub.publish, args=(t3,))
  writer.start()
  assert paused.wait(5)
  with pytest.raises(TransferError, match="being rewritten"):
    Pin(v1_path)
  gate.set()
  writer.join(5)
  assert pub._newest().path == v1_path
  pin = Pin(v1_path)
  assert same(safetensors_io.load(v1_path), t3)
  pin.release()


def test_stopping_a_local_cluster_removes_what_its_dead_workers_left(shm_paths):
  """`LocalCluster.stop` kills the nodes' workers with their resource trackers (what
  bench_elastic and launch/cluster.py do): their files go when the cluster stops."""
  from streamrl.cluster import local as local_cluster  # pylint: disable=g-import-not-at-top

  dead = subprocess.Popen(["true"])
  ticks = lifecycle.start_ticks(dead.pid)
  dead.wait()
  ns = os.stat("/proc/self/ns/pid").st_ino
  left = f"srl_{dead.pid}_{ticks}_{ns}_{secrets.token_hex(6)}"
  ours = lifecycle.shm_name()
  shm_paths.extend([_plant(left), _plant(ours)])
  t0 = time.monotonic()
  local_cluster._sweep_after_stop(wait_s=1.0)  # pylint: disable=protected-access
  assert not os.path.exists(os.path.join(SHM, left))
  assert os.path.exists(os.path.join(SHM, ours))  # a live process's file stays
  assert time.monotonic() - t0 < 3
