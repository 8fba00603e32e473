"""Config files found from any directory, and their relative paths made absolute."""

import os

import ml_collections
import pytest

from streamrl.config import find_config_file, load_config, load_sweep, resolve_paths
from tests.config.test_overrides import CONFIG_PY

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_config_files_are_found_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  ppo = os.path.join(REPO, "configs", "ppo.py")
  assert find_config_file("configs/ppo.py") == ppo
  assert find_config_file("configs/ranker.py:tiny") == os.path.join(
      REPO, "configs", "ranker.py:tiny"
  )
  for unchanged in (ppo, "configs/nope.py", "nope.py:arg", ""):
    assert find_config_file(unchanged) == unchanged
  assert load_config("configs/grpo.py").advantage.estimator == "grpo"  # It loads configs/ppo.py.
  assert load_sweep("configs/ppo.py")
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "ppo.py").write_text(CONFIG_PY)
  assert find_config_file("configs/ppo.py") == "configs/ppo.py"  # The working directory's wins.


def test_relative_paths_resolve_against_the_config_file_then_the_checkout(tmp_path, monkeypatch):
  (tmp_path / "data").mkdir()
  (tmp_path / "data" / "train.jsonl").write_text("{}\n")
  (tmp_path / "rw.py").write_text("def f(r, a): return 0.0\n")
  cfg = ml_collections.ConfigDict(
      {
          "task": {"train_path": "data/train.jsonl", "eval_path": "", "reward": "rw.py:f"},
          "scheduler": {"ranker_config": "configs/ranker.py:tiny"},
          "model": {"path": "/abs/model"},
          "other": {"name": "data/train.jsonl"},
      }
  )
  monkeypatch.chdir("/")
  out = resolve_paths(cfg, str(tmp_path))
  assert out.task.train_path == str(tmp_path / "data" / "train.jsonl")
  assert out.task.reward == f"{tmp_path / 'rw.py'}:f"
  assert out.task.eval_path == "" and out.model.path == "/abs/model"
  assert out.other.name == "data/train.jsonl"  # not a path key
  assert cfg.task.train_path == "data/train.jsonl"  # the input is left as it was
