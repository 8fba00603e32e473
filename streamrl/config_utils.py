"""ml_collections helpers: checked overrides, one-sentence flag errors, sweeps, run names.

  config = apply_overrides(get_config(), ["optimizer.lr=3e-6", "trainer.num_iterations=2"])
  run_main(main)   # in launch scripts, instead of app.run(main)
  points = expand_sweep([{"optimizer.lr": [1e-6, 3e-6], "kl.coef": 0.01}])
  run_name(points[0])  # 'optimizer.lr=1e-06,kl.coef=0.01'

String overrides are parsed the way `config_flags.DEFINE_config_file` parses
`--config.key=value` (by the type of the field being overridden: absl's
int/float/bool parsers, tuples from "(1, 8)" or "1", strings as they are);
two additions: a field that is None takes any Python literal, and "None" sets
such a field back to None. Index paths (`a.b[0]`) are not supported here.

`absl` reports an unknown `--config.x.y` key with a traceback from deep in
ml_collections; `parse_flags_or_exit` turns that and the other user errors
(wrong type, missing config file, a config file that raises) into one line.
`run_main` does the same for a `streamrl.errors.UserError` raised by the
script's main: `error: <sentence>` on stderr, exit status 2, no traceback
(unless --debug or STREAMRL_DEBUG=1). The errors raised here for bad
overrides, sweeps and config paths are UserErrors (so also ValueErrors;
MissingFileError is also a FileNotFoundError).
"""

from __future__ import annotations

import ast
import copy
import difflib
import hashlib
import itertools
import json
import os
import re
import sys
from typing import Any, Callable, Iterable, Mapping, NoReturn, Sequence

import ml_collections
from absl import app, flags
from ml_collections.config_flags import config_flags, tuple_parser

from streamrl import renames
from streamrl.errors import MissingFileError, RunStopped, UserError, debug_requested, user_message

# -------------------------------------------------------------- config files

# The checkout: configs/ beside the streamrl package.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  for key in _all_keys(config):
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


# ----------------------------------------------------------------- overrides

_NoneType = type(None)
_TYPE_NAMES = {
    int: "an int",
    float: "a float",
    bool: "a bool (true/false)",
    str: "a string",
    tuple: "a tuple like '(1, 8)'",
}


def _is_node(x: Any) -> bool:
  return isinstance(x, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict, dict))


def _all_keys(node: Any, prefix: str = "") -> list[str]:
  """Every dotted path in `node`: sub-dicts and leaves."""
  out = []
  for key in node.keys():
    path = f"{prefix}{key}"
    out.append(path)
    if _is_node(node[key]):
      out.extend(_all_keys(node[key], path + "."))
  return out


def _unknown_key(config: Any, key: str) -> UserError:
  parts = key.split(".")
  node, depth = config, 0  # Deepest existing ancestor of the key.
  while (
      depth < len(parts) - 1
      and _is_node(node)
      and parts[depth] in node
      and _is_node(node[parts[depth]])
  ):
    node, depth = node[parts[depth]], depth + 1
  prefix = ".".join(parts[:depth])
  if depth < len(parts) - 1 and _is_node(node) and parts[depth] in node:
    leaf = ".".join(parts[: depth + 1])
    return UserError(f"unknown config key {key!r}; {leaf} is a value, not a group of keys.")
  # Siblings first: a shared "trainer." prefix would make any trainer.* key look close.
  close = []
  if depth == len(parts) - 1:
    close = [
        f"{prefix}.{m}" if prefix else m
        for m in difflib.get_close_matches(parts[-1], list(node.keys()), n=3, cutoff=0.6)
    ]
  if not close:  # A misplaced or misspelled parent: match the last component anywhere.
    by_last: dict[str, list[str]] = {}
    for k in _all_keys(config):
      by_last.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for m in difflib.get_close_matches(parts[-1], list(by_last), n=3, cutoff=0.6):
      close.extend(by_last[m])
    close = close[:3]
  if close:
    return UserError(f"unknown config key {key!r}; did you mean {', '.join(close)}?")
  names = sorted(node.keys())
  shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
  where = f"under {prefix}" if prefix else "at the top level"
  return UserError(f"unknown config key {key!r}; the keys {where} are: {shown}.")


def _locate(config: Any, key: str) -> tuple[Any, str]:
  """(parent node, leaf name) of dotted `key`, or ValueError naming close keys."""
  parts = key.split(".")
  if not all(parts):
    raise UserError(f"malformed config key {key!r}; use dotted names like optimizer.lr.")
  node = config
  for i, part in enumerate(parts):
    if not _is_node(node) or part not in node:
      raise _unknown_key(config, key)
    if i == len(parts) - 1:
      return node, part
    node = node[part]
  raise AssertionError("unreachable")


