"""Addresses: where a run's servers listen, and whether a cluster's address answers.

A local Ray's node address is `cluster.node_ip_address`, 127.0.0.1
by default, and everything a run starts listens there: Ray's GCS, raylet,
workers, agents and autoscaler metrics, the trainer's JAX coordinator and
gloo collectives, and the generators' vLLM sockets, which each take their
Ray node's address (`node_address`). Ray 2.60 replaces a loopback node or
head address with the machine's network address
(`ray._private.services.resolve_ip_for_localhost`) and then listens on every
interface; `loopback_kept` stops that. Joining a cluster (`cluster.address`),
each node keeps the address its `ray start` gave it (`--node-ip-address`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import sys

from streamrl.errors import UnreachableClusterError, UserError

_DEFAULT_GCS_PORT = 6379
# A local Ray's node address unless cluster.node_ip_address says otherwise.
LOOPBACK = "127.0.0.1"
# The node addresses on which Ray's servers listen on loopback only (with
# any other, 127.0.0.2 included, they listen on every interface).
_RAY_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _strip_scheme(address: str) -> str:
  for prefix in ("ray://", "http://", "https://"):
    if address.startswith(prefix):
      return address[len(prefix) :]
  return address


def _parse_address(address: str) -> tuple[str, int]:
  addr = _strip_scheme(address)
  host, sep, port = addr.rpartition(":")
  if not sep:
    host, port = addr, str(10001 if address.startswith("ray://") else _DEFAULT_GCS_PORT)
  if not host or not port.isdigit():
    raise UserError(
        f"cluster.address={address!r} is not of the form host:port "
        "(e.g. 10.0.0.1:6379); fix --config.cluster.address."
    )
  return host, int(port)


def check_reachable(address: str, timeout_s: float) -> tuple[str, int]:
  """One TCP connect to the head's port, so a wrong address fails in seconds
  with a clear message instead of inside Ray's retry loop."""
  host, port = _parse_address(address)
  try:
    with socket.create_connection((host, port), timeout=timeout_s):
      pass
  except OSError as e:
    raise UnreachableClusterError(
        f"Cannot reach the Ray cluster at {address!r} ({e.__class__.__name__}: {e}); start "
        "it with `ray start --head` there or fix --config.cluster.address (empty starts a "
        "local Ray)."
    ) from None
  return host, port


def is_loopback(host: str) -> bool:
  """Whether only this machine can reach `host`: 127.x.x.x, ::1 (also as
  ::ffff:127.x.x.x or in brackets) or localhost. A host name, "" or 0.0.0.0
  may resolve to an outside interface: not loopback."""
  if host.lower() == "localhost":
    return True
  try:
    ip = ipaddress.ip_address(host.strip("[]"))
  except ValueError:
    return False
  return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


@contextlib.contextmanager
def loopback_kept():
  """While active, Ray keeps a loopback node or head address as it is given.

  Ray 2.60 replaces 127.0.0.1, ::1 and localhost, given as a node's address
  (`ray.init(_node_ip_address=...)`, `ray start --node-ip-address`) or as the
  head's (`address`, `ray start --address`), with the machine's network
  address, and a node with that address listens on every interface. With
  the loopback address kept, the node's servers listen on loopback only.
  """
  from ray._private import services  # pylint: disable=g-import-not-at-top

  resolve = services.resolve_ip_for_localhost
  services.resolve_ip_for_localhost = lambda host: host if is_loopback(host) else resolve(host)
  try:
    yield
  finally:
    services.resolve_ip_for_localhost = resolve


def node_address() -> str:
  """This process's Ray node address (its servers listen there), 127.0.0.1 outside Ray."""
  if "ray" in sys.modules:
    import ray  # pylint: disable=g-import-not-at-top

    if ray.is_initialized():
      return ray.util.get_node_ip_address()
  return LOOPBACK


def interface_of(address: str) -> str | None:
  """The network interface that carries `address` ("lo" for 127.0.0.1 on
  Linux), or None when none of this machine's does."""
  import psutil  # pylint: disable=g-import-not-at-top

  for name, addrs in psutil.net_if_addrs().items():
    if any(a.address.split("%")[0] == address for a in addrs):
      return name
  return None


def check_node_ip_address(address: str, key: str = "cluster.node_ip_address") -> None:
  """UserError naming `key` unless `address` can be a Ray node's address here."""
  if address in _RAY_LOOPBACK or interface_of(address) is not None:
    return
  import psutil  # pylint: disable=g-import-not-at-top

  ips = [
      ipaddress.ip_address(a.address.split("%")[0])
      for addrs in psutil.net_if_addrs().values()
      for a in addrs
      if a.family in (socket.AF_INET, socket.AF_INET6)
  ]
  mine = sorted(str(ip) for ip in ips if not (ip.is_loopback or ip.is_link_local))
  raise UserError(
      f"{key}={address!r} is neither 127.0.0.1 nor an address of this "
      f"machine's interfaces; use 127.0.0.1 (this machine only) or one of {mine}."
  )
