"""Sweeps: a config's `get_sweep()`, its grid of points, and a run name for each.

  points = expand_sweep([{"optimizer.lr": [1e-6, 3e-6], "kl.coef": 0.01}])
  run_name(points[0])  # 'optimizer.lr=1e-06,kl.coef=0.01'
  points = load_sweep("configs/grpo.py")

Each point is a dict of overrides (`overrides.apply_overrides` applies it);
launch/sweep.py runs them one after another.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from streamrl.config.files import find_config_file
from streamrl.errors import MissingFileError, UserError


def expand_sweep(sweep: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> list[dict[str, Any]]:
  """Flat override dicts, one per run.

  Each dict in `sweep` is a grid: a *list* value is an axis to sweep, any
  other value (tuples included) is fixed; the grid's points come in
  itertools.product order of its keys. The grids' points are concatenated.

    expand_sweep([{"a": [1, 2], "b": 0.5}, {"a": 3}])
    -> [{"a": 1, "b": 0.5}, {"a": 2, "b": 0.5}, {"a": 3}]
  """
  if isinstance(sweep, Mapping):
    sweep = [sweep]
  if not isinstance(sweep, (list, tuple)) or not sweep:
    raise UserError(
        f"a sweep is a non-empty list of override dicts like [{{'optimizer.lr': [1e-6, 3e-6]}}], "
        f"got {sweep!r}."
    )
  points = []
  for grid in sweep:
    if not isinstance(grid, Mapping):
      raise UserError(f"each sweep entry must be a dict of overrides, got {grid!r}.")
    keys = list(grid)
    for k in keys:
      if not isinstance(k, str) or not k:
        raise UserError(f"sweep keys are dotted config names like 'optimizer.lr', got {k!r}.")
    axes = []
    for k in keys:
      v = grid[k]
      if isinstance(v, list):
        if not v:
          raise UserError(f"sweep axis {k!r} is an empty list; give it at least one value.")
        axes.append(v)
      else:
        axes.append([v])
    points.extend(dict(zip(keys, combo)) for combo in itertools.product(*axes))
  return points


def _format_value(v: Any) -> str:
  if isinstance(v, (tuple, list)):
    return "_".join(_format_value(x) for x in v)
  if isinstance(v, float):
    return repr(v)
  return str(v)


def run_name(overrides: Mapping[str, Any], max_len: int = 120) -> str:
  """A readable, filesystem-safe, deterministic directory name for one sweep point.

  'optimizer.lr=3e-06,kl.coef=0.01' (keys in the given order; floats as
  repr; tuples joined by '_'). Characters other than letters, digits and
  `._,=+-` become '_'; whenever that changed the text, or it is longer than
  `max_len` (then truncated), an 8-hex hash of the exact overrides is
  appended, so different points never share a name. {} -> 'base'.
  """
  if not overrides:
    return "base"
  raw = ",".join(f"{k}={_format_value(v)}" for k, v in overrides.items())
  safe = re.sub(r"[^A-Za-z0-9._,=+\-]", "_", raw)
  if safe == raw and len(safe) <= max_len:
    return safe
  digest = hashlib.sha1(
      json.dumps([[k, repr(v)] for k, v in overrides.items()]).encode()
  ).hexdigest()[:8]
  return f"{safe[:max(1, max_len - 9)]}-{digest}"


def check_run_names(points: Iterable[Mapping[str, Any]]) -> list[str]:
  """run_name of each point; ValueError if two points are the same run."""
  names: dict[str, Mapping[str, Any]] = {}
  out = []
  for p in points:
    name = run_name(p)
    if name in names:
      raise UserError(
          f"the sweep has the same point twice ({dict(p)!r} and {dict(names[name])!r}); "
          "remove the duplicate."
      )
    names[name] = p
    out.append(name)
  return out


def load_sweep(config_spec: str) -> list[dict[str, Any]]:
  """Expanded points of `get_sweep()` in the config file `config_spec` ("path.py" or "path.py:arg").

  `get_sweep` may take the same optional argument as `get_config` (the part
  after ':'); it returns what `expand_sweep` accepts.

  Raises:
    FileNotFoundError: no such file.
    ValueError: the file defines no get_sweep(), or its sweep is malformed.
  """
  path, sep, arg = find_config_file(config_spec).partition(":")
  if not os.path.isfile(path):
    raise MissingFileError(
        f"config file {path!r} does not exist; pass the path of a config .py file."
    )
  name = "streamrl_sweep_config_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:8]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  get_sweep = getattr(module, "get_sweep", None)
  if not callable(get_sweep):
    raise UserError(
        f"{path} defines no get_sweep(); add one returning a list of override dicts, e.g. "
        "[{'optimizer.lr': [1e-6, 3e-6]}]."
    )
  takes_arg = any(
      p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
      for p in inspect.signature(get_sweep).parameters.values()
  )
  sweep = get_sweep(arg if sep else None) if takes_arg else get_sweep()
  return expand_sweep(sweep)