def _field_type(node: Any, name: str) -> type:
  if isinstance(node, ml_collections.ConfigDict):
    return node.get_type(name)  # FieldReference(None, field_type=str) -> str
  return type(node[name])


def _wrong_type(key: str, want: type, got: Any, current: Any) -> UserError:
  want_name = _TYPE_NAMES.get(want, f"a {getattr(want, '__name__', want)}")
  return UserError(f"cannot set {key} to {got!r}: it expects {want_name} (currently {current!r}).")


def _parse_string(key: str, raw: str, want: type, current: Any) -> Any:
  """Parses `raw` for a field of type `want` the way config_flags does."""
  if current is None and raw in ("None", "none"):
    return None
  try:
    if want is bool:
      return flags.BooleanParser().parse(raw)
    if want is int:
      return flags.IntegerParser().parse(raw)
    if want is float:
      return flags.FloatParser().parse(raw)
    if want is tuple:
      return tuple_parser.TupleParser().parse(raw)
    if want is str:
      return raw
  except (ValueError, TypeError, SyntaxError):
    raise _wrong_type(key, want, raw, current) from None
  if want is _NoneType or want is object:
    try:
      return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      return raw  # Like config_flags: an unparsable literal is a string.
  if isinstance(want, type) and issubclass(want, (ml_collections.ConfigDict, dict)):
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = None
    if not isinstance(value, dict):
      raise _wrong_type(key, dict, raw, current)
    return value
  return raw  # Anything else (enums, ...): let ConfigDict's own type check decide.


def _check_value(key: str, value: Any, want: type, current: Any) -> Any:
  """A typed (not string) override, checked strictly: no bool for numbers, no float for ints."""
  if value is None:
    return None  # ConfigDict itself refuses None where the field does not allow it.
  if want is bool and not isinstance(value, bool):
    raise _wrong_type(key, want, value, current)
  if want is int and (isinstance(value, bool) or not isinstance(value, int)):
    raise _wrong_type(key, want, value, current)
  if want is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise _wrong_type(key, want, value, current)
    return float(value)
  if want is tuple:
    if not isinstance(value, (tuple, list)):
      raise _wrong_type(key, want, value, current)
    return tuple(value)
  if want is str and not isinstance(value, str):
    raise _wrong_type(key, want, value, current)
  return value


def _has(config: Any, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not _is_node(node) or part not in node:
      return False
    node = node[part]
  return True


def renamed(config: Any, key: str) -> str:
  """`key`, or its new name when it is a key renamed in 0.1 (streamrl/renames.py)
  that `config` only has under the new name (printing one line that says so)."""
  new = renames.OLD_TO_NEW.get(key)
  if new is None or _has(config, key) or not _has(config, new):
    return key
  return renames.new_key(key)


def _split_override(item: str) -> tuple[str, str]:
  if not isinstance(item, str) or "=" not in item:
    raise UserError(f"override {item!r} must look like key=value, e.g. optimizer.lr=3e-6.")
  key, raw = item.split("=", 1)
  return key.strip(), raw


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[str] | Mapping[str, Any]
) -> ml_collections.ConfigDict:
  """A copy of `config` with overrides applied; `config` itself is untouched.

  Args:
    config: the base config (locked or not; no new keys can be added either way).
    overrides: ["optimizer.lr=3e-6", ...] strings parsed by field type, or a
      {"optimizer.lr": 3e-6} mapping of Python values (a string value for a
      non-string field is parsed like the command line).

  Raises:
    ValueError: one sentence naming an unknown key and its nearest valid keys,
      or a key, the type it expects and the value that was given.
  """
  from_strings = not isinstance(overrides, Mapping)
  items = [_split_override(o) for o in overrides] if from_strings else list(overrides.items())
  out = copy.deepcopy(config)
  for key, value in items:
    key = renamed(out, key)
    parent, name = _locate(out, key)
    want = _field_type(parent, name)
    current = parent[name]
    if isinstance(value, str) and (from_strings or want is not str):
      value = _parse_string(key, value, want, current)
    else:
      value = _check_value(key, value, want, current)
    try:
      parent[name] = value
    except (TypeError, ValueError) as e:
      raise UserError(f"cannot set {key} to {value!r}: {e}") from None
  return out


