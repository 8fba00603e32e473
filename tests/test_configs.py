"""Every shipped config builds, validates, and (for GPUs) has a consistent mesh."""

import glob
import importlib.util
import os

import jax
import numpy as np
import pytest

from streamrl import config_utils, settings
from streamrl.trainer import sharding

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


GPU_CONFIGS = ["ppo_qwen2_5_7b", "ppo_qwen2_5_1_5b"]


def _gpu_configs_on_disk() -> list[str]:
  names = []
  for path in glob.glob(os.path.join(CONFIGS, "*.py")):
    if "NUM_GPUS" in open(path).read():
      names.append(os.path.basename(path)[:-3])
  return sorted(names)


def test_every_gpu_config_is_checked_here():
  assert _gpu_configs_on_disk() == sorted(GPU_CONFIGS)


@pytest.mark.parametrize("name", ["ppo", "grpo", *GPU_CONFIGS])
def test_rl_configs_validate(name):
  cfg = config_utils.load_config(os.path.join(CONFIGS, f"{name}.py"))
  # The GPU configs name paths on a GPU machine; everything else is checked.
  s = settings.from_config(cfg, check_files=name not in GPU_CONFIGS)
  assert s.pipeline.mode in settings.PIPELINE_MODES


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_gpu_config_adds_up_to_the_gpus_it_claims(name):
  spec = importlib.util.spec_from_file_location(
      f"gpu_config_{name}", os.path.join(CONFIGS, f"{name}.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  s = settings.from_config(module.get_config(), check_files=False)
  e, c = s.engine, s.cluster
  assert s.gpus_needed == module.NUM_GPUS
  assert e.gpus_per_instance >= 1 and e.tensor_parallel_size == e.gpus_per_instance
  assert c.trainer_gpus >= 1
  sizes = s.mesh.axes()
  assert int(np.prod(list(sizes.values()))) == c.trainer_gpus
  # Fake CPU devices (tests/conftest.py) stand in for the trainer's GPUs.
  mesh = sharding.make_mesh(sizes, jax.devices()[: c.trainer_gpus])
  assert mesh.devices.size == c.trainer_gpus
  data_parallel = sizes["data"] * sizes["fsdp"]
  tr = s.trainer
  assert s.samples_per_iteration % tr.mini_batch_size == 0
  assert tr.micro_batch_size % data_parallel == 0
  assert s.sampling.max_tokens < e.max_model_len
  assert s.task.kind == "jsonl" and s.model.path and s.model.dtype == "bfloat16"
  assert s.pipeline.mode != "colocated"


def test_every_config_file_has_a_documented_get_config():
  for path in glob.glob(os.path.join(CONFIGS, "**", "*.py"), recursive=True):
    text = open(path).read()
    assert "def get_config" in text, path
    assert text.lstrip().startswith(('r"""', '"""')), f"{path} needs a docstring with the command"
