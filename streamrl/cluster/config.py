"""The cluster's settings (`cluster.*`): where Ray runs and how each side is placed."""

from __future__ import annotations

import dataclasses

from streamrl.cluster.addresses import LOOPBACK
from streamrl.config.checks import need, positive
from streamrl.errors import UserError


def parse_labels(text: str) -> dict[str, str]:
  """ "datacenter=dc1,accelerator=H20" -> {"datacenter": "dc1", "accelerator": "H20"}."""
  out: dict[str, str] = {}
  for part in (p.strip() for p in (text or "").split(",")):
    if not part:
      continue
    key, sep, value = part.partition("=")
    if not sep or not key.strip() or not value.strip():
      raise ValueError(
          f"{part!r} is not key=value; write labels as comma-separated key=value pairs, "
          "e.g. datacenter=dc1,accelerator=H20."
      )
    out[key.strip()] = value.strip()
  return out


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Ray (`cluster.*`): an empty address starts a local Ray where each side
  gets its own cores; the trainer runs as a Ray actor on the `training_pool`
  unless trainer_actor is False (handy under a debugger)."""

  address: str = ""
  generator_cpus: int = 1
  trainer_cpus: int = 1
  trainer_gpus: int = 0
  # Trainer processes (Ray actors, one JAX runtime; streamrl/trainer/multihost.py).
  trainer_processes: int = 1
  connect_timeout_s: float = 30.0
  trainer_actor: bool = True
  # Placement on a multi-node cluster (launch/cluster.py starts one on a
  # single machine). Each generator instance takes one unit of the Ray
  # resource `generation_pool`, each trainer process one of `training_pool`;
  # the *_labels (comma-separated key=value, e.g. "datacenter=dc1,
  # accelerator=H20") further restrict them to Ray nodes carrying those
  # labels (`ray start --labels=...`). A process's datacenter is its node's
  # `datacenter` label ("dc0" when it has none).
  generation_pool: str = "generation_pool"
  training_pool: str = "training_pool"
  generation_labels: str = ""
  training_labels: str = ""
  # The local Ray's node address (empty `address`), where Ray, the trainer's
  # JAX coordinator and the generators' vLLM listen: 127.0.0.1 keeps them on
  # this machine; another address of it opens them to its network (Ray then
  # listens on every interface). On a cluster each node has its own.
  node_ip_address: str = LOOPBACK

  def check(self) -> None:
    positive("cluster.generator_cpus", self.generator_cpus)
    positive("cluster.trainer_cpus", self.trainer_cpus)
    positive("cluster.trainer_gpus", self.trainer_gpus, zero_ok=True)
    positive("cluster.trainer_processes", self.trainer_processes)
    positive("cluster.connect_timeout_s", self.connect_timeout_s)
    need(
        not self.address or self.node_ip_address == LOOPBACK,
        f"cluster.node_ip_address={self.node_ip_address!r} is the address of a local Ray, "
        "but cluster.address joins a cluster whose nodes have the addresses `ray start "
        "--node-ip-address` gave them; drop cluster.node_ip_address.",
    )
    for key in ("generation_labels", "training_labels"):
      value = getattr(self, key)
      try:
        parse_labels(value)
      except ValueError as e:
        raise UserError(f"cluster.{key}={value!r}: {e}") from None
