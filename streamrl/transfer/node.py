"""A transfer node, what Publisher and Receiver share: it accepts connections, admits a bounded
number, authenticates each request and hands it to its subclass, serves a payload over a data
plane and passes announces down the plan.

Authentication (``secret``, security.py): every node must be given the
run's shared secret (``new_secret()``; ValueError otherwise, on loopback
too, since any local process can reach 127.0.0.1). Every connection is
authenticated both ways with HMAC-SHA256 challenge-response over fresh
nonces, and a request that fails is refused with an error frame before it
is acted on (stats ``auth_refused``: no data, no registration). A
wrong-secret source therefore fails the attempt (``last_error`` says
authentication) and the receiver keeps its old version. Every node also
needs the publisher's keys (``run_keys``, security.py): only the publisher
signs announces and manifests.

TLS (``transfer.tls``, on by default off loopback): every connection, the relays' included, is
TLS 1.3 with the run's certificate (``run_keys``), pinned by every client.

Hostile peers: until a peer has proven the secret it gets small frames
(wire.py), one deadline for its whole handshake (``handshake_timeout_s``)
and a bounded share of the node's connections (``max_connections``,
``max_connections_per_peer``); nothing is allocated for it, parsed beyond
its bounded frames, or opened before then. A client's exchanges have
deadlines too, so whoever answers at a receiver's address cannot hold
``publish``.
"""

from __future__ import annotations

import abc
import collections
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from streamrl.transfer.config import Transfer
from streamrl.transfer.manifest import TransferError
from streamrl.transfer.payload import Payload
from streamrl.transfer.planes import Link, RateLimiter, choose_plane
from streamrl.transfer.security import (
    RunKeys,
    Session,
    Tls,
    check_run_keys,
    check_secret,
    tls_enabled,
)
from streamrl.transfer.topology import Address, ReceiverInfo, TreeNode
from streamrl.transfer.wire import AuthenticationError, connect, send_error

log = logging.getLogger(__name__)


def _peer(sock: socket.socket) -> str:
  try:
    return ":".join(str(x) for x in sock.getpeername()[:2])
  except OSError:
    return "?"