# ------------------------------------------------------------------ flag errors

# What a user can get wrong on a launch command line. Anything else (a bug in
# a config file: NameError, ...) keeps its traceback.
_USER_ERRORS = (flags.Error, KeyError, AttributeError, OSError, ValueError, TypeError)


def _flag_overrides(argv: Sequence[str], name: str, config: Any) -> list[tuple[str, str]]:
  """(key, raw value) of every --<name>.key override in argv, in order."""
  out = []
  args = list(argv[1:])
  pat = re.compile(rf"^--?(no)?{re.escape(name)}\.([^=]+)(=(.*))?$", re.S)
  for i, arg in enumerate(args):
    m = pat.match(arg)
    if not m:
      continue
    negated, key, has_value, value = m.group(1), m.group(2), m.group(3), m.group(4)
    if has_value:
      out.append((key, value))
      continue
    is_bool = False
    try:
      parent, leaf = _locate(config, key)
      is_bool = _field_type(parent, leaf) is bool
    except ValueError:
      pass
    if negated or is_bool or i + 1 >= len(args):
      out.append((key, "false" if negated else "true"))
    else:
      out.append((key, args[i + 1]))  # absl's "--flag value" form.
  return out


def _config_arg(argv: Sequence[str], name: str, default: Any) -> str | None:
  """The value of --<name> on the command line (last wins), else `default` if it is a path."""
  found = None
  args = list(argv[1:])
  for i, arg in enumerate(args):
    m = re.match(rf"^--?{re.escape(name)}(=(.*))?$", arg, re.S)
    if m:
      found = m.group(2) if m.group(1) else (args[i + 1] if i + 1 < len(args) else None)
  if found is None and isinstance(default, str):
    found = default
  return found or None


def _config_specs(flag_values: flags.FlagValues) -> list[tuple[str, Any]]:
  """(name, default) of each config-file flag."""
  seen, out = set(), []
  for flag in flag_values._flags().values():  # pylint: disable=protected-access
    if config_flags.is_config_flag(flag) and id(flag) not in seen:
      seen.add(id(flag))
      # Once parsed, a config flag's default is the ConfigDict; its path survives in default_as_str.
      default = flag.default
      if default is not None and not isinstance(default, str):
        default = str(getattr(flag, "default_as_str", "")).strip("'") or None
      out.append((flag.name, default))
  return out


def _explain_config_file_error(text: str, path: str) -> str:
  """One sentence from config_flags' 'Error whilst parsing config file' traceback."""
  lines = [l for l in text.splitlines() if l.strip()]
  last = lines[-1].strip() if lines else text
  where = re.findall(r'File "([^"]+)", line (\d+)', text)
  at = f" (at {os.path.relpath(where[-1][0])}:{where[-1][1]})" if where else ""
  return f"config {path} failed to build: {last.rstrip('.')}{at}."


def _explain(
    error: BaseException, argv: Sequence[str], specs: Sequence[tuple[str, Any]]
) -> str | None:
  text = str(error)
  unsupported = re.search(r"Type (.+?) of field (\S+) is not supported for overriding", text)
  if unsupported:
    type_name = re.sub(r"<class '(?:\w+\.)*(\w+)'>", r"\1", unsupported.group(1)).replace(
        "NoneType", "None"
    )
    return (
        f"--{unsupported.group(2)} cannot be set from the command line because its default has type "
        f"{type_name}; give it a typed default in the config file (e.g. "
        "ml_collections.FieldReference(None, field_type=str))."
    )
  for name, default in specs:
    path = _config_arg(argv, name, default)
    if not path:
      continue
    file_path = path.split(":", 1)[0]
    if not os.path.isfile(file_path):
      return f"config file {file_path!r} (--{name}) does not exist; pass the path of a config .py file."
    if "Error whilst parsing config file" in text:
      return _explain_config_file_error(text, path)
    try:
      config = config_flags.ConfigFileFlagParser(name, lock_config=False).parse(path)
    except Exception:  # pylint: disable=broad-except
      continue  # Can't rebuild it here; fall back to the original message.
    try:
      apply_overrides(config, [f"{k}={v}" for k, v in _flag_overrides(argv, name, config)])
    except ValueError as e:
      return f"--{name}: {e}"
  if isinstance(error, flags.Error):
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
  return None


def explain_flag_error(
    error: BaseException, argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS
) -> str | None:
  """One sentence for a flag-parsing error caused by the user, or None if it is not one.

  Re-reads each config file named in argv and replays its --config.key=value
  overrides through `apply_overrides` to name the bad key or value.
  """
  return _explain(error, argv, _config_specs(flag_values))


