"""The checkpoint-transfer service's settings (`transfer.*`): the run reads them, and
`Publisher` (streamrl/transfer/publisher.py) and `Receiver` (receiver.py) take them as they
are."""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import in_range, need, one_of, positive


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Weights to Ray generators through the checkpoint-transfer service
  (streamrl/transfer) instead of Ray's object store."""

  # The run sends weights through this service (else Ray's object store).
  enabled: bool = False
  # Payload chunk size in bytes (a multiple of 8).
  chunk_bytes: int = 4 << 20
  # "tree" (relays fan out) or "direct" (the publisher sends to every receiver).
  topology: str = "tree"
  # Children per node of the tree inside a datacenter.
  fanout: int = 2
  # Same-host receivers map the sender's shared-memory file instead of a TCP copy.
  use_shm: bool = True
  # Send XOR deltas over cross-datacenter links when the far side holds the base.
  delta_cross_dc: bool = False
  # zlib level of the delta encoder (-1 to 9; 1 is fast and compresses XOR deltas well).
  delta_level: int = 1
  # Threads per node that encode deltas.
  delta_threads: int = 2
  # Versions the publisher keeps (2: the latest and a delta base).
  keep_versions: int = 2
  # Extra attempts per version after a failed one (then the receiver nacks).
  max_retries: int = 3
  # Seconds to wait for a TCP connection to a peer.
  connect_timeout_s: float = 2.0
  # Seconds without progress after which a stream counts as dead.
  io_timeout_s: float = 30.0
  # Seconds a connection gets, however its bytes are paced: a server's from accept to the
  # peer's authenticated request; a client's control exchange (connect, handshake, reply).
  handshake_timeout_s: float = 10.0
  # Connections a node serves at once (one pooled thread each); more are closed at once.
  max_connections: int = 256
  # Connections a node serves at once from one peer address (same-host receivers share one).
  max_connections_per_peer: int = 64
  # Seconds between the publisher's re-announces to receivers that have not acked.
  repair_interval_s: float = 2.0
  # The address the publisher and receivers listen on. On loopback too, every
  # node authenticates its peers with the run's secret (the run makes one).
  bind: str = "127.0.0.1"
  # TLS on every connection between nodes (the publisher's per-run certificate, pinned by every
  # node): "auto" (on when the node's bind address is not loopback), "on" or "off". Give every
  # node of a run the same value: a TLS node refuses plain connections and the other way round.
  tls: str = "auto"
  # Emulated link rates in bytes/s (0: unlimited), for tests and demos of a
  # cross-datacenter edge on one machine.
  cross_dc_bytes_per_s: float = 0.0
  uplink_bytes_per_s: float = 0.0

  def check(self) -> None:
    need(
        self.chunk_bytes > 0 and self.chunk_bytes % 8 == 0,
        f"transfer.chunk_bytes={self.chunk_bytes} must be a positive multiple of 8; "
        "fix --config.transfer.chunk_bytes.",
    )
    one_of("transfer.topology", self.topology, ("tree", "direct"))
    positive("transfer.fanout", self.fanout)
    in_range("transfer.delta_level", self.delta_level, -1, 9)  # zlib's levels
    positive("transfer.delta_threads", self.delta_threads)
    positive("transfer.keep_versions", self.keep_versions)
    positive("transfer.max_retries", self.max_retries, zero_ok=True)
    positive("transfer.connect_timeout_s", self.connect_timeout_s)
    positive("transfer.io_timeout_s", self.io_timeout_s)
    positive("transfer.handshake_timeout_s", self.handshake_timeout_s)
    positive("transfer.max_connections", self.max_connections)
    positive("transfer.max_connections_per_peer", self.max_connections_per_peer)
    positive("transfer.repair_interval_s", self.repair_interval_s)
    need(
        bool(self.bind.strip()),
        "transfer.bind is empty; use 127.0.0.1 (this machine only) or the address the "
        "generators reach the trainer at.",
    )
    one_of("transfer.tls", self.tls, ("auto", "on", "off"))
    positive("transfer.cross_dc_bytes_per_s", self.cross_dc_bytes_per_s, zero_ok=True)
    positive("transfer.uplink_bytes_per_s", self.uplink_bytes_per_s, zero_ok=True)
