"""Every shipped config builds, validates, and (for GPUs) has a consistent mesh."""

import glob
import os

import numpy as np
import pytest

from streamrl import config_utils, settings
from streamrl.trainer import sharding

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


@pytest.mark.parametrize("name", ["ppo", "grpo", "ppo_qwen2_5_7b"])
def test_rl_configs_validate(name):
  cfg = config_utils.load_config(os.path.join(CONFIGS, f"{name}.py"))
  # The 7B config names paths on a GPU machine; everything else is checked.
  s = settings.from_config(cfg, check_files=name != "ppo_qwen2_5_7b")
  assert s.pipeline.mode in settings.PIPELINE_MODES


def test_qwen_7b_config_fits_8_devices():
  cfg = config_utils.load_config(os.path.join(CONFIGS, "ppo_qwen2_5_7b.py"))
  sizes = dict(cfg.mesh)
  assert int(np.prod(list(sizes.values()))) == 8
  # The 8 fake CPU devices of tests/conftest.py stand in for the 8 GPUs.
  mesh = sharding.make_mesh(sizes)
  assert mesh.devices.size == 8
  data_parallel = sizes["data"] * sizes["fsdp"]
  tr = cfg.trainer
  assert (tr.prompts_per_iteration * cfg.algo.group_size) % tr.mini_batch_size == 0
  assert tr.mini_batch_size % tr.micro_batch_size == 0
  assert tr.micro_batch_size % data_parallel == 0
  assert cfg.generation.max_tokens < cfg.generation.max_model_len
  assert cfg.task.kind == "jsonl" and cfg.model.path


def test_every_config_file_has_a_documented_get_config():
  for path in glob.glob(os.path.join(CONFIGS, "**", "*.py"), recursive=True):
    text = open(path).read()
    assert "def get_config" in text, path
    assert text.lstrip().startswith(('r"""', '"""')), f"{path} needs a docstring with the command"
