"""Checkpoint-transfer service: the trainer's Publisher and one Receiver per generator.

Protocol (announce, then pull):
1. ``Publisher.publish(tensors)`` plans the broadcast tree from the
   receivers alive now (topology.py), sends each top-level child a small
   ``announce`` (version, source address, the child's subtree) and copies the
   tensors chunk by chunk into one payload (shared memory when enabled),
   checksumming each chunk; chunks are served as soon as they are written.
   It returns when the copy is complete: the trainer may then change its
   arrays and train on while the bytes flow (async overlap); ``wait_acks``
   tells when every live receiver has loaded the version.
2. A receiver that hears an announce forwards it at once to its own children
   (naming itself as their source) and pulls the version from its source:
   manifest first (schema refused before any data), then chunks. Every node
   commits a chunk only after its checksum matches and serves committed
   chunks to its children immediately, so a tree is pipelined.
3. Only when all chunks are verified and the safetensors header agrees with
   the manifest does the receiver call ``load_fn(tensors, version)``; loads
   are serialised, so a generator never mixes versions. ``tensors.path`` is
   the verified safetensors file in /dev/shm (the sender's, or the host's
   first receiver's): engines load that file. Then it acks, reporting how
   many bytes it copied (``Publisher.copied_bytes``).

Faults: a damaged or cut stream fails only that attempt: the receiver keeps
its old version and retries (``max_retries`` times, falling back from its tree
parent to the publisher), then reports a nack. A dead receiver cannot block
anyone: its children's pulls fail fast (EOF or ``io_timeout_s``) and fall back
to the publisher; an unreachable child's subtree is announced to directly;
the publisher's repair loop re-announces to receivers that have not acked and
marks the unreachable ones dead, so ``wait_acks`` only waits for the living.
Versions are monotonic everywhere: a receiver ignores versions <= its own,
always pulls the newest it has heard of, and the publisher drops a publish
whose version is not newer than the latest (the newer of two concurrent
publishes wins). A late joiner registers and pulls the latest version before
``join`` returns, i.e. before it serves.

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

Authentication (``secret``, transports.py): every node must be given the
run's shared secret (``new_secret()``; ValueError otherwise, on loopback
too, since any local process can reach 127.0.0.1). Every connection is
authenticated both ways with
HMAC-SHA256 challenge-response over fresh nonces, and a request that fails is
refused with an error frame before it is acted on (stats ``auth_refused``:
no data, no registration). A wrong-secret source therefore fails the attempt
(``last_error`` says authentication) and the receiver keeps its old version.

Versions only the publisher mints (``run_keys``, transports.py): the secret is every node's,
so the publisher also signs, with an Ed25519 key of its own per run, every announce (the version
and the plan below the child it goes to) and every version's complete manifest, XXH3 checksums
and BLAKE3 digests. Receivers get its public key with the secret (``Publisher.run_keys``, through
whoever builds them) and act on an announce only if the publisher signed it and it comes from
the publisher or one of their parents in that plan (stats ``announces_refused``); they load a
version, or serve it on as complete, only once its signatures verify, and a TCP receiver hashes
every chunk against the signed digest. A version whose fetch gives up no longer holds the
receiver: any newer announce counts again.

TLS (``transfer.tls``, on by default off loopback): every connection, the relays' included, is
TLS 1.3 with the run's certificate (``run_keys``), pinned by every client.

Hostile peers (``_Node``): until a peer has proven the secret it gets small
frames, one deadline for its whole handshake (``handshake_timeout_s``) and
a bounded share of the node's connections (``max_connections``,
``max_connections_per_peer``); a client's exchanges have deadlines too, so
whoever answers at a receiver's address cannot hold ``publish``.

Memory: one copy per host. The publisher writes each version once, tensor by
tensor (a lazy mapping is read one parameter at a time), into a
shared-memory file; receivers on its host (and in its datacenter) map that
file, and on every other host one receiver receives into a staging file of
its own which that host's other receivers map (topology.py). Files are
recycled between versions under the rules in payload.py (pins keep a file
someone still reads from being rewritten), and a receiver that knows its
schema faults its staging memory in at ``join``: on this VM, first touching
1 GB of fresh memory costs more than moving it. Every file is unlinked on ``close`` (and by the resource
tracker if its process dies; if the tracker died too, by the next node that starts on the host, or
the watchdog: ``payload.sweep_orphans``).

Shared memory is the receiver's decision: it asks for it only from a node it knows is on its host
and in its datacenter (the publisher's ping, an announce's ``source_host``/``source_dc``), refuses
a header that offers it unasked, and maps only a regular file of its own user that this service
named (payload.py). Nothing it computes from the bytes goes back to a peer: a failed chunk's
error names the chunk, and acks and nacks go only to the publisher it joined.

Where the data plane could be a GPU path (NCCL / CUDA IPC), see transports.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

from streamrl.transfer.config import Transfer
from streamrl.transfer.manifest import (
    Manifest,
    SchemaLike,
    SchemaMismatch,
    TensorSpec,
    TransferError,
    as_schema,
    check_schema,
    checksum,
    fill_payload,
    payload_nbytes,
    plan_payload,
    schema_of,
)
from streamrl.transfer.payload import (
    Payload,
    Segment,
    SegmentPool,
    VersionTensors,
    WeightsFile,
    create_segment,
    shm_available,
    sweep_orphans,
)
from streamrl.transfer.topology import Address, ReceiverInfo, TreeNode, plan_direct, plan_topology
from streamrl.transfer.transports import (
    PLANES,
    SIGNATURE_BYTES,
    AuthenticationError,
    Link,
    RateLimiter,
    RunKeys,
    Session,
    Tls,
    check_run_keys,
    check_secret,
    choose_plane,
    connect,
    new_run_keys,
    send_error,
    sign_grant,
    sign_manifest,
    tls_enabled,
)

log = logging.getLogger(__name__)
LoadFn = Callable[[Mapping[str, np.ndarray], int], Any]


def _peer(sock: socket.socket) -> str:
  try:
    return ":".join(str(x) for x in sock.getpeername()[:2])
  except OSError:
    return "?"


class _Node:
  """Listening socket, the pool that serves its connections and link limiters shared by
  Publisher and Receiver.

  Connections are bounded before anyone is authenticated: at most ``max_connections`` at once
  (``max_connections_per_peer`` from one address), each on a pooled thread; one more is closed
  at accept (stats ``connections_refused``), and a connection that has not sent an
  authenticated request ``handshake_timeout_s`` after accept is cut, however it paces its bytes.
  """

  def __init__(
      self,
      name: str,
      dc: str,
      host: Optional[str],
      config: Optional[Transfer],
      bind: Optional[str],
      port: int,
      secret: Optional[bytes],
      run_keys: Optional[RunKeys],
  ):
    config = config if config is not None else Transfer()
    config.check()  # a standalone user gets the run's errors too
    bind = config.bind if bind is None else bind
    self.name, self.dc, self.config = name, dc, config
    self._secret = check_secret(secret, bind, f"{type(self).__name__} {name!r}")
    self._keys = check_run_keys(run_keys, f"{type(self).__name__} {name!r}")
    self._tls = Tls(self._keys) if tls_enabled(config.tls, bind) else None
    self.host = host if host is not None else socket.gethostname()
    self._listener = socket.create_server((bind, port))
    self._listener.settimeout(0.25)
    advertised = bind if bind not in ("", "0.0.0.0", "::") else socket.gethostname()
    self.address: Address = (advertised, self._listener.getsockname()[1])
    self._closed = threading.Event()
    self._conns: set[socket.socket] = set()
    self._conns_lock = threading.Lock()
    self._serving = 0  # accepted connections admitted to the pool and not finished (_conns_lock)
    self._serving_from: collections.Counter = collections.Counter()  # the same, per peer address
    # One worker per admitted connection and never more than max_connections: admission is
    # capped at the pool's size, so a job never waits in its queue behind slow connections.
    self._conn_pool = ThreadPoolExecutor(config.max_connections, thread_name_prefix=f"{name}-conn")
    self._stats: collections.Counter = collections.Counter()
    self._stats_lock = threading.Lock()
    # burst: 10 ms of link time (at most 256 KiB), so pacing holds even for small payloads
    self._uplink, self._wan = (
        RateLimiter(r, burst=int(min(256 << 10, r * 0.01))) if r > 0 else None
        for r in (config.uplink_bytes_per_s, config.cross_dc_bytes_per_s)
    )
    self._executor = ThreadPoolExecutor(config.delta_threads, thread_name_prefix=f"{name}-delta")
    self._accept_thread = threading.Thread(
        target=self._accept_loop, name=f"{name}-accept", daemon=True
    )

  # -- plumbing
  @property
  def closed(self) -> bool:
    return self._closed.is_set()

  @property
  def stats(self) -> dict[str, int]:
    """Counters: streams served (served_tcp/shm/local/cross_dc), bytes per kind of link,
    auth_refused (requests refused for want of the secret), connections_refused (closed at
    accept: max_connections or max_connections_per_peer reached), ...; with an emulated link rate,
    what its limiter let through (``<link>_limited_bytes``) and slept (``<link>_limited_ms``)."""
    with self._stats_lock:
      out = dict(self._stats)
    for link, lim in (("uplink", self._uplink), ("cross_dc", self._wan)):
      if lim is not None:
        out[f"{link}_limited_bytes"] = lim.consumed
        out[f"{link}_limited_ms"] = int(lim.waited_s * 1000)
    return out

  def _count(self, key: str, n: int = 1) -> None:
    with self._stats_lock:
      self._stats[key] += n

  def _track(self, sock: socket.socket) -> None:
    with self._conns_lock:
      if self.closed:
        sock.close()
        raise TransferError(f"{self.name} is closed")
      self._conns.add(sock)

  def _untrack(self, sock: socket.socket) -> None:
    with self._conns_lock:
      self._conns.discard(sock)
    sock.close()

  def _accept_loop(self) -> None:
    while not self.closed:
      conn = None
      try:
        conn, addr = self._listener.accept()
        self._admit(conn, str(addr[0]))
      except socket.timeout:
        continue
      except Exception as e:  # whatever one connection does, the node must keep accepting
        if self.closed:
          return
        log.warning("%s: could not take a connection (%r); still accepting", self.name, e)
        if conn is None:  # accept() itself failed (say, out of descriptors): let some close
          self._closed.wait(0.1)

  def _admit(self, conn: socket.socket, peer: str) -> None:
    """Hands an accepted connection to the pool, or closes it at once when this node already
    serves max_connections, or max_connections_per_peer from ``peer``."""
    cfg = self.config
    with self._conns_lock:
      admit = (
          self._serving < cfg.max_connections
          and self._serving_from[peer] < cfg.max_connections_per_peer
      )
      if admit:
        self._serving += 1
        self._serving_from[peer] += 1
    if not admit:
      self._count("connections_refused")
      log.debug("%s: refused a connection from %s: too many open", self.name, peer)
      conn.close()
      return
    deadline = time.monotonic() + cfg.handshake_timeout_s  # from accept, not from a free worker
    claim = threading.Lock()  # whoever takes it owns the connection: its handler, or this loop
    try:
      self._conn_pool.submit(self._handle_conn, conn, peer, deadline, claim)
    except BaseException:
      # The executor queues a job before it starts a thread for it, so a submit that failed
      # may still run later: the claim lets exactly one side close it and free its slot.
      if claim.acquire(blocking=False):
        conn.close()
        self._release(peer)
      raise

  def _release(self, peer: str) -> None:
    with self._conns_lock:
      self._serving -= 1
      self._serving_from[peer] -= 1
      if self._serving_from[peer] <= 0:
        del self._serving_from[peer]

  def _handle_conn(
      self, conn: socket.socket, peer: str, deadline: float, claim: threading.Lock
  ) -> None:
    if not claim.acquire(blocking=False):
      return  # the accept loop gave up on this connection and closed it
    try:
      self._track(conn)
      if self._tls is not None:
        try:
          tls = self._tls.accept(conn, deadline)
        except (OSError, TransferError) as e:
          self._count("tls_refused")
          log.debug("%s: refused a connection from %s: %r", self.name, peer, e)
          return
        with self._conns_lock:
          self._conns.discard(conn)  # detached: the TLS socket owns the descriptor now
          self._conns.add(tls)
        conn = tls
      try:
        session, req = Session.accept(conn, self._secret, deadline)
      except AuthenticationError as e:
        self._count("auth_refused")
        log.warning("%s: refused a request from %s: %s", self.name, _peer(conn), e)
        send_error(conn, str(e), auth=True)
        return
      conn.settimeout(self.config.io_timeout_s)  # authenticated: from now on, progress counts
      self._dispatch(session, req)
    except (OSError, TransferError, ValueError, KeyError, TypeError, RecursionError) as e:
      # Peers come and go and retry; malformed input (a tree nested too deep included) is
      # theirs to fix: one line, no traceback.
      log.debug("%s: connection ended: %r", self.name, e)
    except Exception:  # a bug must not take the server down with it
      if not self.closed:  # (while closing, the delta executor refuses work: expected)
        log.exception("%s: unexpected error while serving a connection", self.name)
    finally:
      self._untrack(conn)
      self._release(peer)

  def _dispatch(self, session: Session, req: dict) -> None:
    """Acts on an (authenticated) request; replies go through ``session.reply``."""
    raise NotImplementedError

  def _request(
      self, address: Address, msg: dict, reply: bool = True, timeout: Optional[float] = None
  ) -> Optional[dict]:
    """One request to another node (authenticated with our secret); its reply if ``reply``.

    timeout: seconds for the whole exchange, connect to reply (default handshake_timeout_s):
    whoever answers at ``address`` cannot hold the caller longer, however it paces its bytes.
    """
    budget = self.config.handshake_timeout_s if timeout is None else timeout
    deadline = time.monotonic() + budget
    with self._connect(address, deadline) as sock:
      session = Session.request(sock, self._secret, msg, deadline)
      return session.recv_reply(deadline) if reply else None

  def _connect(self, address: Address, deadline: float) -> socket.socket:
    """A connection to another node, TLS with the pinned run certificate when ours is on; the
    TLS handshake ends by ``deadline`` too."""
    left = max(deadline - time.monotonic(), 0.001)
    sock = connect(address, min(self.config.connect_timeout_s, left))
    return sock if self._tls is None else self._tls.connect(sock, deadline)

  _seal: Optional[Callable[[Payload], bytes]] = None  # the publisher's (Link.seal)

  def close(self) -> None:
    """Stops serving and cuts every open connection (peers see the connection drop)."""
    self._closed.set()
    try:
      self._listener.close()
    except OSError:
      pass
    with self._conns_lock:
      conns = list(self._conns)
    for c in conns:
      try:
        c.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    self._executor.shutdown(wait=False, cancel_futures=True)
    self._conn_pool.shutdown(wait=False, cancel_futures=True)  # its workers end with their conns

  # -- serving and announcing
  def _limiters(self, client_dc: Any) -> tuple[RateLimiter, ...]:
    lims = [self._uplink] if self._uplink else []
    if self._wan and client_dc != self.dc:
      lims.append(self._wan)
    return tuple(lims)

  def _serve(
      self, session: Session, payload: Payload, req: dict, delta_base: Optional[Payload]
  ) -> None:
    """Streams ``payload`` to a client (after a get request)."""
    conn = session.sock
    plane, fields = choose_plane(payload, req, self.host, self.dc, self.config.use_shm)
    if plane.name != "tcp":
      delta_base = None
    link = Link(
        self._limiters(req.get("dc")),
        delta_base,
        self.config.delta_level,
        self._executor,
        self.config.io_timeout_s,
        seal=self._seal,
    )
    where = "local" if req.get("dc") == self.dc else "cross_dc"
    self._count(f"served_{plane.name}")  # streams started (bytes are counted when a stream ends)
    self._count(f"served_{where}")
    payload.open_stream()  # before the header: the payload's buffer must not be recycled under us
    try:
      session.reply(
          {
              "status": "ok",
              "plane": plane.name,
              "manifest": payload.manifest.without_checksums().to_json(),
              "base": delta_base.version if delta_base is not None else None,
              **fields,
          },
      )
      n = plane.send(conn, payload, link)
    except TransferError as e:
      send_error(conn, str(e))
      raise
    finally:
      payload.close_stream()
    self._count(f"{where}_{'delta' if delta_base is not None else 'full'}_bytes", n)

  def _announce_subtree(self, child: TreeNode, announce: dict) -> None:
    """Passes the publisher's signed ``announce`` ({"grant", "sig"}: ``Publisher._grant``) to
    ``child`` (with this node as source); adopts its subtree if unreachable."""
    msg = {
        "op": "announce",
        **announce,
        "source": list(self.address),
        # Where the source is: the child asks it for shared memory only if that is its own host
        # and datacenter (Receiver._fetch_from).
        "source_host": self.host,
        "source_dc": self.dc,
    }
    try:
      self._request(child.info.address, msg)
    except (OSError, TransferError) as e:
      log.info(
          "%s: receiver %s unreachable (%r); announcing to its children directly",
          self.name,
          child.info.name,
          e,
      )
      self._on_unreachable(child.info)
      for grandchild in child.children:  # we are their ancestor in the signed plan
        self._announce_subtree(grandchild, announce)

  def _announce_all(
      self, children: tuple[TreeNode, ...], announce_of: Callable[[TreeNode], dict]
  ) -> None:
    threads = [
        threading.Thread(target=self._announce_subtree, args=(c, announce_of(c)), daemon=True)
        for c in children
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join()

  def _on_unreachable(self, info: ReceiverInfo) -> None:
    raise NotImplementedError


@dataclasses.dataclass
class _Peer:
  info: ReceiverInfo
  alive: bool = True
  acked: int = -1
  refused: int = -1  # newest version this receiver refused for good (schema mismatch)
  error: Optional[str] = None
  announced_at: float = 0.0


class Publisher(_Node):
  """The trainer side: publishes versions and tracks who has loaded what.

  config: the run's ``transfer.*`` settings (``Transfer``; checked here, so a
  bad value fails with the run's message); ``enabled`` is not read.
  bind: the address to listen on (default ``config.bind``). dc/host: this
  node's datacenter and host labels. start_version: the version the
  generators start with (a publish gets start_version + 1, ...).
  expected_schema: if given, publish refuses tensors that do not match it.
  secret: the run's shared secret (``new_secret()``; the same bytes for every
  Receiver): required, on loopback too (ValueError otherwise). Every request
  is authenticated (transports.py).
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
    self.run_keys: RunKeys = keys
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
    self._accept_thread.start()
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
        target=self._announce_all,
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
    self._count("published")
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
    """May the segment holding ``old`` be rewritten now? (see payload.py)"""
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

  def _dispatch(self, session, req):
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
        self._on_unreachable(p.info)
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
    self._serve(session, payload, req, base if use_delta else None)

  def _ping(self, address: Address) -> bool:
    try:
      self._request(address, {"op": "ping"})
      return True
    except (OSError, TransferError):
      return False

  def _on_unreachable(self, info: ReceiverInfo) -> None:
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
    while not self._closed.wait(interval):
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
        self._announce_subtree(node, self._grant(v, node))


