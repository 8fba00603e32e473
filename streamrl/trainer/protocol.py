"""The multi-process trainer's operations, as typed messages (one place to add one).

Process 0 runs the RL loop (streamrl/train.py) and its trainer is a
`Leader`; before each trainer operation it sends one of the
messages below to every other process (`Followers.send`), whose `follow`
loop replays it on its own shards with `op.run(follower)`. Adding an
operation is one dataclass here, with its `run`, and the call that sends it.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, Callable, Sequence

import numpy as np

from streamrl.models import hf
from streamrl.trainer import multihost


@dataclasses.dataclass
class Follower:
  """What trainer process k > 0 holds between operations."""

  make_trainer: Callable[[Any], Any]  # policy -> RLTrainer
  checkpoints: Any  # the run's Checkpointer (every process takes part in Orbax)
  reply: Any  # this follower's reply queue to process 0
  trainer: Any = None
  exporter: Any = None
  old: Any = None
  leader_host: str | None = None
  minis: dict = dataclasses.field(default_factory=dict)
  stopped: bool = False


@dataclasses.dataclass(frozen=True)
class Setup:
  """Load the policy process 0 loaded and build the same trainer."""

  model_dir: str
  leader_host: str

  def run(self, f: Follower) -> None:
    _, policy = hf.load_hf(self.model_dir)
    f.trainer = f.make_trainer(policy)
    f.exporter = multihost.ShardExporter(f.trainer.mesh, f.trainer.export_dtype)
    f.leader_host = self.leader_host


@dataclasses.dataclass(frozen=True)
class Restore:
  """Restore the latest checkpoint (process 0 restores the same one)."""

  def run(self, f: Follower) -> None:
    _, arrays, _ = f.checkpoints.restore(f.trainer.checkpoint_arrays())
    f.trainer.load_checkpoint_arrays(arrays)


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """`RLTrainer.snapshot`: the old policy of this iteration."""

  copy: bool = True

  def run(self, f: Follower) -> None:
    f.old = f.trainer.snapshot(self.copy)
    f.minis.clear()


@dataclasses.dataclass(frozen=True)
class Prepare:
  """`RLTrainer.prepare` on a chunk of samples and their rewards; its
  mini-batches are kept under `key`."""

  key: int
  samples: list
  rewards: list

  def run(self, f: Follower) -> None:
    f.minis[self.key], _ = f.trainer.prepare(self.samples, self.rewards, f.old)


@dataclasses.dataclass(frozen=True)
class Update:
  """`RLTrainer.update` on mini-batch `index` of prepare call `key`."""

  key: int
  index: int

  def run(self, f: Follower) -> None:
    f.trainer.update(f.minis[self.key][self.index])


@dataclasses.dataclass(frozen=True)
class Export:
  """Write this process's shards of the policy into weights file `name`."""

  name: str
  manifest: Any

  def run(self, f: Follower) -> None:
    multihost.follower_export(
        f.exporter, f.trainer.policy(), self.name, self.manifest, f.leader_host, f.reply
    )


@dataclasses.dataclass(frozen=True)
class Save:
  """Take part in the checkpoint of `step` (Orbax saves collectively)."""

  step: int
  meta: dict

  def run(self, f: Follower) -> None:
    f.checkpoints.save(self.step, f.trainer.checkpoint_arrays(), self.meta)


@dataclasses.dataclass(frozen=True)
class Stop:
  """The run is over."""

  def run(self, f: Follower) -> None:
    f.stopped = True


OPERATIONS = (Setup, Restore, Snapshot, Prepare, Update, Export, Save, Stop)


def follow(follower: Follower, commands) -> None:
  """Runs each operation from `commands` (a queue) until `Stop`."""
  while not follower.stopped:
    op = commands.get()
    if not isinstance(op, OPERATIONS):
      raise TypeError(f"unknown trainer operation {op!r}; send one of streamrl.trainer.protocol's.")
    op.run(follower)


# ------------------------------------------------------------ the leader
@dataclasses.dataclass
class Followers:
  """Process 0's line to the other trainer processes: one command queue and
  one reply queue each (Ray queues), in process order."""

  commands: Sequence
  replies: Sequence
  hosts: Sequence[str]

  def send(self, op) -> None:
    """Sends one `streamrl.trainer.protocol` operation to every follower."""
    for q in self.commands:
      q.put(op)

  def remote_hosts(self) -> list[int]:
    """Indices of the followers on another host than this process."""
    me = socket.gethostname()
    return [i for i, h in enumerate(self.hosts) if h != me]


class Leader:
  """Process 0's trainer: each operation is sent to the followers, then run here.

  Same interface as `RLTrainer` for the loop (`snapshot`, `prepare`,
  `update`, `export_weights`); the followers keep the mini-batches their own
  `prepare` made, and `update` names one by (prepare call, index).
  """

  def __init__(self, trainer, followers: Followers):
    self.trainer = trainer
    self.followers = followers
    self.exporter = multihost.ShardExporter(trainer.mesh, trainer.export_dtype)
    self._where: dict[int, tuple[int, int]] = {}
    self._keep: list = []

  def __getattr__(self, name):
    return getattr(self.trainer, name)

  def snapshot(self, copy: bool = True):
    self.followers.send(Snapshot(copy))
    self._where.clear()
    self._keep.clear()
    return self.trainer.snapshot(copy)

  def prepare(self, samples, rewards, old):
    key = len(self._keep)
    self.followers.send(Prepare(key, list(samples), [float(r) for r in rewards]))
    minis, metrics = self.trainer.prepare(samples, rewards, old)
    self._keep.append(minis)
    for j, mini in enumerate(minis):
      self._where[id(mini)] = (key, j)
    return minis, metrics

  def update(self, mini: dict) -> dict:
    key, j = self._where[id(mini)]
    self.followers.send(Update(key, j))
    return self.trainer.update(mini)

  def export_weights(self, dtype=None):
    """The policy in the generators' dtype as a filled `WeightsFile`, written
    by every process (see the module docstring)."""
    from streamrl.transfer.manifest import plan_payload  # pylint: disable=g-import-not-at-top
    from streamrl.transfer.shm import WeightsFile  # pylint: disable=g-import-not-at-top

    assert dtype is None or dtype == self.trainer.export_dtype, "one export dtype per run"
    policy = self.trainer.policy()
    manifest = plan_payload(hf.HFTensors(policy, self.trainer.export_dtype), 0, 4 << 20)
    weights = WeightsFile.empty(manifest)
    try:
      self.followers.send(Export(weights.name, manifest))
      self.exporter.write(policy, manifest, weights.buf)
      multihost.multihost_utils.sync_global_devices("streamrl_export")
      dst = np.frombuffer(weights.buf, np.uint8)
      for i in self.followers.remote_hosts():
        import ray  # pylint: disable=g-import-not-at-top

        for pos, data in ray.get(self.followers.replies[i].get()):
          dst[pos : pos + data.size] = data
    except BaseException:
      weights.unlink()
      raise
    return weights