USER_ERROR_EXIT_CODE = 2


def _exit_with(message: str, status: int = USER_ERROR_EXIT_CODE) -> NoReturn:
  """Prints `error: <message>` (one line) to stderr and exits with `status`."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {' '.join(message.split())}\n")
  sys.stderr.flush()
  sys.exit(status)


def define_config_file(
    name: str = "config",
    default: str | None = None,
    help_string: str = "Config file.",
    **kwargs: Any,
):
  """`config_flags.DEFINE_config_file`, with user errors as one line instead of a traceback.

  Needed besides `parse_flags_or_exit` because a config flag with a default
  path is parsed — overrides from sys.argv included — when it is defined,
  i.e. at import time of the launch script, before `app.run` starts. A
  relative default is found like a relative --config value (`find_config_file`).
  """
  if isinstance(default, str):
    default = find_config_file(default)
  try:
    holder = config_flags.DEFINE_config_file(name, default, help_string, **kwargs)
  except _USER_ERRORS as e:
    message = _explain(e, sys.argv, [(name, default)])
    if message is None or debug_requested(sys.argv):
      raise
    _exit_with(message)
  # A key flag of the script that defines it, so its --help lists it.
  caller = sys._getframe(1).f_globals.get("__name__")  # pylint: disable=protected-access
  flag_values = kwargs.get("flag_values", flags.FLAGS)
  flag_values.register_key_flag_for_module(
      sys.argv[0] if caller == "__main__" else caller, flag_values[name]
  )
  return holder


def _check_configs_loaded(flag_values: flags.FlagValues) -> None:
  """config_flags defers a missing config file's error to first use; surface it now."""
  for flag in flag_values._flags().values():  # pylint: disable=protected-access
    if config_flags.is_config_flag(flag) and type(flag.value).__name__ == "_ErrorConfig":
      raise OSError(f"config for --{flag.name} could not be loaded")


def _rename_flag_keys(argv: Sequence[str], flag_values: flags.FlagValues) -> list[str]:
  """argv with each `--<config>.<key renamed in 0.1>` under its new name
  (streamrl/renames.py), where the config file has only the new one."""
  argv = list(argv)
  for name, default in _config_specs(flag_values):
    prefix = re.compile(rf"^(--?(?:no)?{re.escape(name)}\.)([^=]+)(.*)$", re.S)
    hits = [(i, m) for i, m in enumerate(map(prefix.match, argv)) if m and i]
    if not any(renames.OLD_TO_NEW.get(m.group(2)) for _, m in hits):
      continue
    path = _config_arg(argv, name, default)
    if not path or not os.path.isfile(path.split(":", 1)[0]):
      continue
    try:
      config = config_flags.ConfigFileFlagParser(name, lock_config=False).parse(path)
    except Exception:  # pylint: disable=broad-except
      continue  # Its own error is reported when absl parses it.
    for i, m in hits:
      argv[i] = m.group(1) + renamed(config, m.group(2)) + m.group(3)
  return argv


def _find_config_args(argv: Sequence[str], flag_values: flags.FlagValues) -> list[str]:
  """argv with each config flag's value passed through `find_config_file`."""
  names = [name for name, _ in _config_specs(flag_values)]
  out = list(argv)
  for i in range(1, len(out)):
    for name in names:
      m = re.match(rf"^(--?{re.escape(name)}=)(.*)$", out[i], re.S)
      if m:
        out[i] = m.group(1) + find_config_file(m.group(2))
      elif out[i] in (f"--{name}", f"-{name}") and i + 1 < len(out):
        out[i + 1] = find_config_file(out[i + 1])
  return out


def parse_flags_or_exit(
    argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS
) -> list[str]:
  """`app.run(main, flags_parser=parse_flags_or_exit)`: absl parsing, user errors as one line.

  On a user error (unknown or mistyped --config.key, missing or failing
  config file, unknown flag) prints `error: <sentence>` to stderr and exits
  with status 2 (USER_ERROR_EXIT_CODE); other exceptions (bugs) keep their
  traceback, and so does every error under --debug or STREAMRL_DEBUG=1.
  Define the config flag with `define_config_file` so errors at definition
  time are reported the same way. `run_main` uses this parser.
  """
  try:
    renamed_argv = _rename_flag_keys(_find_config_args(argv, flag_values), flag_values)
    if list(argv) == sys.argv:  # config_flags reads its overrides from sys.argv.
      sys.argv[:] = renamed_argv
    argv = renamed_argv
    rest = flag_values(list(argv))
    _check_configs_loaded(flag_values)
    return rest
  except _USER_ERRORS as e:
    message = explain_flag_error(e, argv, flag_values)
    if message is None or debug_requested(list(argv)):
      raise
    _exit_with(message)