class Node(abc.ABC):
  """Listening socket, the pool that serves its connections and link limiters shared by
  Publisher and Receiver.

  Connections are bounded before anyone is authenticated: at most ``max_connections`` at once
  (``max_connections_per_peer`` from one address), each on a pooled thread; one more is closed
  at accept (stats ``connections_refused``), and a connection that has not sent an
  authenticated request ``handshake_timeout_s`` after accept is cut, however it paces its bytes.

  The node listens from construction (on ``bind``: loopback unless the config or the caller
  names another address) and accepts once the subclass calls ``start_accepting``; an
  authenticated request goes to ``dispatch``, a child found unreachable to ``on_unreachable``.
  run_keys: the publisher's keys (security.py), checked here.
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
    self.run_keys = check_run_keys(run_keys, f"{type(self).__name__} {name!r}")
    self._tls = Tls(self.run_keys) if tls_enabled(config.tls, bind) else None
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
  def start_accepting(self) -> None:
    """Starts taking connections; a subclass calls it once, when its own state is set up."""
    self._accept_thread.start()

  @property
  def closed(self) -> bool:
    return self._closed.is_set()

  def mark_closed(self) -> None:
    """Sets ``closed`` without cutting anything yet (``close`` does both): a subclass whose
    threads wait on a condition of its own sets it under that condition, so they wake."""
    self._closed.set()

  def wait_closed(self, timeout: float) -> bool:
    """Blocks until the node is closed or ``timeout`` seconds have passed; True if closed."""
    return self._closed.wait(timeout)

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

  def add_stat(self, key: str, n: int = 1) -> None:
    """Adds ``n`` to the counter ``key`` of ``stats``."""
    with self._stats_lock:
      self._stats[key] += n

  def track(self, sock: socket.socket) -> None:
    """Counts ``sock`` among the connections ``close`` cuts; TransferError (and ``sock``
    closed) if the node is closed already."""
    with self._conns_lock:
      if self.closed:
        sock.close()
        raise TransferError(f"{self.name} is closed")
      self._conns.add(sock)

  def untrack(self, sock: socket.socket) -> None:
    """Closes a connection ``track`` counted, and forgets it."""
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
      self.add_stat("connections_refused")
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
      self.track(conn)
      if self._tls is not None:
        try:
          tls = self._tls.accept(conn, deadline)
        except (OSError, TransferError) as e:
          self.add_stat("tls_refused")
          log.debug("%s: refused a connection from %s: %r", self.name, peer, e)
          return
        with self._conns_lock:
          self._conns.discard(conn)  # detached: the TLS socket owns the descriptor now
          self._conns.add(tls)
        conn = tls
      try:
        session, req = Session.accept(conn, self._secret, deadline)
      except AuthenticationError as e:
        self.add_stat("auth_refused")
        log.warning("%s: refused a request from %s: %s", self.name, _peer(conn), e)
        send_error(conn, str(e), auth=True)
        return
      conn.settimeout(self.config.io_timeout_s)  # authenticated: from now on, progress counts
      self.dispatch(session, req)
    except (OSError, TransferError, ValueError, KeyError, TypeError, RecursionError) as e:
      # Peers come and go and retry; malformed input (a tree nested too deep included) is
      # theirs to fix: one line, no traceback.
      log.debug("%s: connection ended: %r", self.name, e)
    except Exception:  # a bug must not take the server down with it
      if not self.closed:  # (while closing, the delta executor refuses work: expected)
        log.exception("%s: unexpected error while serving a connection", self.name)
    finally:
      self.untrack(conn)
      self._release(peer)

  @abc.abstractmethod
  def dispatch(self, session: Session, req: dict) -> None:
    """Acts on an (authenticated) request; replies go through ``session.reply``."""

  def request(
      self, address: Address, msg: dict, reply: bool = True, timeout: Optional[float] = None
  ) -> Optional[dict]:
    """One request to another node (authenticated with our secret); its reply if ``reply``.

    timeout: seconds for the whole exchange, connect to reply (default handshake_timeout_s):
    whoever answers at ``address`` cannot hold the caller longer, however it paces its bytes.
    """
    budget = self.config.handshake_timeout_s if timeout is None else timeout
    deadline = time.monotonic() + budget
    with self.connect_to(address, deadline) as sock:
      session = self.open_session(sock, msg, deadline)
      return session.recv_reply(deadline) if reply else None

  def open_session(self, sock: socket.socket, msg: dict, deadline: float) -> Session:
    """Client side: sends ``msg`` over ``sock`` (from ``connect_to``) as a request authenticated
    with this node's secret, all of it by ``deadline``; the session then takes the reply."""
    return Session.request(sock, self._secret, msg, deadline)

  def connect_to(self, address: Address, deadline: float) -> socket.socket:
    """A connection to another node, TLS with the pinned run certificate when ours is on; the
    TLS handshake ends by ``deadline`` too."""
    left = max(deadline - time.monotonic(), 0.001)
    sock = connect(address, min(self.config.connect_timeout_s, left))
    return sock if self._tls is None else self._tls.connect(sock, deadline)

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

  def serve(
      self,
      session: Session,
      payload: Payload,
      req: dict,
      delta_base: Optional[Payload],
      seal: Optional[Callable[[Payload], bytes]] = None,
  ) -> None:
    """Streams ``payload`` to a client (after its get request ``req``): the header, then the
    bytes over the plane that reaches it, as XOR deltas against ``delta_base`` over TCP if given.
    seal: the publisher's (``Link.seal``): signs a manifest with its digests when a TCP stream
    first needs it."""
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
        seal=seal,
    )
    where = "local" if req.get("dc") == self.dc else "cross_dc"
    self.add_stat(f"served_{plane.name}")  # streams started (bytes are counted when a stream ends)
    self.add_stat(f"served_{where}")
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
    self.add_stat(f"{where}_{'delta' if delta_base is not None else 'full'}_bytes", n)

  def announce_subtree(self, child: TreeNode, announce: dict) -> None:
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
      self.request(child.info.address, msg)
    except (OSError, TransferError) as e:
      log.info(
          "%s: receiver %s unreachable (%r); announcing to its children directly",
          self.name,
          child.info.name,
          e,
      )
      self.on_unreachable(child.info)
      for grandchild in child.children:  # we are their ancestor in the signed plan
        self.announce_subtree(grandchild, announce)

  def announce_all(
      self, children: tuple[TreeNode, ...], announce_of: Callable[[TreeNode], dict]
  ) -> None:
    """Announces to every child at once (``announce_of(child)``: its signed announce) and
    returns when each has answered or its subtree has been announced to directly."""
    threads = [
        threading.Thread(target=self.announce_subtree, args=(c, announce_of(c)), daemon=True)
        for c in children
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join()

  @abc.abstractmethod
  def on_unreachable(self, info: ReceiverInfo) -> None:
    """A child the plan names did not answer its announce (its subtree is announced to
    directly)."""
