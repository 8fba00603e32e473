"""Weight delivery: how a new policy version reaches the generator instances.

`Instances` (instances.py) keeps the generator instances' lifecycle; a
`Delivery` backend moves the weights. Backends are registered by name
(`register`), and `Instances` picks one by the run's settings
(`backend_for`):

  ray       Ray: when every Ray node is this machine, one safetensors file
            in /dev/shm that every instance's engine loads; otherwise the
            tensors through Ray's object store, each instance writing its own.
  transfer  the checkpoint-transfer service (streamrl/transfer): a publisher
            beside the trainer, a verifying receiver in every instance that
            stages each version while the engine generates; an instance
            added mid-run catches up to the current version through it.

A third backend (device-to-device on GPUs, say) subclasses `Delivery` and
registers itself under a new name; nothing else needs a change.

Every backend's `push` returns at once with an `UpdateHandle`;
`Instances.finish_update` turns the instances' load calls into {instance: version} (marking
the ones that died meanwhile). No torch or vLLM here.
"""

from __future__ import annotations

import abc
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from streamrl import cluster as cluster_lib
from streamrl.generator.rollout import UpdateHandle
from streamrl.transfer.config import Transfer

# {instance id: its load call} -> {instance id: version}, after waiting at
# most the timeout (the service's bookkeeping of versions and dead instances).
Finish = Callable[[Mapping[int, Any], float | None], dict]

BACKENDS: dict[str, type["Delivery"]] = {}


def register(name: str):
  """Class decorator: makes a `Delivery` backend available as `name`."""

  def add(cls):
    if name in BACKENDS:
      raise ValueError(f"a weight delivery backend {name!r} is registered already.")
    cls.name = name
    BACKENDS[name] = cls
    return cls

  return add


def backend_for(transfer: Transfer | None) -> str:
  """The backend a run's `transfer.*` settings ask for."""
  return "transfer" if transfer is not None and transfer.enabled else "ray"


class Delivery(abc.ABC):
  """Moves weight versions to the live instances of one service.

  Args:
    actor: instance id -> its Ray actor handle.
    live: the ids of the instances that receive updates now.
    finish: see `Finish`.
  """

  name = "?"

  def __init__(self, actor: Callable[[int], Any], live: Callable[[], list[int]], finish: Finish):
    self._actor, self._live, self._finish = actor, live, finish

  @abc.abstractmethod
  def push(self, tensors, version: int) -> UpdateHandle:
    """Sends `version` to every live instance and returns at once."""

  def catch_up(self, instance_id: int, timeout_s: float) -> int | None:
    """Brings an instance added mid-run to the current version; returns it
    (None: the instance starts from the model directory)."""
    return None

  @property
  def can_catch_up(self) -> bool:
    """Whether an instance added after an update can get the current weights."""
    return False

  def forget(self, instance_id: int) -> None:
    """The instance is gone (removed or dead)."""

  def cleanup(self, *, everything: bool = False) -> None:
    """Frees what loaded updates no longer need (`everything`: all of it)."""

  def close(self) -> None:
    self.cleanup(everything=True)


def _on_one_host() -> bool:
  """Whether every live Ray node is this machine (so every instance sees this /dev/shm)."""
  me = socket.gethostname()
  return all(n.get("NodeManagerHostname") == me for n in ray.nodes() if n.get("Alive"))


@register("ray")
class RayDelivery(Delivery):
  """Weights through Ray: a shared /dev/shm file on one host, else the object store."""

  def __init__(self, actor, live, finish, **unused):
    super().__init__(actor, live, finish)
    # (WeightsFile, its load calls) of each update, unlinked once every load returned.
    self._files: list = []

  def push(self, tensors, version: int, *, shared_file: bool | None = None) -> UpdateHandle:
    """`tensors` may be lazy (`hf.HFTensors`: each tensor read once, in the
    generators' dtype, straight into the file) or a filled `WeightsFile`.
    shared_file: every instance loads this process's file (None: when every
    Ray node is this machine)."""
    from streamrl.transfer import WeightsFile  # pylint: disable=g-import-not-at-top

    self.cleanup()
    if shared_file is None:
      shared_file = _on_one_host()
    weights = tensors if isinstance(tensors, WeightsFile) else WeightsFile(tensors)
    live = self._live()
    if shared_file:
      calls = {
          i: self._actor(i).update_weights_from_file.remote(weights.path, version) for i in live
      }
      self._files.append((weights, list(calls.values())))
    else:
      ref = ray.put(weights.tensors())
      weights.unlink()
      calls = {i: self._actor(i).update_weights.remote(ref, version) for i in live}
    # Ray runs the load before any later stream on each actor: nothing to deliver.
    return UpdateHandle(version, delivered=lambda t: None, loaded=lambda t: self._loaded(calls, t))

  def _loaded(self, calls, timeout_s: float | None) -> dict:
    try:
      return self._finish(calls, timeout_s)
    finally:
      self.cleanup()  # This update's file, now that every instance has loaded it.

  def cleanup(self, *, everything: bool = False) -> None:
    keep = []
    for weights, calls in self._files:
      if everything or len(ray.wait(calls, num_returns=len(calls), timeout=0)[0]) == len(calls):
        weights.unlink()
      else:
        keep.append((weights, calls))
    self._files = keep


