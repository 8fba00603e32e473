"""The trainer's end of the checkpoint-transfer service: publishes versions and tracks who has
loaded what.

``publish(tensors)`` plans the broadcast tree from the receivers alive now
(topology.py), sends each top-level child a small signed ``announce``
(version, source address, the child's subtree) and copies the tensors chunk
by chunk into one payload (shared memory when enabled), checksumming each
chunk; chunks are served as soon as they are written. It returns when the
copy is complete: the trainer may then change its arrays and train on while
the bytes flow (async overlap); ``wait_acks`` tells when every live receiver
has loaded the version (receiver.py).

Versions are monotonic: a publish whose version is not newer than the latest
is dropped (the newer of two concurrent publishes wins). The repair loop
re-announces to receivers that have not acked and marks the unreachable ones
dead, so ``wait_acks`` only waits for the living.

Versions only the publisher mints: the secret is every node's, so the publisher also signs,
with an Ed25519 key of its own per run (``run_keys``, security.py), every announce (the
version and the plan below the child it goes to) and every version's complete manifest, XXH3
checksums and BLAKE3 digests; receivers act on nothing else.

Deltas (``delta_cross_dc``): when a client in another datacenter says which
version it holds and the publisher still has it with the same layout, chunks
go as XOR deltas (delta.py), each checked against the full chunk's
checksum after reconstruction. Local links always carry full chunks.

Datacenters: shared memory is used only between nodes with the same host
label AND the same datacenter label. Bytes between datacenters always
travel over TCP, through the cross-datacenter rate limiter
(``cross_dc_bytes_per_s``) and delta encoding, even when both ends are on
one machine: a test or benchmark on one host emulates a real cross-datacenter
edge by giving receivers another ``dc``. The plan still sends one copy per
version over that edge, to the remote datacenter's relay, which fans out
there (its same-host receivers map its staging file).

Memory: the publisher writes each version once, tensor by tensor (a lazy
mapping is read one parameter at a time), into a file of its pool
(``shm.SegmentPool``), recycled under the rules in shm.py.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from typing import Optional

import numpy as np

from streamrl.transfer.config import Transfer
from streamrl.transfer.manifest import (
    Manifest,
    SchemaLike,
    TransferError,
    as_schema,
    check_schema,
    checksum,
    fill_payload,
    plan_payload,
    schema_of,
)
from streamrl.transfer.node import Node
from streamrl.transfer.payload import Payload
from streamrl.transfer.security import new_run_keys, sign_grant, sign_manifest
from streamrl.transfer.shm import SegmentPool, WeightsFile, shm_available
from streamrl.transfer.topology import Address, ReceiverInfo, TreeNode, plan_direct, plan_topology

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Peer:
  info: ReceiverInfo
  alive: bool = True
  acked: int = -1
  refused: int = -1  # newest version this receiver refused for good (schema mismatch)
  error: Optional[str] = None
  announced_at: float = 0.0


class Publisher(Node):
  """The trainer side: publishes versions and tracks who has loaded what.

  config: the run's ``transfer.*`` settings (``Transfer``; checked here, so a
  bad value fails with the run's message); ``enabled`` is not read.
  bind: the address to listen on (default ``config.bind``). dc/host: this
  node's datacenter and host labels. start_version: the version the
  generators start with (a publish gets start_version + 1, ...).
  expected_schema: if given, publish refuses tensors that do not match it.
  secret: the run's shared secret (``new_secret()``; the same bytes for every
  Receiver): required, on loopback too (ValueError otherwise). Every request
  is authenticated (security.py).
  ``run_keys``: made here, per run: hand them to every Receiver with the secret. Every announce
  and every version's manifest is signed with a key only this publisher holds.
  """

  def __init__(
      self,
      config: Optional[Transfer] = None,
      *,
      dc: str = "dc0",
      host: Optional[str] = None,
      name: str = "publisher",
      bind: Optional[str] = None,
      port: int = 0,
      start_version: int = 0,
      expected_schema: Optional[SchemaLike] = None,
      secret: Optional[bytes] = None,
  ):
    signer, keys = new_run_keys()
    super().__init__(name, dc, host, config, bind, port, secret, keys)
    self._signer = signer  # never leaves this object: only the publisher mints versions
    self._seal_lock = threading.Lock()
    self._cond = threading.Condition()
    self._versions: dict[int, Payload] = {}
    self._accepted = self._next = start_version  # highest version number a publish has claimed
    self._start_version = start_version
    keep = max(self.config.keep_versions, 1)
    self._pool = SegmentPool(keep, keep + 2, shared=self.config.use_shm and shm_available())
    self._peers: dict[str, _Peer] = {}
    self._copied: dict[int, int] = {}  # version -> bytes copied for it, on every host
    self._expected = as_schema(expected_schema) if expected_schema is not None else None
    self._repair_thread = threading.Thread(
        target=self._repair_loop, name=f"{name}-repair", daemon=True
    )
    self.start_accepting()
    self._repair_thread.start()

  # -- public API
  @property
  def latest_version(self) -> int:
    """The newest version being served (start_version before the first publish)."""
    with self._cond:
      return max(self._versions, default=self._start_version)

  def _newest(self) -> Optional[Payload]:
    with self._cond:
      return self._versions[max(self._versions)] if self._versions else None

  def add_receiver(self, info: ReceiverInfo) -> None:
    """Registers a receiver known from the config (receivers can also register themselves via join)."""
    with self._cond:
      self._peers[info.name] = _Peer(info)
      self._cond.notify_all()

  def receivers(self, alive_only: bool = True) -> list[ReceiverInfo]:
    with self._cond:
      return [p.info for p in self._peers.values() if p.alive or not alive_only]

  def wait_receivers(self, n: int, timeout: float) -> bool:
    """Blocks until at least n receivers are registered and alive."""
    with self._cond:
      return self._cond.wait_for(lambda: sum(p.alive for p in self._peers.values()) >= n, timeout)

  def plan(self) -> TreeNode:
    """The broadcast tree over the receivers alive now."""
    alive = self.receivers()
    if self.config.topology == "direct":
      return plan_direct(alive)
    return plan_topology(
        alive,
        self.dc,
        self.config.fanout,
        self.host if self.config.use_shm and shm_available() else None,
    )

  def publish(self, tensors: Mapping[str, np.ndarray], version: Optional[int] = None) -> int:
    """Snapshots ``tensors`` (HF name -> array) as a new version and announces it.

    ``tensors`` may also be a filled ``WeightsFile`` (a multi-process
    trainer's export): its file becomes the version's payload as it is,
    checksummed in place, and belongs to the publisher from then on.

    Returns the version, once the snapshot is complete (the caller may then
    modify its arrays) and the top-level receivers have been told, or at
    most ``connect_timeout_s`` after the copy while one of them has not
    answered (its announce then goes on in the background). Chunks
    are served while they are being written, so receivers verify and
    forward in parallel with the copy; ``wait_acks`` tells when they have
    loaded it. A version not newer than one already claimed is ignored.
    Raises SchemaMismatch (a ValueError) if ``expected_schema`` was given
    and the tensors do not match it.
    """
    if self.closed:
      raise RuntimeError("publisher is closed; create a new Publisher.")
    with self._cond:
      if version is None:
        self._next += 1
        v = self._next
      else:
        v = int(version)
        self._next = max(self._next, v)
      if v <= self._accepted:
        log.warning(
            "publish of version %d ignored: version %d is already published", v, self._accepted
        )
        if isinstance(tensors, WeightsFile):
          tensors.unlink()
        return v
      self._accepted = v
    written = tensors if isinstance(tensors, WeightsFile) else None
    if written is not None:
      tensors = written.tensors()
    if self._expected is not None:
      check_schema(schema_of(tensors), self._expected, v)
    t0 = time.perf_counter()
    manifest = plan_payload(tensors, v, self.config.chunk_bytes)
    if written is not None:
      payload = self._adopt(written, manifest)
      tensors = None
    else:
      payload = self._allocate(manifest)
    t1 = time.perf_counter()
    with self._cond:
      if v < self._accepted:  # a concurrent publish claimed a newer version: newest wins
        payload.fail("superseded")
        if payload.segment is not None:
          payload.segment.end_rewrite()
        return v
      self._versions[v] = payload
      while len(self._versions) > max(self.config.keep_versions, 1):
        self._versions.pop(min(self._versions))
      now = time.monotonic()
      for p in self._peers.values():
        p.announced_at = now
      self._cond.notify_all()
    announcer = threading.Thread(
        target=self.announce_all,
        args=(self.plan().children, lambda child: self._grant(v, child)),
        daemon=True,
    )
    announcer.start()
    try:
      if tensors is None:  # already written: checksum it in place
        values = (checksum(payload.chunk(i)) for i in range(manifest.num_chunks))
      else:
        values = fill_payload(tensors, manifest, payload.buf)
      for i, value in enumerate(values):
        payload.add_written(i, value)
      # Servers send it at the end of each stream and relays pass it on; the signature of the
      # digests is made when a TCP stream first needs it (_seal), so same-host runs never hash.
      payload.set_tag(sign_manifest(self._signer, payload.full_manifest))
      if tensors is not None:
        self._add_copied(v, manifest.total_bytes)
    except BaseException as e:
      payload.fail(f"publisher failed while writing version {v}: {e!r}")
      with self._cond:
        if self._versions.get(v) is payload:
          del self._versions[v]
      raise
    finally:
      if payload.segment is not None:  # a recycled file: written, so readers may pin it again
        payload.segment.end_rewrite()
      t2 = time.perf_counter()
      # An honest receiver answers an announce in milliseconds; one that does not (slow, or not
      # a receiver at all) must not hold the trainer: its announce goes on in the background.
      announcer.join(self.config.connect_timeout_s)
    log.debug(
        "%s: version %d: allocate %.3fs, write+checksum %.3fs, announce wait %.3fs",
        self.name,
        v,
        t1 - t0,
        t2 - t1,
        time.perf_counter() - t2,
    )
    self.add_stat("published")
    return v

  def wait_acks(self, version: int, timeout: float = 60.0) -> bool:
    """True once every live receiver has loaded ``version`` (or newer); False on timeout or refusal."""

    def settled():
      return all(
          p.acked >= version or not p.alive or p.refused >= version for p in self._peers.values()
      )

    with self._cond:
      self._cond.wait_for(settled, timeout)
      return all(p.acked >= version for p in self._peers.values() if p.alive)

  def missing_acks(self, version: int) -> list[str]:
    """Live receivers that have not loaded ``version`` yet."""
    with self._cond:
      return sorted(n for n, p in self._peers.items() if p.alive and p.acked < version)

  def copied_bytes(self, version: int) -> int:
    """Bytes written into host memory for ``version`` so far: the publisher's copy plus what
    every receiver that acked it copied (a TCP receiver its staging file; a receiver that maps
    a same-host file, nothing)."""
    with self._cond:
      return self._copied.get(version, 0)

  def _add_copied(self, version: int, n: int) -> None:
    with self._cond:
      self._copied[version] = self._copied.get(version, 0) + n
      while len(self._copied) > 16:
        self._copied.pop(min(self._copied))

  def acked_versions(self) -> dict[str, int]:
    with self._cond:
      return {n: p.acked for n, p in self._peers.items()}

  @property
  def errors(self) -> dict[str, str]:
    """Last error each receiver reported (e.g. a schema refusal)."""
    with self._cond:
      return {n: p.error for n, p in self._peers.items() if p.error}

  def close(self) -> None:
    super().close()
    with self._cond:
      self._versions.clear()
      self._cond.notify_all()
    self._pool.close()

  # -- internals
  def _grant(self, version: int, child: TreeNode) -> dict:
    """The signed announce of ``version`` for ``child``'s subtree: it names the plan below
    ``child``, so every receiver in it knows which nodes are its parents."""
    grant = {"version": version, "publisher": list(self.address), "tree": child.to_json()}
    return {"grant": grant, "sig": sign_grant(self._signer, grant)}

  def _seal(self, payload: Payload) -> bytes:
    """The signature of ``payload``'s manifest with every chunk's digest (hashed on demand)."""
    with self._seal_lock:
      if payload.full_tag is None:
        payload.full_tag = sign_manifest(self._signer, payload.signed_manifest(full=True))
      return payload.full_tag

  def _allocate(self, manifest: Manifest) -> Payload:
    seg, old = self._pool.acquire(manifest.total_bytes, self._recyclable)
    if old is not None:
      with self._cond:
        if self._versions.get(old.version) is old:
          del self._versions[old.version]
    payload = Payload(manifest, seg.buf, shm_name=seg.name, keepalive=seg.keepalive, segment=seg)
    payload.digestible = True  # our own bytes: a chunk's digest is computed when a stream needs it
    seg.payload = payload
    return payload

  def _adopt(self, written: WeightsFile, manifest: Manifest) -> Payload:
    """A filled WeightsFile as the payload of a version: no copy (its layout is the payload's)."""
    if written.manifest.total_bytes != manifest.total_bytes or (
        written.manifest.tensors != manifest.tensors
    ):
      raise ValueError("the weights file's layout differs from the payload's")
    seg = written.segment
    payload = Payload(manifest, seg.buf, shm_name=seg.name, keepalive=seg.keepalive, segment=seg)
    payload.digestible = True
    seg.payload = payload
    self._pool.adopt(seg)
    return payload

  def _recyclable(self, old: Payload) -> bool:
    """May the segment holding ``old`` be rewritten now? (see shm.py)"""
    with self._cond:
      # The versions still served once the new one is in, and always the newest: it is what
      # every get is served until the new one replaces it (keep_versions=1 included).
      keep = sorted(self._versions)[-max(self.config.keep_versions - 1, 1) :]
      if old.version in keep or old.streams or not (old.complete or old.failed):
        return False  # still served, being read, or still being written by another publish
      if old.shm_name is None:
        return True  # private: nobody else can hold a view of it
      return all(
          p.acked > old.version or p.refused >= old.version or not p.alive
          for p in self._peers.values()
      )

  def dispatch(self, session, req):
    op = req.get("op")
    if op == "get":
      self._handle_get(session, req)
    elif op == "register":
      info = ReceiverInfo.from_json(req["info"])
      with self._cond:
        self._peers[info.name] = _Peer(info, acked=int(req.get("version", -1)))
        self._cond.notify_all()
        latest = max(self._versions, default=-1)
      session.reply({"latest": latest})
    elif op == "ack":
      with self._cond:
        p = self._peers.get(req["name"])
        if p is not None:
          p.acked, p.alive = max(p.acked, int(req["version"])), True
          p.error = None
          self._cond.notify_all()
      self._add_copied(int(req["version"]), int(req.get("copied", 0)))
    elif op == "nack":
      with self._cond:
        p = self._peers.get(req["name"])
        if p is not None:
          p.error = str(req.get("reason"))
          if req.get("permanent"):
            p.refused = max(p.refused, int(req["version"]))
          self._cond.notify_all()
    elif op == "suspect":
      with self._cond:
        p = self._peers.get(req["name"])
      if p is not None and not self._ping(p.info.address):
        self.on_unreachable(p.info)
    elif op == "ping":
      session.reply(
          {
              "ok": True,
              "version": self.latest_version,
              "host": self.host,
              "dc": self.dc,
              "shm": self.config.use_shm and shm_available(),
          },
      )

  def _handle_get(self, session, req):
    want = int(req.get("want", 0))
    with self._cond:
      payload = self._newest()
      base = self._versions.get(req.get("base")) if isinstance(req.get("base"), int) else None
    if payload is None or payload.version < want:
      session.reply({"status": "notfound", "latest": self.latest_version})
      return
    use_delta = (
        self.config.delta_cross_dc
        and req.get("dc") != self.dc
        and base is not None
        and base.complete
        and base.version < payload.version
        and base.manifest.layout == payload.manifest.layout
    )
    self.serve(session, payload, req, base if use_delta else None, seal=self._seal)

  def _ping(self, address: Address) -> bool:
    try:
      self.request(address, {"op": "ping"})
      return True
    except (OSError, TransferError):
      return False

  def on_unreachable(self, info: ReceiverInfo) -> None:
    with self._cond:
      p = self._peers.get(info.name)
      if p is not None and p.info.address == info.address:
        p.alive = False
        self._cond.notify_all()

  def forget(self, name: str) -> None:
    """A receiver that left on purpose (its generator was removed): no
    version waits for its ack any more, and no tree routes through it."""
    with self._cond:
      p = self._peers.get(name)
      if p is not None:
        p.alive = False
        self._cond.notify_all()

  def _repair_loop(self) -> None:
    interval = self.config.repair_interval_s
    while not self.wait_closed(interval):
      now = time.monotonic()
      with self._cond:
        v = max(self._versions, default=-1)
        late = [
            p
            for p in self._peers.values()
            if p.alive
            and p.acked < v
            and p.refused < v
            and now - p.announced_at >= interval
            and v in self._versions
        ]
        for p in late:
          p.announced_at = now
      for p in late:
        node = TreeNode(p.info)
        self.announce_subtree(node, self._grant(v, node))
