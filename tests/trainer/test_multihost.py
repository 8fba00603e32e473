"""The pieces of the multi-process trainer that run in one process (8 faked devices).

The 2-process run itself (real Ray actors, gloo, vLLM) is tests/test_multihost.py.
"""

import numpy as np
import pytest
from flax import nnx

from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.models import config as model_config
from streamrl.models import hf, transformer
from streamrl.trainer import multihost, runtime, sharding
from streamrl.transfer.manifest import plan_payload
from streamrl.transfer.shm import WeightsFile

pytestmark = [pytest.mark.unit]


def sharded_policy(family="qwen2", mesh_axes=None):
  cfg = {"qwen2": model_config.tiny_qwen2, "llama": model_config.tiny_llama}[family](64)
  policy = transformer.Transformer(cfg, rngs=nnx.Rngs(3))
  mesh = sharding.make_mesh(mesh_axes or {"fsdp": 4, "tensor": 2})
  return sharding.shard_module(policy, mesh), mesh


@pytest.mark.parametrize(
    "family,dtype,axes",
    [
        ("qwen2", "float32", {"fsdp": 4, "tensor": 2}),
        ("qwen2", "bfloat16", {"data": 2, "fsdp": 2, "tensor": 2}),
        ("llama", "bfloat16", {"fsdp": 8}),
    ],
)
def test_shard_export_writes_exactly_the_file_the_whole_model_export_writes(family, dtype, axes):
  policy, mesh = sharded_policy(family, axes)
  lazy = hf.HFTensors(policy, dtype)
  manifest = plan_payload(lazy, 0, 4 << 20)
  want = WeightsFile(lazy)
  got = WeightsFile.empty(manifest)
  try:
    multihost.ShardExporter(mesh, dtype).write(policy, manifest, got.buf)
    assert bytes(got.buf) == bytes(want.buf)
    # The file is a safetensors file the engines can read: same tensors back.
    for name, value in got.tensors().items():
      np.testing.assert_array_equal(value, lazy[name])
  finally:
    got.unlink()
    want.unlink()


def test_a_process_on_another_host_returns_its_blocks_and_they_fill_the_file():
  policy, mesh = sharded_policy()
  lazy = hf.HFTensors(policy, "bfloat16")
  manifest = plan_payload(lazy, 0, 4 << 20)
  parts = multihost.ShardExporter(mesh, "bfloat16").write(policy, manifest, None)
  # Blocks are disjoint: every tensor byte is covered once, by one device's block.
  got = WeightsFile.empty(manifest)
  want = WeightsFile(lazy)
  try:
    covered = np.zeros(manifest.total_bytes, np.int32)
    dst = np.frombuffer(got.buf, np.uint8)
    for pos, data in parts:
      dst[pos : pos + data.size] = data
      covered[pos : pos + data.size] += 1
    header = manifest.total_bytes - sum(s.nbytes for s in manifest.tensors)
    assert (covered[header:] == 1).all() and not covered[:header].any()
    assert bytes(got.buf) == bytes(want.buf)
  finally:
    got.unlink()
    want.unlink()


def test_global_and_host_arrays_round_trip_on_the_mesh():
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  x = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
  arr = multihost.global_array(x, sharding.batch_sharding(mesh, 2, shape=x.shape))
  assert len(arr.addressable_shards) == 8
  np.testing.assert_array_equal(multihost.host_array(arr), x)


def test_set_cpu_devices_replaces_the_device_count_and_keeps_other_flags():
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_cpu_foo=1"}
  runtime.set_cpu_devices(4, env)
  assert env["XLA_FLAGS"].split() == ["--xla_cpu_foo=1", "--xla_force_host_platform_device_count=4"]
  env = {}
  runtime.set_cpu_devices(2, env)
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def configured(**cluster_and_mesh):
  cfg = settings.default_config()
  cfg.pipeline.mode = "sync"
  for key, value in cluster_and_mesh.items():
    group, name = key.split("__")
    cfg[group][name] = value
  return settings.from_config(cfg)


def test_each_cpu_process_offers_its_share_of_a_fixed_mesh():
  s = configured(cluster__trainer_processes=2, mesh__fsdp=4, mesh__tensor=2)
  assert s.trainer_cpu_devices_per_process == 4
  assert configured(cluster__trainer_processes=1).trainer_cpu_devices_per_process is None


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(cluster__trainer_processes=0), "trainer_processes"),
        (dict(cluster__trainer_processes=2, mesh__fsdp=3), "split evenly"),
        (
            dict(cluster__trainer_processes=2, cluster__trainer_gpus=3, mesh__fsdp=-1),
            "split evenly",
        ),
        (dict(cluster__trainer_processes=2, cluster__trainer_actor=False), "Ray actors"),
        (dict(cluster__trainer_processes=2, pipeline__mode="colocated"), "Ray actors"),
    ],
)
def test_bad_process_settings_are_refused_with_one_sentence(overrides, match):
  with pytest.raises(UserError, match=match):
    configured(**overrides)


def test_of_processes_that_died_together_the_one_a_peer_did_not_end_is_named(tmp_path):
  from streamrl import experiment  # pylint: disable=g-import-not-at-top

  logs = [str(tmp_path / f"trainer.{k}.log") for k in range(3)]
  ended = "F1201 client.h:80] Terminating process because the JAX distributed service detected fatal errors."
  (tmp_path / "trainer.0.log").write_text("step 3\n" + ended)
  (tmp_path / "trainer.1.log").write_text("step 3\n")
  (tmp_path / "trainer.2.log").write_text(ended)
  assert experiment._first_to_die([0, 1, 2], logs) == 1  # pylint: disable=protected-access
  assert experiment._first_to_die([0, 2], logs) == 0  # can't tell: the first  # pylint: disable=protected-access


def test_ray_death_notices_are_shortened_to_their_exit_type_and_detail():
  from streamrl import experiment  # pylint: disable=g-import-not-at-top

  msg = (
      "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
      "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of "
      "file. Some common causes include: (1) the process was killed by the OOM killer"
  )
  reason = experiment._death_reason(RuntimeError(msg))  # pylint: disable=protected-access
  assert reason == "SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2."


def test_followers_replay_typed_operations_in_order_until_stop():
  import queue

  from streamrl.trainer import protocol

  calls = []

  class Trainer:

    def snapshot(self, copy):
      calls.append(("snapshot", copy))
      return "old"

    def prepare(self, samples, rewards, old):
      calls.append(("prepare", tuple(samples), tuple(rewards), old))
      return ["m0", "m1"], {}

    def update(self, mini):
      calls.append(("update", mini))

  commands = queue.Queue()
  f = protocol.Follower(make_trainer=None, checkpoints=None, reply=None, trainer=Trainer())
  for op in (
      protocol.Snapshot(False),
      protocol.Prepare(0, [7], [1.0]),
      protocol.Update(0, 1),
      protocol.Stop(),
      protocol.Update(0, 0),  # never read: the follower stopped
  ):
    commands.put(op)
  protocol.follow(f, commands)
  assert calls == [("snapshot", False), ("prepare", (7,), (1.0,), "old"), ("update", "m1")]
  assert commands.qsize() == 1
  old_style = queue.Queue()
  old_style.put(("update", 0, 0))  # the old string commands are refused by name
  with pytest.raises(TypeError, match="unknown trainer operation"):
    protocol.follow(protocol.Follower(None, None, None), old_style)