class Receiver(_Node):
  """One generator's end: receives, verifies, then calls ``load_fn(tensors, version)``.

  load_fn gets a ``VersionTensors``: read-only zero-copy arrays (HF name ->
  array) of a complete, verified version, and ``.path``, the safetensors file
  in /dev/shm they live in (None without /dev/shm); calls never overlap. The
  arrays stay valid at least until load_fn has returned for the next version
  (their file may then be rewritten): to use the bytes later, hold a
  ``payload.Pin`` on ``.path`` until done, or copy them.
  expected_schema: the model's tensor specs (TensorSpecs or {name: (shape, dtype)});
  a version that differs is refused. initial_version: what the generator serves now.
  config: the ``transfer.*`` settings, as for the Publisher. bind: default ``config.bind``.
  host: host label (same label and same datacenter as the sender -> shared memory).
  secret: the run's shared secret, the publisher's bytes: required, on
  loopback too (ValueError otherwise). Every request this node makes or
  serves is authenticated (its announces to its children too).
  run_keys: the publisher's ``run_keys`` (required): a version whose signatures do not verify
  is never loaded, and an announce the publisher did not sign is ignored.
  publisher: the publisher's address, the only one acks, nacks and suspicions go to (``join``
  sets it; a receiver the publisher knows from ``add_receiver`` and that never joins needs
  it). An announce names a source and a fallback to pull from, never where reports go.
  The server starts at construction; call ``join`` before serving prompts.
  """

  def __init__(
      self,
      name: str,
      dc: str,
      load_fn: LoadFn,
      expected_schema: Optional[SchemaLike] = None,
      *,
      config: Optional[Transfer] = None,
      host: Optional[str] = None,
      initial_version: int = 0,
      bind: Optional[str] = None,
      port: int = 0,
      secret: Optional[bytes] = None,
      run_keys: Optional[RunKeys] = None,
      publisher: Optional[Address] = None,
  ):
    super().__init__(name, dc, host, config, bind, port, secret, run_keys)
    sweep_orphans()  # what dead processes of this host left in /dev/shm goes
    self.load_fn = load_fn
    self._expected = as_schema(expected_schema) if expected_schema is not None else None
    self._cond = threading.Condition()
    self._load_lock = threading.Lock()
    self._version = initial_version
    self._current: Optional[Payload] = None
    self._inflight: Optional[Payload] = None
    self._target = initial_version
    self._source: Optional[Address] = None
    # Acks and nacks go to _publisher only, never to an address an announce names: a peer that
    # announced itself as publisher would otherwise hear what every attempt found.
    self._publisher: Optional[Address] = tuple(publisher) if publisher is not None else None
    self._fallback: Optional[Address] = None  # where failed attempts retry (the last announce's)
    # address -> (host, dc) of the nodes we may pull from, as they told us (ping, announce): we
    # ask for shared memory only from one on our host and in our datacenter.
    self._sites: "collections.OrderedDict[Address, tuple[str, str]]" = collections.OrderedDict()
    self._gave_up: dict[int, bool] = {}  # version -> permanent?
    self._fetching = False
    self._retired: list[Segment] = []  # our staging files no longer served: reused or unlinked
    self._spare: Optional[Segment] = None  # staging memory faulted in ahead of need
    self._preparing = False  # a thread (_preparer) is faulting in a spare
    self._preparer: Optional[threading.Thread] = None
    self.last_error: Optional[str] = None
    self._last_exc: Optional[Exception] = None
    self._fetch_thread = threading.Thread(
        target=self._fetch_loop, name=f"{name}-fetch", daemon=True
    )
    self._accept_thread.start()
    self._fetch_thread.start()

  # -- public API
  @property
  def version(self) -> int:
    """The version load_fn last loaded (the one the generator serves)."""
    return self._version

  @property
  def info(self) -> ReceiverInfo:
    return ReceiverInfo(self.name, self.dc, self.host, self.address)

  def join(self, publisher: Address, timeout: float = 60.0) -> int:
    """Registers with the publisher and loads its latest version before returning it.

    Raises TimeoutError if that takes longer than ``timeout``, SchemaMismatch
    if the latest version does not fit the model, TransferError if it could
    not be delivered.
    """
    self._publisher = tuple(publisher)
    hello = self._request(self._publisher, {"op": "ping"}, timeout=self.config.io_timeout_s)
    shm = (
        self.config.use_shm
        and hello.get("shm")
        and hello.get("host") == self.host
        and hello.get("dc") == self.dc
    )
    if shm:
      self._note_site(self._publisher, self.host, self.dc)
    if self._expected is not None and not shm and self._spare is None:
      # Versions may land in our own staging file: fault it in now, before we serve, rather
      # than while the first version streams in (first-touching 1 GB costs seconds on a busy VM).
      spare = create_segment(payload_nbytes(self._expected), shared=shm_available())
      np.frombuffer(spare.buf, np.uint8).fill(0)
      with self._cond:
        self._spare = spare
    reply = self._request(
        self._publisher,
        {"op": "register", "info": self.info.to_json(), "version": self._version},
        timeout=self.config.io_timeout_s,
    )
    latest = int(reply["latest"])
    with self._cond:
      if latest > self._target:
        self._target, self._source = latest, self._publisher
        self._gave_up.pop(latest, None)
        self._cond.notify_all()
      ok = self._cond.wait_for(
          lambda: self._version >= latest or latest in self._gave_up or self.closed, timeout
      )
    if self._version >= latest:
      return self._version
    if not ok:
      raise TimeoutError(
          f"receiver {self.name} did not load version {latest} within {timeout}s "
          f"(last error: {self.last_error}); check the publisher and the network."
      )
    if isinstance(self._last_exc, SchemaMismatch):
      raise SchemaMismatch(str(self._last_exc))
    raise TransferError(f"receiver {self.name} could not load version {latest}: {self.last_error}")

  def wait_version(self, version: int, timeout: float) -> bool:
    """True once ``version`` (or newer) is loaded."""
    with self._cond:
      return self._cond.wait_for(lambda: self._version >= version, timeout)

  def close(self) -> None:
    """Stops serving and removes this receiver's staging files from /dev/shm."""
    with self._cond:
      self._closed.set()
      self._cond.notify_all()
    super().close()  # cuts the streams: a fetch in progress fails fast
    if threading.current_thread() is not self._fetch_thread:
      self._fetch_thread.join(self.config.io_timeout_s)
    if self._preparer is not None:
      self._preparer.join()
    with self._cond:
      owned = [p.segment for p in (self._current, self._inflight) if p is not None]
      owned += [*self._retired, self._spare]
      for p in (self._current, self._inflight):
        if p is not None:
          p.release()
      self._retired, self._spare = [], None
    for seg in owned:
      if seg is not None:
        seg.unlink()

  # -- server side
  def _dispatch(self, session, req):
    op = req.get("op")
    if op == "announce":
      self._handle_announce(session, req)
    elif op == "get":
      self._handle_get(session, req)
    elif op == "ping":
      session.reply({"ok": True, "version": self._version})

  def _handle_announce(self, session, req):
    granted = self._granted(req)
    if granted is None:
      self._count("announces_refused")
      session.reply({"ok": False})
      return
    v, publisher, node = granted
    source = tuple(req["source"])
    if "source_host" in req:
      self._note_site(source, str(req["source_host"]), str(req.get("source_dc")))
    with self._cond:
      self._fallback = publisher  # a place to pull from; reports still go to self._publisher
      fresh = v > self._target and self._gave_up.get(v) is not True  # not refused for good
      retry = v == self._target and not self._fetching and self._gave_up.get(v) is False
      if fresh or (retry and v > self._version):
        self._target, self._source = v, source
        self._gave_up.pop(v, None)
        self._cond.notify_all()
    session.reply({"ok": True})
    if node.children:
      announce = {"grant": req["grant"], "sig": req["sig"]}  # passed on as the publisher made it
      self._announce_all(node.children, lambda child: announce)

  def _granted(self, req: dict) -> Optional[tuple[int, Address, TreeNode]]:
    """(version, publisher, our node of the plan) of an announce the publisher signed that comes
    from the publisher or one of our parents in that plan; None (logged) for any other: whoever
    holds the secret can send an announce, only the publisher can sign one."""
    grant, sig = req.get("grant"), req.get("sig")
    try:
      signed = isinstance(grant, dict) and self._keys.verifies(
          b"announce", grant, bytes.fromhex(sig)
      )
    except (TypeError, ValueError):
      signed = False
    if not signed:
      why = "it is not signed with the publisher's key"
    else:
      v, publisher = int(grant["version"]), tuple(grant["publisher"])
      path = _path_to(TreeNode.from_json(grant["tree"]), self.name)
      source = tuple(req.get("source", ()))
      parents = {tuple(n.info.address) for n in (path or [])[:-1]}
      if path is None:
        why = "its plan does not include this receiver"
      elif source != publisher and source not in parents:
        why = f"it comes from {source}, neither the publisher nor a parent of this receiver"
      else:
        return v, publisher, path[-1]
    log.warning("%s: ignored an announce: %s", self.name, why)
    return None

  def _handle_get(self, session, req):
    want = int(req.get("want", 0))
    deadline = time.monotonic() + self.config.io_timeout_s
    with self._cond:
      while True:
        cands = [p for p in (self._current, self._inflight) if p is not None and p.version >= want]
        if (
            cands
            or self.closed
            or want > self._target
            or (not self._fetching and self._target in self._gave_up)
        ):
          break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          break
        self._cond.wait(remaining)
    if not cands:
      session.reply({"status": "notfound", "latest": self._version})
      return
    self._serve(session, max(cands, key=lambda p: p.version), req, delta_base=None)

  def _on_unreachable(self, info: ReceiverInfo) -> None:
    self._tell_publisher({"op": "suspect", "name": info.name})

  # -- client side
  MAX_SITES = 64  # nodes whose host and dc we remember (sources come and go)

  def _note_site(self, address: Address, host: str, dc: str) -> None:
    with self._cond:
      self._sites[tuple(address)] = (host, dc)
      self._sites.move_to_end(tuple(address))
      while len(self._sites) > self.MAX_SITES:
        self._sites.popitem(last=False)

  def _same_site(self, address: Address) -> bool:
    """Whether the node at ``address`` said it is on our host and in our datacenter (shared
    memory is only worth asking, and only trusted, there)."""
    with self._cond:
      return shm_available() and self._sites.get(tuple(address)) == (self.host, self.dc)

  def _tell_publisher(self, msg: dict) -> None:
    """An ack, nack or suspicion, to the publisher we joined (or were built with) only."""
    if self._publisher is None:
      return
    try:
      self._request(self._publisher, msg, reply=False)
    except (OSError, TransferError) as e:
      log.debug("%s: could not tell the publisher %s: %r", self.name, msg.get("op"), e)

  def _fetch_loop(self) -> None:
    while True:
      with self._cond:
        self._cond.wait_for(
            lambda: self.closed
            or (self._target > self._version and self._target not in self._gave_up)
        )
        if self.closed:
          return
        v, first = self._target, self._source
        self._fetching = True
      try:
        self._fetch_version(v, first)
      except Exception as e:  # never let the loop die: record and give up on this version
        log.exception("%s: unexpected error fetching version %d", self.name, v)
        self._give_up(v, f"unexpected error: {e!r}", permanent=False, exc=e)
      finally:
        with self._cond:
          self._fetching = False
          self._cond.notify_all()

  def _give_up(self, v: int, reason: str, permanent: bool, exc: Optional[Exception] = None) -> None:
    with self._cond:
      self.last_error, self._last_exc = reason, exc
      self._gave_up[v] = permanent
      if self._target == v:
        # A version that cannot be had (say, a bogus announce) must not hold the receiver: any
        # newer announce counts again (and this one again, unless it was refused for good).
        self._target = self._version
      self._cond.notify_all()
    self._tell_publisher(
        {"op": "nack", "name": self.name, "version": v, "reason": reason, "permanent": permanent}
    )

  def _fetch_version(self, v: int, first: Optional[Address]) -> None:
    """Up to 1 + max_retries attempts: the announced source first, then the publisher (the one
    the last announce named, else ours)."""
    pub = self._fallback if self._fallback is not None else self._publisher
    sources = [first] if first is not None and first != pub else []
    sources += [pub if pub is not None else first] * (1 + self.config.max_retries)
    sources = sources[: 1 + self.config.max_retries]
    use_shm, reason = self.config.use_shm, "no source"
    for k, src in enumerate(sources):
      if self.closed or self._version >= v:
        return
      try:
        if self._fetch_from(src, v, use_shm) >= v:
          return
        reason = f"{src} has no version >= {v}"
      except SchemaMismatch as e:
        self._give_up(v, str(e), permanent=True, exc=e)
        return
      except (TransferError, OSError) as e:
        reason = f"attempt {k + 1} from {src}: {e}"
        use_shm = False  # if the segment was the problem, TCP still works
      log.info("%s: %s", self.name, reason)
      self._count("failed_attempts")
      with self._cond:
        self.last_error = reason
        if self._cond.wait_for(lambda: self.closed or self._target > v, min(0.05 * 2**k, 1.0)):
          return  # closing, or a newer version was announced: go for that one (newest wins)
    self._give_up(v, reason, permanent=False)

  def _fetch_from(self, src: Address, want: int, use_shm: bool) -> int:
    """One attempt; returns the version loaded afterwards. Raises on any damage."""
    # Shared memory is our decision, not the sender's: only from a node we know is on our host
    # and in our datacenter (the header then names a file we map, and we report on its bytes).
    use_shm = use_shm and self._same_site(src)
    # Connect, handshake and header have one deadline, whoever answers at ``src``; a source
    # may hold the header up to io_timeout_s while the version reaches it (Receiver._handle_get).
    deadline = time.monotonic() + self.config.handshake_timeout_s + self.config.io_timeout_s
    sock = self._connect(src, deadline)
    self._track(sock)
    payload = None
    try:
      base = self._current
      session = Session.request(
          sock,
          self._secret,
          {
              "op": "get",
              "want": want,
              "name": self.name,
              "dc": self.dc,
              "host": self.host,
              "shm": use_shm,
              "base": base.version if base is not None else None,
          },
          deadline,
      )
      header = session.recv_reply(deadline)
      sock.settimeout(self.config.io_timeout_s)  # the stream: io_timeout_s without progress
      if header.get("status") != "ok":
        return self._version
      manifest = Manifest.from_json(header["manifest"])
      if manifest.version <= self._version:
        return self._version
      if self._expected is not None:
        check_schema(manifest.tensors, self._expected, manifest.version)
      plane = PLANES.get(header.get("plane"))
      if plane is None:
        raise TransferError(f"unknown data plane {header.get('plane')!r}")
      if not plane.copies and not use_shm:
        raise TransferError(
            f"{src[0]}:{src[1]} answered with shared memory, which this receiver did not ask it "
            "for; refused"
        )
      if header.get("base") is not None and (
          base is None or header["base"] != base.version or base.manifest.layout != manifest.layout
      ):
        raise TransferError("sender chose a delta base this receiver does not hold")
      payload = plane.open(header, manifest, self._staging_buffer)
      with self._cond:
        self._inflight = payload
        self._cond.notify_all()
      n, tags = plane.fill(
          sock,
          header,
          payload,
          base if header.get("base") is not None else None,
          self.config.io_timeout_s,
      )
      # Before anything is loaded or passed on as complete: the publisher signed this manifest,
      # and for bytes that crossed a socket the digests they were just hashed against.
      tag, full_tag = tags[:SIGNATURE_BYTES], tags[SIGNATURE_BYTES:]
      signed = self._keys.verifies(b"manifest", payload.full_manifest.to_json(), tag)
      if signed and plane.copies:
        signed = self._keys.verifies(
            b"manifest", payload.signed_manifest(full=True).to_json(), full_tag
        )
      if not signed:
        raise AuthenticationError(
            f"authentication failed: version {manifest.version} from {src[0]}:{src[1]} does not "
            "carry a valid manifest tag (the publisher's signature); not loaded"
        )
      payload.set_tag(tag, full_tag if plane.copies else None)  # passed on to children unchanged
      self._count("bytes_received", n)
      copied = manifest.total_bytes if plane.copies else 0
      self._count("bytes_copied", copied)
      tensors = payload.tensors()
    except BaseException as e:
      if payload is not None:
        payload.fail(str(e))
        with self._cond:
          if self._inflight is payload:
            self._inflight = None
            self._cond.notify_all()
          self._retire(payload)
      raise
    finally:
      if payload is not None and payload.segment is not None:
        payload.segment.end_rewrite()  # our reused staging file is written: it may be pinned
      self._untrack(sock)
    self._load(payload, tensors, copied)
    return self._version

  def _retire(self, payload: Payload) -> None:
    """This receiver stops serving ``payload``: its pin goes, and a staging file of ours joins
    the retired ones (reused or unlinked by ``_staging_buffer``). Under ``_cond``."""
    payload.release()
    seg = payload.segment
    if seg is not None and self.closed:
      seg.unlink()
    elif seg is not None and all(seg is not r for r in self._retired):
      self._retired.append(seg)

  def _staging_buffer(self, nbytes: int) -> Segment:
    """Where a version received over TCP lands: the spare faulted in ahead, else the newest
    retired staging file that no stream reads and nobody pins, else a fresh file. Retired files
    still read or pinned are kept (a generator may load one by path); the others are unlinked."""
    with self._cond:
      # A spare being faulted in has a head start on any fresh file we could make: wait for it
      # (else both get made, and the late spare displaces the two-file rotation).
      while self._preparing and not self.closed:
        self._cond.wait()
      if self.closed:
        raise TransferError(f"{self.name} is closed")
      if self._spare is not None and len(self._spare.buf) == nbytes:
        spare, self._spare = self._spare, None
        return spare
      retired, self._retired = self._retired, []
    chosen, keep = None, []
    for seg in reversed(retired):
      if seg.payload is not None and seg.payload.streams:
        keep.append(seg)
      elif chosen is None and len(seg.buf) == nbytes and seg.begin_rewrite():
        chosen = seg  # locked until _fetch_from has written it: nobody pins it half-written
      elif seg.pinned():
        keep.append(seg)
      else:
        seg.unlink()
    with self._cond:
      self._retired[:0] = reversed(keep)
    return chosen if chosen is not None else create_segment(nbytes, shared=shm_available())

  def _load(self, payload: Payload, tensors: VersionTensors, copied: int) -> None:
    with self._load_lock:
      if payload.version <= self._version:
        with self._cond:
          if self._inflight is payload:
            self._inflight = None
          if payload is not self._current:
            self._retire(payload)
        return
      try:
        self.load_fn(tensors, payload.version)
      except Exception as e:
        with self._cond:
          if self._inflight is payload:
            self._inflight = None
          self._retire(payload)
        payload.fail(f"load_fn failed: {e!r}")
        raise TransferError(f"load_fn failed on version {payload.version}: {e!r}") from e
      with self._cond:
        if self._current is not None:
          self._retire(self._current)
        self._version, self._current = payload.version, payload
        if payload.segment is None and self._spare is not None:
          # We map a same-host file (another receiver here receives for this host): no staging.
          self._spare.unlink()
          self._spare = None
        # The first version we received ourselves: the next one needs a second file (the current
        # one stays served and is its delta base). Fault it in now, off the critical path: fresh
        # shared memory costs ~1.3 s/GB on this VM; afterwards two files alternate.
        prepare = (
            payload.segment is not None
            and payload.segment.shm is not None
            and self._spare is None
            and not self._retired
            and not self._preparing
        )
        self._preparing |= prepare
        if self._inflight is payload:
          self._inflight = None
        self.last_error = None
        self._cond.notify_all()
    self._count("loads")
    self._tell_publisher(
        {"op": "ack", "name": self.name, "version": payload.version, "copied": copied}
    )
    if prepare:
      with self._cond:  # close() sets closed under _cond, then joins the preparer
        if self.closed:
          self._preparing = False
        else:
          self._preparer = threading.Thread(
              target=self._prepare_spare, args=(payload.manifest.total_bytes,), daemon=True
          )
          self._preparer.start()

  def _prepare_spare(self, nbytes: int) -> None:
    spare = create_segment(nbytes, shared=True)
    with self._cond:
      self._preparing = False
      if self._spare is None and not self._retired and not self.closed:
        self._spare, spare = spare, None
      self._cond.notify_all()
    if spare is not None:  # not needed any more
      spare.unlink()


