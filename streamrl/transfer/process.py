"""Process mode: a Receiver in a process of its own, started with ``spawn``.

The child gets everything it needs at start (the schema and config as plain
lists and dicts, the secret and the publisher's keys over the process's own
spawn pipe, never over the transfer network), joins the publisher and serves
until it is terminated or its parent dies.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Optional

import numpy as np

from streamrl.transfer.config import Transfer
from streamrl.transfer.manifest import SchemaLike, TensorSpec, as_schema
from streamrl.transfer.receiver import LoadFn, Receiver
from streamrl.transfer.security import RunKeys, check_run_keys, check_secret
from streamrl.transfer.topology import Address


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
