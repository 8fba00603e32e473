"""Config files: finding them from any directory, loading `get_config()`, their paths.

  config = load_config("configs/ppo.py")            # or "configs/ranker.py:tiny"
  config = resolve_paths(config, os.path.dirname(path))

A relative config path is looked up in the working directory, then in the
checkout (`REPO_ROOT`), so `--config=configs/ppo.py` works from anywhere.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from streamrl.config.overrides import all_keys
from streamrl.errors import MissingFileError

# The checkout: configs/ beside the streamrl package.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_config_file(spec: str) -> str:
  """`spec` ("path.py" or "path.py:arg"), its path made absolute in the checkout
  when it is relative, missing from the working directory and present under
  REPO_ROOT: `--config=configs/ppo.py` (and the `configs/ranker.py:tiny`
  default of scheduler.ranker_config) work from any directory. Otherwise
  `spec` unchanged."""
  path, sep, arg = spec.partition(":")
  if path and not os.path.isabs(path) and not os.path.exists(path):
    in_repo = os.path.join(REPO_ROOT, path)
    if os.path.exists(in_repo):
      return in_repo + sep + arg
  return spec


def _is_path_key(key: str) -> bool:
  leaf = key.rsplit(".", 1)[-1]
  return leaf == "path" or leaf.endswith("_path")


def _absolute_function(spec: str, absolute) -> str:
  """A `file.py:function` (or bare `file.py`) spec with its path made absolute."""
  where, sep, name = spec.strip().rpartition(":")
  if sep and where.endswith(".py"):
    return f"{absolute(where)}:{name}"
  return absolute(spec.strip()) if spec.strip().endswith(".py") else spec


def resolve_paths(config: ml_collections.ConfigDict, base_dir: str) -> ml_collections.ConfigDict:
  """The config with relative file paths made absolute: every `*path` key (each
  file of a comma-separated list) and each `file.py:function` reward of
  `task.reward`. A relative path resolves against
  `base_dir` (the config file's directory), else the checkout, else the
  working directory — the first where it exists (unchanged if none: the
  settings' check names it)."""
  roots = (base_dir, REPO_ROOT, os.getcwd())

  def absolute(path: str) -> str:
    if not path or os.path.isabs(path):
      return path
    for root in roots:
      if os.path.exists(os.path.join(root, path)):
        return os.path.abspath(os.path.join(root, path))
    return path

  def node_of(key: str):
    node = config
    for part in key.split(".")[:-1]:
      node = node[part]
    return node

  updates = {}
  for key in all_keys(config):
    value = node_of(key)[key.rsplit(".", 1)[-1]]
    if not isinstance(value, str):
      continue
    if _is_path_key(key):
      # A comma-separated list of data files resolves file by file.
      new = ",".join(absolute(p) for p in value.split(",")) if "," in value else absolute(value)
    elif key == "task.reward" and ".py" in value:
      new = ",".join(_absolute_function(f, absolute) for f in value.split(","))
    else:
      continue
    if new != value:
      updates[key] = new
  if not updates:
    return config
  config = ml_collections.ConfigDict(config.to_dict())
  for key, value in updates.items():
    node_of(key)[key.rsplit(".", 1)[-1]] = value
  return config


def load_config(spec: str) -> ml_collections.ConfigDict:
  """ "path/to/config.py[:arg]" -> its get_config(arg). A relative path is
  looked up from the working directory, then from the repository root
  (`find_config_file`)."""
  path, _, arg = find_config_file(spec).partition(":")
  if not os.path.isfile(path):
    raise MissingFileError(
        f"Config file {spec!r} not found; give a path like " "configs/ranker.py:tiny."
    )
  module_spec = importlib.util.spec_from_file_location(
      "streamrl_config_" + os.path.basename(path)[:-3], path
  )
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()
