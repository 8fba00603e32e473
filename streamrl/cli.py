"""The command line of the launch scripts: flags, `--help`, one-line errors, exit codes.

  CONFIG = define_config_file("config", None, "The run's config file.")
  run_main(main)   # in launch scripts, instead of app.run(main)

`absl` reports an unknown `--config.x.y` key with a traceback from deep in
ml_collections; `parse_flags_or_exit` turns that and the other user errors
(wrong type, missing config file, a config file that raises) into one line.
`run_main` does the same for a `streamrl.errors.UserError` raised by the
script's main: `error: <sentence>` on stderr, exit status 2, no traceback
(unless --debug or STREAMRL_DEBUG=1). It also answers `--help` and turns on
XLA's compile cache (`use_compile_cache`) before JAX is imported.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, NoReturn, Sequence

from absl import app, flags
from ml_collections.config_flags import config_flags

from streamrl.config import renames
from streamrl.config.files import find_config_file
from streamrl.config.overrides import apply_overrides, field_type, locate, renamed
from streamrl.errors import RunStopped, UserError, debug_requested, user_message

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
      parent, leaf = locate(config, key)
      is_bool = field_type(parent, leaf) is bool
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
  (streamrl/config/renames.py), where the config file has only the new one."""
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
      cli.run_main(main)

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
