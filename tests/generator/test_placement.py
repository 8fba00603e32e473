"""Where generator instances run: the Ray resources each one asks for.

A local Ray with 4 fake GPUs stands in for a GPU node: Ray hands each actor
that asks for GPUs its own ids in CUDA_VISIBLE_DEVICES, no GPU needed.
"""

import dataclasses
import json
import os
import types

import pytest
import ray

from streamrl import cluster, experiment
from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.generator import actor, local

pytestmark = [pytest.mark.ray]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


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
      address="local",  # never a cluster `ray start` left behind
      num_cpus=32,  # logical: what the GPU configs' actors ask for
      num_gpus=8,
      resources={cluster.GENERATION_POOL: 8, cluster.TRAINING_POOL: 1},
      include_dashboard=False,
  )
  yield
  ray.shutdown()


def test_cpu_engines_ask_for_no_gpu():
  opts = actor.actor_options(settings.Engine(num_instances=2), generator_cpus=2, num_instances=2)
  assert opts["num_gpus"] == 0
  assert opts["num_cpus"] == 1.0
  assert opts["resources"] == {cluster.GENERATION_POOL: 1}


def test_gpu_engines_ask_for_their_gpus():
  engine = settings.Engine(num_instances=2, gpus_per_instance=2, tensor_parallel_size=2)
  opts = actor.actor_options(engine, generator_cpus=2, num_instances=2)
  assert opts["num_gpus"] == 2
  assert opts["num_cpus"] == 1.0
  assert opts["resources"] == {cluster.GENERATION_POOL: 1}


def test_two_instances_get_disjoint_gpus(fake_gpu_ray):
  engine = settings.Engine(num_instances=2, gpus_per_instance=2, tensor_parallel_size=2)
  opts = actor.actor_options(engine, generator_cpus=2, num_instances=2)
  actors = [_VisibleGpus.options(**opts).remote() for _ in range(2)]
  got = ray.get([a.gpu_ids.remote() for a in actors], timeout=120)
  ids = [set(g.split(",")) for g in got]
  assert [len(i) for i in ids] == [2, 2]
  assert not ids[0] & ids[1]
  assert ids[0] | ids[1] <= {str(i) for i in range(8)}
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
  from streamrl.trainer import setup  # pylint: disable=g-import-not-at-top

  rollout = types.SimpleNamespace(
      placement={
          0: {"pid": 1, "cores": (0,), "torch_threads": 1, "gpu_ids": "0,1", "startup_s": 2.0}
      },
      live_instances=[0],
      dead_instances=[],
      retired=[],
  )
  setup.write_placement(str(tmp_path), {"trainer": {"pid": 0}}, rollout)
  with open(tmp_path / "placement.json") as f:
    got = json.load(f)
  assert got["generators"]["0"] == {"pid": 1, "cores": [0], "torch_threads": 1, "gpu_ids": "0,1"}


def _gpu_settings(name: str) -> settings.Settings:
  cfg = config_lib.load_config(os.path.join(CONFIGS, f"{name}.py"))
  return settings.from_config(cfg, check_files=False)


@pytest.mark.parametrize("name", ["ppo_qwen2_5_7b", "ppo_qwen2_5_1_5b"])
def test_a_gpu_config_gets_every_actor_its_own_gpus(fake_gpu_ray, name):
  """The trainer and every generator, with the options the run really uses,
  on a node of 8 fake GPUs: each gets the count its config asks for, and no
  GPU is given twice."""
  s = _gpu_settings(name)
  e = s.engine
  trainer = _VisibleGpus.options(**experiment.trainer_actor_options(s.cluster)).remote()
  gen_opts = actor.actor_options(e, s.cluster.generator_cpus, e.num_instances)
  gens = [_VisibleGpus.options(**gen_opts).remote() for _ in range(e.num_instances)]
  got = ray.get([a.gpu_ids.remote() for a in [trainer, *gens]], timeout=120)
  ids = [set(g.split(",")) for g in got]
  assert len(ids[0]) == s.cluster.trainer_gpus
  assert all(len(i) == e.gpus_per_instance for i in ids[1:])
  assert sum(len(i) for i in ids) == len(set().union(*ids)) == s.gpus_needed
  for a in [trainer, *gens]:
    ray.kill(a)


def test_asking_for_more_gpus_than_the_cluster_has_is_one_clear_error():
  with pytest.raises(UserError, match="asks for 10 GPUs .* has 8") as info:
    cluster.check_gpus(10, {"GPU": 8.0, "CPU": 16.0})
  assert "\n" not in str(info.value)
  cluster.check_gpus(8, {"GPU": 8.0})
  cluster.check_gpus(0, {"CPU": 2.0})


def test_gpus_needed_counts_generators_only_when_they_are_actors():
  s = _gpu_settings("ppo_qwen2_5_7b")
  assert s.gpus_needed == 8
  colocated = s.replace(pipeline=dataclasses.replace(s.pipeline, mode="colocated"))
  assert colocated.gpus_needed == s.cluster.trainer_gpus


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(mesh=dict(data=1, fsdp=2, tensor=1), trainer_gpus=4), "must cover"),
        (dict(mesh=dict(data=1, fsdp=-1, tensor=3), trainer_gpus=4), "not a multiple"),
        (dict(mode="colocated", util=0.9, gpus=1), "gpu_memory_utilization=0.9"),
    ],
)
def test_inconsistent_gpu_settings_are_refused(overrides, match):
  cfg = settings.default_config()
  if "mesh" in overrides:
    cfg.mesh = overrides["mesh"]
    cfg.cluster.trainer_gpus = overrides["trainer_gpus"]
  else:
    cfg.pipeline.mode = overrides["mode"]
    cfg.engine.gpus_per_instance = overrides["gpus"]
    cfg.engine.gpu_memory_utilization = overrides["util"]
  with pytest.raises(UserError, match=match) as info:
    settings.from_config(cfg)
  assert "\n" not in str(info.value)


def test_colocated_on_gpu_leaves_jax_what_vllm_does_not_take():
  env = {}
  experiment.share_gpu_memory(settings.Engine(gpus_per_instance=1, gpu_memory_utilization=0.4), env)
  assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.55"}
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}  # the user's own choice wins
  experiment.share_gpu_memory(settings.Engine(gpus_per_instance=1), env)
  assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
  env = {}  # on CPU nothing is set
  experiment.share_gpu_memory(settings.Engine(), env)
  assert env == {}


def test_labels_no_node_carries_are_refused_up_front():
  nodes = [
      {"Alive": True, "Resources": {cluster.GENERATION_POOL: 4}, "Labels": {"datacenter": "dc1"}},
      {"Alive": True, "Resources": {cluster.TRAINING_POOL: 1}, "Labels": {"datacenter": "dc0"}},
      {"Alive": False, "Resources": {cluster.GENERATION_POOL: 4}, "Labels": {"datacenter": "dc2"}},
  ]
  ok = settings.Cluster(generation_labels="datacenter=dc1", training_labels="datacenter=dc0")
  cluster.check_placement(ok, nodes)
  for bad in (
      settings.Cluster(generation_labels="datacenter=dc2"),  # only on a dead node
      settings.Cluster(generation_labels="datacenter=dc0"),  # no generation pool there
      settings.Cluster(training_labels="accelerator=H800"),
  ):
    with pytest.raises(UserError, match="No Ray node offers"):
      cluster.check_placement(bad, nodes)
