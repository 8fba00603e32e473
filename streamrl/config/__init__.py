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

from streamrl.config.files import REPO_ROOT, find_config_file, load_config, resolve_paths
from streamrl.config.overrides import apply_overrides, renamed
from streamrl.config.sweeps import check_run_names, expand_sweep, load_sweep, run_name

__all__ = [
    "REPO_ROOT",
    "apply_overrides",
    "check_run_names",
    "expand_sweep",
    "find_config_file",
    "load_config",
    "load_sweep",
    "renamed",
    "resolve_paths",
    "run_name",
]
