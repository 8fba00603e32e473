"""The checkpoint-transfer service's settings as a run reads them (`transfer.*`)."""

from __future__ import annotations

import dataclasses

from streamrl.config_checks import need, one_of, positive


@dataclasses.dataclass(frozen=True)
class Transfer:
  """Weights to Ray generators through the checkpoint-transfer service
  (streamrl/transfer) instead of Ray's object store."""

  enabled: bool = False
  chunk_bytes: int = 4 << 20
  topology: str = "tree"
  fanout: int = 2
  use_shm: bool = True
  delta_cross_dc: bool = False
  # The address the publisher and receivers listen on. Beyond loopback every
  # receiver checks a per-run shared secret before it loads anything.
  bind: str = "127.0.0.1"
  # Emulated link rates in bytes/s (0: unlimited), for tests and demos of a
  # cross-datacenter edge on one machine.
  cross_dc_bytes_per_s: float = 0.0
  uplink_bytes_per_s: float = 0.0

  def service_options(self) -> dict:
    """The streamrl.transfer.TransferConfig fields."""
    return {k: v for k, v in dataclasses.asdict(self).items() if k not in ("enabled", "bind")}

  def check(self) -> None:
    need(
        self.chunk_bytes > 0 and self.chunk_bytes % 8 == 0,
        f"transfer.chunk_bytes={self.chunk_bytes} must be a positive multiple of 8.",
    )
    one_of("transfer.topology", self.topology, ("tree", "direct"))
    positive("transfer.fanout", self.fanout)
    need(
        bool(self.bind.strip()),
        "transfer.bind is empty; use 127.0.0.1 (this machine only) or the address the "
        "generators reach the trainer at.",
    )
    positive("transfer.cross_dc_bytes_per_s", self.cross_dc_bytes_per_s, zero_ok=True)
    positive("transfer.uplink_bytes_per_s", self.uplink_bytes_per_s, zero_ok=True)