DEBUG_FLAG = "debug"


COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


def use_compile_cache(environ: dict[str, str] | None = None) -> str:
  """Keeps XLA's compiled programs across runs, in ~/.cache/streamrl/xla.

  A resumed run, a rerun or a sweep's next point then loads the trainer's
  compiled steps instead of compiling them again (the times, cold and warm,
  are in experiments/RESULTS.md). Sets JAX_COMPILATION_CACHE_DIR unless it is set already
  (a Ray actor started from this process inherits it); setting it to ""
  turns the cache off. Must run before JAX is imported. Returns the path
  in use ("" when off).
  """
  environ = os.environ if environ is None else environ
  default = os.path.join(os.path.expanduser("~"), ".cache", "streamrl", "xla")
  return environ.setdefault(COMPILE_CACHE_ENV, default)


_HELP_ARGS = {"-h": False, "-?": False, "--help": False, "-help": False, "--helpshort": False}
_HELP_ARGS.update({"-helpshort": False, "--helpfull": True, "-helpfull": True})


def help_requested(argv: Sequence[str]) -> bool | None:
  """None when argv asks for no help; else whether it asks for every flag
  (--helpfull) rather than the script's own (--help, -h, --helpshort)."""
  for arg in list(argv)[1:]:
    if arg == "--":
      break
    if arg in _HELP_ARGS:
      return _HELP_ARGS[arg]
  return None


def run_main(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> NoReturn:
  """Runs a launch script's `main(argv)` under absl, reporting user errors in one line.

    if __name__ == "__main__":
      config_utils.run_main(main)

  Flags are parsed by `parse_flags_or_exit`. A `streamrl.errors.UserError`
  raised by `main` (also one re-raised from a Ray actor) is printed as
  `error: <sentence>` on stderr and the process exits with status 2
  (USER_ERROR_EXIT_CODE). A `streamrl.errors.RunStopped` (a process of the run died) is printed the same way with status 1. Any other exception keeps its traceback. Defines a
  `--debug` flag (unless the script has one): with it, or with the
  environment variable STREAMRL_DEBUG=1, user errors show their traceback too.
  `--help` (or -h) prints the script's docstring and its own flags and exits
  with status 0, before any flag is parsed; `--helpfull` adds every library's.

  Args:
    main: called with the arguments left after flag parsing (argv[0] first);
      its return value is the exit status, as with `absl.app.run`.
    argv: the command line; default sys.argv.
  """
  if DEBUG_FLAG not in flags.FLAGS:
    flags.DEFINE_bool(
        DEBUG_FLAG,
        False,
        "Show the traceback of errors caused by the input (bad config "
        "value, missing file, ...) instead of one line; same as STREAMRL_DEBUG=1.",
    )
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[DEBUG_FLAG])
  full_help = help_requested(sys.argv if argv is None else argv)
  if full_help is not None:
    # absl's own --help exits with status 1; asking for help is no error.
    app.usage(shorthelp=not full_help, writeto_stdout=True)
    if not full_help:
      print("\nTry --helpfull to see the flags of every library too.")
    sys.exit(0)

  use_compile_cache()

  def guarded_main(args: list[str]) -> Any:
    try:
      return main(args)
    except (UserError, RunStopped) as e:
      debug = flags.FLAGS[DEBUG_FLAG].value if flags.FLAGS.is_parsed() else False
      if debug or debug_requested(()):
        raise
      if isinstance(e, RunStopped):  # Not the input's fault: status 1, like a crash.
        _exit_with(str(e), status=1)
      _exit_with(user_message(e))

  app.run(
      guarded_main, argv=list(argv) if argv is not None else None, flags_parser=parse_flags_or_exit
  )
  raise AssertionError("app.run returned")  # It always exits.


# --------------------------------------------------------------------- sweeps


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
  import importlib.util
  import inspect

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


def load_config(spec: str) -> ml_collections.ConfigDict:
  """ "path/to/config.py[:arg]" -> its get_config(arg). A relative path is
  looked up from the working directory, then from the repository root
  (`find_config_file`)."""
  import importlib.util  # pylint: disable=g-import-not-at-top

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
