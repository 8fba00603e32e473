"""Where generator instances run: the Ray resources each one asks for.

A local Ray with 4 fake GPUs stands in for a GPU node: Ray hands each actor
that asks for GPUs its own ids in CUDA_VISIBLE_DEVICES, no GPU needed.
"""

import json
import os
import types

import pytest
import ray

from streamrl import cluster, settings
from streamrl.generator import local, service


@ray.remote
class _VisibleGpus:
  """Stands in for GeneratorActor: reports the GPUs Ray gave it."""

  def gpu_ids(self) -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"]


@pytest.fixture
def fake_gpu_ray():
  if ray.is_initialized():
    ray.shutdown()
  ray.init(
      num_cpus=2,
      num_gpus=4,
      resources={cluster.GENERATION_POOL: 8, cluster.TRAINING_POOL: 1},
      include_dashboard=False,
  )
  yield
  ray.shutdown()


def test_cpu_engines_ask_for_no_gpu():
  opts = service.actor_options(settings.Engine(num_instances=2), generator_cpus=2, num_instances=2)
  assert opts["num_gpus"] == 0
  assert opts["num_cpus"] == 1.0
  assert opts["resources"] == {cluster.GENERATION_POOL: 1}


def test_gpu_engines_ask_for_their_gpus():
  engine = settings.Engine(num_instances=2, gpus_per_instance=2, tensor_parallel_size=2)
  opts = service.actor_options(engine, generator_cpus=2, num_instances=2)
  assert opts["num_gpus"] == 2
  assert opts["num_cpus"] == 1.0
  assert opts["resources"] == {cluster.GENERATION_POOL: 1}


def test_two_instances_get_disjoint_gpus(fake_gpu_ray):
  engine = settings.Engine(num_instances=2, gpus_per_instance=2, tensor_parallel_size=2)
  opts = service.actor_options(engine, generator_cpus=2, num_instances=2)
  actors = [_VisibleGpus.options(**opts).remote() for _ in range(2)]
  got = ray.get([a.gpu_ids.remote() for a in actors], timeout=120)
  ids = [set(g.split(",")) for g in got]
  assert [len(i) for i in ids] == [2, 2]
  assert not ids[0] & ids[1]
  assert ids[0] | ids[1] <= {"0", "1", "2", "3"}
  for a in actors:
    ray.kill(a)


def test_engine_kwargs_carry_the_gpu_settings():
  engine = settings.Engine(
      gpus_per_instance=2, tensor_parallel_size=2, gpu_memory_utilization=0.7, enforce_eager=True
  )
  kw = local.engine_kwargs(engine, dtype="bfloat16", seed=3)
  assert kw["tensor_parallel_size"] == 2
  assert kw["gpu_memory_utilization"] == 0.7
  assert kw["enforce_eager"] is True


def test_placement_json_keeps_the_gpu_ids(tmp_path):
  from streamrl import train  # pylint: disable=g-import-not-at-top

  rollout = types.SimpleNamespace(
      placement={
          0: {"pid": 1, "cores": (0,), "torch_threads": 1, "gpu_ids": "0,1", "startup_s": 2.0}
      }
  )
  train.write_placement(str(tmp_path), {"trainer": {"pid": 0}}, rollout)
  with open(tmp_path / "placement.json") as f:
    got = json.load(f)
  assert got["generators"]["0"] == {"pid": 1, "cores": [0], "torch_threads": 1, "gpu_ids": "0,1"}