def _path_to(tree: TreeNode, name: str) -> Optional[list[TreeNode]]:
  """The nodes from ``tree`` down to the receiver called ``name`` (names are unique in a plan)."""
  if tree.info is not None and tree.info.name == name:
    return [tree]
  for child in tree.children:
    below = _path_to(child, name)
    if below is not None:
      return [tree, *below]
  return None


# ---------------------------------------------------------------- process mode


def relay_only(tensors: Mapping[str, np.ndarray], version: int) -> None:
  """load_fn of a node that only verifies and forwards (a pure relay, or a benchmark receiver)."""


def spawn_receiver(
    name: str,
    dc: str,
    load_fn: LoadFn,
    publisher: Address,
    *,
    expected_schema: Optional[SchemaLike] = None,
    config: Optional[Transfer] = None,
    host: Optional[str] = None,
    initial_version: int = 0,
    bind: Optional[str] = None,
    secret: Optional[bytes] = None,
    run_keys: Optional[RunKeys] = None,
) -> multiprocessing.Process:
  """Starts a Receiver in a fresh ``spawn`` process that joins ``publisher`` and serves until
  terminated (``terminate()`` closes it cleanly, files included) or killed.

  load_fn must be a module-level function (the child imports it by name);
  the schema and config travel as plain lists/dicts, the secret and ``run_keys`` (required:
  the publisher's) over the process's own spawn pipe (never over the
  transfer network). The child exits when its parent dies.
  """
  config = config if config is not None else Transfer()
  config.check()  # fail here, not in the child
  bind = config.bind if bind is None else bind
  check_secret(secret, bind, f"receiver {name!r}")
  check_run_keys(run_keys, f"receiver {name!r}")
  schema = (
      None
      if expected_schema is None
      else [[s.name, list(s.shape), s.dtype] for s in as_schema(expected_schema)]
  )
  cfg = dataclasses.asdict(config)
  proc = multiprocessing.get_context("spawn").Process(
      target=_receiver_main,
      name=f"receiver-{name}",
      daemon=True,
      args=(name, dc, load_fn, list(publisher), schema, cfg, host, initial_version, os.getpid()),
      kwargs={"bind": bind, "secret": secret, "run_keys": run_keys},
  )
  proc.start()
  return proc


def _receiver_main(
    name,
    dc,
    load_fn,
    publisher,
    schema,
    cfg,
    host,
    initial_version,
    parent_pid,
    bind,
    secret,
    run_keys,
) -> None:
  logging.basicConfig(level=logging.WARNING)
  # SIGTERM (Process.terminate) closes the receiver, which removes its files from /dev/shm;
  # after SIGKILL the resource tracker does.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
  expected = None if schema is None else [TensorSpec(n, tuple(s), d) for n, s, d in schema]
  r = Receiver(
      name,
      dc,
      load_fn,
      expected,
      config=Transfer(**cfg),
      host=host,
      initial_version=initial_version,
      bind=bind,
      secret=secret,
      run_keys=run_keys,
  )
  try:
    r.join(tuple(publisher))
    while not r.closed and os.getppid() == parent_pid:
      time.sleep(0.5)
  finally:
    r.close()