@register("transfer")
class TransferDelivery(Delivery):
  """Weights through the checkpoint-transfer service (see the module docstring).

  Args:
    transfer: the run's `transfer.*` settings.
    start_version: the instances' version now.
    stall_timeout_s: the longest wait for every instance's ack.
  """

  def __init__(
      self, actor, live, finish, *, transfer: Transfer, start_version: int, stall_timeout_s: float
  ):
    super().__init__(actor, live, finish)
    from streamrl.transfer import Publisher, new_secret  # pylint: disable=g-import-not-at-top

    self._transfer = transfer
    self._bind = transfer.bind
    self._secret = new_secret()  # Per run: every receiver checks it before loading anything.
    self._stall_timeout_s = float(stall_timeout_s)
    self._schema = None
    self.joined = False
    self.publisher = Publisher(
        transfer,
        dc=cluster_lib.where_am_i()["datacenter"],
        start_version=start_version,
        bind=transfer.bind,
        secret=self._secret,
    )

  def _join(self, ids: Sequence[int]) -> list[int]:
    """Each instance in `ids` starts its receiver, registers with the
    publisher and pulls (verified) the latest version; returns their versions."""
    return ray.get(
        [
            self._actor(i).join_transfer.remote(
                self.publisher.address,
                self._schema,
                self._transfer,
                bind=self._bind,
                secret=self._secret,
                # The publisher's public key and TLS certificate, through Ray like the secret.
                run_keys=self.publisher.run_keys,
            )
            for i in ids
        ]
    )

  def push(self, tensors, version: int) -> UpdateHandle:
    """The publisher's file is verified and staged by each instance's
    receiver while it generates; every host receives it once. A filled
    `WeightsFile` (a multi-process trainer's export) is published as it is."""
    from streamrl.transfer import WeightsFile, schema_of  # pylint: disable=g-import-not-at-top

    if not self.joined:
      self._schema = schema_of(tensors.tensors() if isinstance(tensors, WeightsFile) else tensors)
      self._join(self._live())
      self.joined = True
    self.publisher.publish(tensors, version)
    return UpdateHandle(
        version, delivered=lambda t: self._await_acks(version, t), loaded=self._apply_staged
    )

  def _await_acks(self, version: int, timeout_s: float | None) -> None:
    """Every live instance has verified and staged `version`."""
    pub = self.publisher
    if not pub.wait_acks(version, timeout=timeout_s or self._stall_timeout_s):
      raise TimeoutError(
          f"Weight version {version} not delivered to "
          f"{pub.missing_acks(version)}; errors: {pub.errors}."
      )

  def _apply_staged(self, timeout_s: float | None) -> dict[int, int]:
    return self._finish({i: self._actor(i).apply_staged.remote() for i in self._live()}, timeout_s)

  @property
  def can_catch_up(self) -> bool:
    return True

  def catch_up(self, instance_id: int, timeout_s: float) -> int | None:
    if not self.joined:
      return None  # No update yet: the model directory is the current version.
    self._join([instance_id])
    version = ray.get(self._actor(instance_id).apply_staged.remote(), timeout=timeout_s)
    want = self.publisher.latest_version
    if version != want:
      raise RuntimeError(f"it loaded weight version {version}, the trainer's is {want}")
    return version

  def forget(self, instance_id: int) -> None:
    self.publisher.forget(f"generator{instance_id}")

  def close(self) -> None:
    self.publisher.close()
