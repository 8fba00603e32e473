"""A trainer process's JAX runtime, set up before JAX starts: its CPU devices
(`set_cpu_devices`) and, with `cluster.trainer_processes` > 1, the one runtime
its processes join (`coordinator_address`, `initialize`; the data and weights
across them are streamrl/trainer/multihost.py).

The launcher imports this module to start the trainer actors and never loads
JAX, so JAX is imported inside `initialize`, which runs in the actor.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket

log = logging.getLogger(__name__)

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def set_cpu_devices(count: int, env=os.environ) -> None:
  """Makes this process's CPU backend offer `count` devices (before JAX starts)."""
  flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\d+", "", env.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={int(count)}"])


def free_port(host: str = "") -> int:
  """A port free at `host` ("": on every interface) now."""
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def host_port(host: str, port: int) -> str:
  """`host:port`, an IPv6 host in brackets."""
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def coordinator_address(host: str) -> str:
  """Where process 0 serves JAX's coordination service: a free port at
  `host`, its node's address (127.0.0.1 on a local Ray)."""
  return host_port(host, free_port(host))


def initialize(
    coordinator: str,
    num_processes: int,
    process_id: int,
    *,
    timeout_s: int = 300,
    host: str | None = None,
) -> None:
  """Joins this process to the trainer's JAX runtime (before any JAX computation).

  On CPU the cross-process collectives run over gloo. A process that dies is
  noticed by the coordination service after `timeout_s` at the latest; the
  launcher notices sooner (through Ray) and stops the rest. The service
  (process 0) listens on the coordinator's address only, not on every
  interface; this process's gloo listens on `host` (its node's address) when
  given, else on the address its hostname resolves to.
  """
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator,
      num_processes=num_processes,
      process_id=process_id,
      initialization_timeout=timeout_s,
      heartbeat_timeout_seconds=timeout_s,
      coordinator_bind_address=coordinator,
  )
  if host:
    _gloo_listens_on(host)
  log.info(
      "Trainer process %d of %d: %d local devices, %d in the mesh.",
      jax.process_index(),
      jax.process_count(),
      jax.local_device_count(),
      jax.device_count(),
  )


def _gloo_listens_on(host: str) -> None:
  """The CPU backend, created at JAX's first computation, gets gloo
  collectives that listen on `host`. JAX makes them for the address the
  hostname resolves to (on many machines the network's) and has no setting
  for it, so the backend is registered again with collectives of our own."""
  from jax._src import distributed, xla_bridge  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  from jax.extend import backend  # pylint: disable=g-import-not-at-top

  collectives = _jax.make_gloo_tcp_collectives(
      distributed_client=distributed.global_state.client, hostname=host
  )
  backend.register_backend_factory(
      "cpu",
      functools.partial(xla_bridge.make_cpu_client, collectives=collectives),
      priority=0,
      fail_quietly=False,
  )
