"""Every shipped config builds, validates, and (for GPUs) has a consistent mesh."""

import glob
import importlib.util
import os

import jax
import numpy as np
import pytest

from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.trainer import setup, sharding

pytestmark = [pytest.mark.unit]

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


@pytest.mark.parametrize("name", ["ppo", "grpo", "agentic", *GPU_CONFIGS])
def test_rl_configs_validate(name):
  cfg = config_lib.load_config(os.path.join(CONFIGS, f"{name}.py"))
  # The GPU configs name paths on a GPU machine; everything else is checked.
  s = settings.from_config(cfg, check_files=name not in GPU_CONFIGS)
  assert s.pipeline.mode in settings.PIPELINE_MODES


def test_run_configs_validate_from_any_directory(tmp_path, monkeypatch):
  # Their paths (scheduler.ranker_config=configs/ranker.py:tiny, ...) do not
  # depend on the working directory.
  monkeypatch.chdir(tmp_path)
  for spec in ("ppo.py", "grpo.py", "ppo_strings.py", "colocated.py:ppo"):
    settings.from_config(config_lib.load_config(os.path.join(CONFIGS, spec)))
  assert not os.listdir(tmp_path)


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
  assert s.task.kind == "file" and s.model.path and s.model.dtype == "bfloat16"
  assert s.pipeline.mode != "colocated"


def test_every_config_file_has_a_documented_get_config():
  for path in glob.glob(os.path.join(CONFIGS, "**", "*.py"), recursive=True):
    text = open(path).read()
    assert "def get_config" in text, path
    assert text.lstrip().startswith(('r"""', '"""')), f"{path} needs a docstring with the command"


def _settings(spec: str) -> settings.Settings:
  return settings.from_config(config_lib.load_config(os.path.join(CONFIGS, spec)))


@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_run_configs_are_streamrl_and_the_baseline_differs_only_in_how_it_runs(name):
  s = _settings(f"{name}.py")
  # StreamRL: disaggregated async generation, the ranker with skew-aware
  # dispatch, weights through the transfer service, on long-tailed traces.
  assert s.pipeline.mode == "async" and s.scheduler.kind == "skew" and s.transfer.enabled
  assert s.partial_rollouts  # the long tail resumes next round
  assert s.task.kind == "trace" and s.trainer.micro_batch_size < s.trainer.mini_batch_size
  # The warm-up's traces leave the sampled policy headroom before the limit.
  budget = setup.trace_config(s).max_tokens
  assert budget == int(s.task.trace_token_fraction * s.sampling.max_tokens) < s.sampling.max_tokens
  base = _settings(f"colocated.py:{name}")
  assert base.pipeline.mode == "colocated" and base.scheduler.kind == "fifo"
  assert not base.transfer.enabled and not base.elastic.enabled
  assert not base.partial_rollouts  # "auto" follows the mode
  same_otherwise = base.replace(pipeline=s.pipeline, scheduler=s.scheduler, transfer=s.transfer)
  assert same_otherwise == s


def test_the_string_task_config_keeps_the_previous_workload():
  s = _settings("colocated.py:ppo_strings")
  assert s.task.kind == "synthetic" and s.pipeline.mode == "colocated"
  assert s.sampling.max_tokens == 56 and s.engine.max_model_len == 128


def test_the_baseline_of_a_missing_config_names_the_file():
  with pytest.raises(Exception, match="nope.py"):
    config_lib.load_config(os.path.join(CONFIGS, "colocated.py:nope"))
