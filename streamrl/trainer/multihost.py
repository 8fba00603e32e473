"""One trainer over several processes: `jax.distributed`, led by process 0.

With `cluster.trainer_processes=N` the trainer is N Ray actors on the
training pool (one per host, or per GPU group), and one device mesh spans
all their devices (joined by streamrl/trainer/runtime.py; the same
logical -> physical rules as one process). JAX is multi-controller: every
process must run the same jitted computations in the same order. So the RL
loop (`streamrl/train.py`) runs on process 0 only -- it owns the rollout, the
rewards, the metrics and the logs -- and its trainer is a `protocol.Leader`:
before each trainer operation it sends the operation and its inputs to every
other process (a Ray queue each: the typed operations of
streamrl/trainer/protocol.py), whose `protocol.follow` replays it on its own
`RLTrainer`.

Data: samples arrive at process 0, where the rollout streams them and the
rewards are computed, and each chunk is forwarded with its rewards to the
followers. A chunk is token ids and a few floats per token (kilobytes to
megabytes, against gigabytes of weights), and one receiver keeps the
generators' streaming protocol and its exactly-once accounting unchanged.
Every process then derives the same mini-batches (scoring is a collective,
`host_array` gathers its result; advantages are host numpy, deterministic)
and puts only the rows its devices hold (`global_array`).

Weights: no process gathers the model. `ShardExporter` reshards each tensor,
converted to the generators' layout and dtype on device, into a flat array
split over every device of the mesh; each process writes the byte ranges
its devices hold straight into the weights file of this update (one
safetensors file in /dev/shm, laid out by process 0). A process on another
host than process 0 sends its ranges through Ray's object store instead,
and process 0 writes them in.

Failure: the launcher (`streamrl.experiment`) watches every process; if one
dies, it stops the others (they may be waiting in a collective) and says
which one died and where its log is.
"""

from __future__ import annotations

import socket

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from streamrl.models import hf, safetensors_io


# -------------------------------------------------------------------- data
def global_array(x: np.ndarray, sharding_: jax.sharding.Sharding) -> jax.Array:
  """`x` (the same global value on every process) as a jax Array with `sharding_`;
  each process transfers only the blocks its own devices hold."""
  return jax.make_array_from_callback(x.shape, sharding_, lambda index: x[index])


def host_array(x: jax.Array) -> np.ndarray:
  """The whole value of `x` on this host (a gather across processes if needed)."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ----------------------------------------------------------------- weights
class ShardExporter:
  """Writes each process's share of the policy, in HF layout and the
  generators' dtype, into a weights file laid out by `manifest`.

  For each tensor, one jitted function (compiled once) casts and lays it out
  as HF expects and reshards it flat over every device of the mesh; each
  process then copies the blocks its devices hold to their offsets. The
  whole tensor exists only sharded, never on one host.
  """

  def __init__(self, mesh: jax.sharding.Mesh, dtype):
    self.mesh = mesh
    self.dtype = np.dtype(safetensors_io.numpy_dtype(dtype))
    self._fns: dict = {}
    self._flat = NamedSharding(mesh, P(tuple(mesh.axis_names)))

  def _fn(self, entry, shape):
    key = (entry.hf_name, tuple(shape))
    if key not in self._fns:
      n = int(np.prod(jax.eval_shape(entry.to_hf, jax.ShapeDtypeStruct(shape, np.float32)).shape))
      padded = -(-n // self.mesh.size) * self.mesh.size

      def flat(w):
        v = entry.to_hf(w.astype(self.dtype)).reshape(-1)
        return jax.numpy.pad(v, (0, padded - n))

      self._fns[key] = (jax.jit(flat, out_shardings=self._flat), n)
    return self._fns[key]

  def write(self, policy, manifest, out: memoryview | None) -> list[tuple[int, np.ndarray]]:
    """Writes this process's blocks of every tensor into `out` (the file's
    bytes); with `out` None returns them as (file offset, bytes) instead."""
    from streamrl.transfer.manifest import tensor_offsets  # pylint: disable=g-import-not-at-top

    params = nnx.to_pure_dict(nnx.state(policy, nnx.Param))
    entries = hf.layout_entries(policy.cfg)
    offsets = tensor_offsets(manifest)
    dst = None if out is None else np.frombuffer(out, np.uint8)
    parts = []
    item = self.dtype.itemsize
    for spec in manifest.tensors:
      entry = entries[spec.name]
      value = hf.get_param(params, entry.path)
      fn, n = self._fn(entry, value.shape)
      flat = fn(value)
      for shard in flat.addressable_shards:
        if shard.replica_id:
          continue
        start = shard.index[0].start or 0
        stop = min(shard.index[0].stop or n, n)
        if start >= stop:
          continue
        data = np.asarray(shard.data)[: stop - start].view(np.uint8)
        pos = offsets[spec.name] + start * item
        if dst is None:
          parts.append((pos, data))
        else:
          dst[pos : pos + data.size] = data
    return parts


def follower_export(exporter: ShardExporter, policy, name: str, manifest, leader_host: str, reply):
  """A follower's side of `Leader.export_weights`."""
  from streamrl.transfer.shm import open_weights_file  # pylint: disable=g-import-not-at-top

  if socket.gethostname() == leader_host:
    exporter.write(policy, manifest, open_weights_file(name, manifest.total_bytes))
    multihost_utils.sync_global_devices("streamrl_export")
    return
  import ray  # pylint: disable=g-import-not-at-top

  parts = exporter.write(policy, manifest, None)
  multihost_utils.sync_global_devices("streamrl_export")
  reply.put(ray.put(parts))
