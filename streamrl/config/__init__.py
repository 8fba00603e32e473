"""A run's config: files, overrides, sweeps, the typed settings and their checks.

  config = config_lib.load_config("configs/ppo.py")
  config = config_lib.apply_overrides(config, ["optimizer.lr=3e-6"])
  s = settings.from_config(config)          # streamrl.config.settings

  files.py      finding and loading config files, making their paths absolute
  overrides.py  `key=value` overrides, checked against the config's fields
  sweeps.py     a config's `get_sweep()`, its points and their run names
  settings.py   every part's settings assembled, the rules between parts
  checks.py     the checks a part's settings run, and the one type check
  renames.py    config keys renamed in 0.1, accepted until 0.2.0

This package's own names load configs; `settings` is imported as a module
(`from streamrl.config import settings`), since it imports every part's
settings.
"""

import importlib

# Loaded on first use (PEP 562): every part's settings import `checks` from here,
# and loading configs needs ml_collections, which a trainer-only process (the
# GPU checks) does without.
_OWNERS = {
    "REPO_ROOT": "files",
    "find_config_file": "files",
    "load_config": "files",
    "resolve_paths": "files",
    "apply_overrides": "overrides",
    "renamed": "overrides",
    "check_run_names": "sweeps",
    "expand_sweep": "sweeps",
    "load_sweep": "sweeps",
    "run_name": "sweeps",
}
__all__ = sorted(_OWNERS)


def __getattr__(name: str):
  if name not in _OWNERS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_OWNERS[name]}"), name)
