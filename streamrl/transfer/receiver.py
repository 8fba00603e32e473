"""One generator's end of the checkpoint-transfer service: hears announces, pulls, verifies,
loads, and serves what it holds on to its children.

A receiver that hears an announce forwards it at once to its own children
(naming itself as their source) and pulls the version from its source:
manifest first (schema refused before any data), then chunks, each committed
only once its checksum matches and served on at once, so a tree is pipelined.
Only when all chunks are verified, the publisher's signatures check out and the
safetensors header agrees with the manifest does it call ``load_fn``; then it
acks, reporting how many bytes it copied (``Publisher.copied_bytes``).
Announces count only when the publisher signed them and they come from it or
from a parent in the plan they carry (stats ``announces_refused``).

Faults: a damaged or cut stream fails only that attempt: the receiver keeps
its old version and retries (``max_retries`` times, falling back from its tree
parent to the publisher), then reports a nack. A dead receiver cannot block
anyone: its children's pulls fail fast (EOF or ``io_timeout_s``) and fall back
to the publisher. A receiver ignores versions <= its own and always pulls the
newest it has heard of; a version whose fetch gives up no longer holds it. A
late joiner pulls the latest version before ``join`` returns, i.e. before it serves.

Shared memory is the receiver's decision: it asks for it only from a node it knows is on its host
and in its datacenter (the publisher's ping, an announce's ``source_host``/``source_dc``), refuses
a header that offers it unasked, and maps only a regular file of its own user that this service
named (shm.py). Nothing it computes from the bytes goes back to a peer: a failed chunk's
error names the chunk, and acks and nacks go only to the publisher it joined.

Memory: one copy per host. On every host but the publisher's, one receiver
receives into a staging file of its own which that host's other receivers map
(topology.py); two staging files alternate, the spare faulted in ahead of need.
Every file is unlinked on ``close`` (and by the resource tracker if its process
dies; if the tracker died too, by the next node that starts on the host, or the
watchdog: ``shm.sweep_orphans``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

import numpy as np

from streamrl.transfer.config import Transfer
from streamrl.transfer.manifest import (
    Manifest,
    SchemaLike,
    SchemaMismatch,
    TransferError,
    as_schema,
    check_schema,
    payload_nbytes,
)
from streamrl.transfer.node import Node
from streamrl.transfer.payload import Payload, VersionTensors
from streamrl.transfer.planes import PLANES
from streamrl.transfer.security import SIGNATURE_BYTES, RunKeys
from streamrl.transfer.shm import Segment, create_segment, shm_available, sweep_orphans
from streamrl.transfer.topology import Address, ReceiverInfo, TreeNode, path_to
from streamrl.transfer.wire import AuthenticationError

log = logging.getLogger(__name__)
# load_fn(tensors, version): tensors are a VersionTensors (HF name -> read-only array).
LoadFn = Callable[[Mapping[str, np.ndarray], int], Any]


class Receiver(Node):
  """One generator's end: receives, verifies, then calls ``load_fn(tensors, version)``.

  load_fn gets a ``VersionTensors``: read-only zero-copy arrays (HF name ->
  array) of a complete, verified version, and ``.path``, the safetensors file
  in /dev/shm they live in (None without /dev/shm); calls never overlap. The
  arrays stay valid at least until load_fn has returned for the next version
  (their file may then be rewritten): to use the bytes later, hold a
  ``shm.Pin`` on ``.path`` until done, or copy them.
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
    self.start_accepting()
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
    hello = self.request(self._publisher, {"op": "ping"}, timeout=self.config.io_timeout_s)
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
      # than while the first version streams in (first-touching fresh memory is slow).
      spare = create_segment(payload_nbytes(self._expected), shared=shm_available())
      np.frombuffer(spare.buf, np.uint8).fill(0)
      with self._cond:
        self._spare = spare
    reply = self.request(
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
      self.mark_closed()
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
  def dispatch(self, session, req):
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
      self.add_stat("announces_refused")
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
      self.announce_all(node.children, lambda child: announce)

  def _granted(self, req: dict) -> Optional[tuple[int, Address, TreeNode]]:
    """(version, publisher, our node of the plan) of an announce the publisher signed that comes
    from the publisher or one of our parents in that plan; None (logged) for any other: whoever
    holds the secret can send an announce, only the publisher can sign one."""
    grant, sig = req.get("grant"), req.get("sig")
    try:
      signed = isinstance(grant, dict) and self.run_keys.verifies(
          b"announce", grant, bytes.fromhex(sig)
      )
    except (TypeError, ValueError):
      signed = False
    if not signed:
      why = "it is not signed with the publisher's key"
    else:
      v, publisher = int(grant["version"]), tuple(grant["publisher"])
      path = path_to(TreeNode.from_json(grant["tree"]), self.name)
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
    self.serve(session, max(cands, key=lambda p: p.version), req, delta_base=None)

  def on_unreachable(self, info: ReceiverInfo) -> None:
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
      self.request(self._publisher, msg, reply=False)
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
      self.add_stat("failed_attempts")
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
    sock = self.connect_to(src, deadline)
    self.track(sock)
    payload = None
    try:
      base = self._current
      session = self.open_session(
          sock,
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
      signed = self.run_keys.verifies(b"manifest", payload.full_manifest.to_json(), tag)
      if signed and plane.copies:
        signed = self.run_keys.verifies(
            b"manifest", payload.signed_manifest(full=True).to_json(), full_tag
        )
      if not signed:
        raise AuthenticationError(
            f"authentication failed: version {manifest.version} from {src[0]}:{src[1]} does not "
            "carry a valid manifest tag (the publisher's signature); not loaded"
        )
      payload.set_tag(tag, full_tag if plane.copies else None)  # passed on to children unchanged
      self.add_stat("bytes_received", n)
      copied = manifest.total_bytes if plane.copies else 0
      self.add_stat("bytes_copied", copied)
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
      self.untrack(sock)
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
        # one stays served and is its delta base). Fault it in now, off the critical path (fresh
        # shared memory is slow to touch first); afterwards two files alternate.
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
    self.add_stat("loads")
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
