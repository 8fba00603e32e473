"""The console shows StreamRL's own log lines; every other library's go to a file.

  configure_logging(workdir)          # in a launch script, once the workdir is known
  configure_actor_logging(workdir)    # first thing in a Ray actor

Everything other libraries log (vLLM, Ray, Orbax through absl, JAX, ...) and
the Python warnings they raise go to `<workdir>/libraries.log` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Iterator, TextIO

LIBRARY_LOG_NAME = "libraries.log"
# Loggers whose lines belong on the console; their children ("streamrl.x") too.
OWN_LOGGERS = ("streamrl", "__main__")
_CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_FILE_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
_MARK = "_streamrl_handler"  # Set on the handlers installed here, so a reconfigure can find them.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN_DIRS = (_PACKAGE_DIR + os.sep, os.path.join(os.path.dirname(_PACKAGE_DIR), "launch") + os.sep)
_configured = False
_original_showwarning = None
_library_log: str | None = None  # set by configure_logging


class _StderrHandler(logging.StreamHandler):
  """A StreamHandler on whatever `sys.stderr` is at emit time (redirects, test capture)."""

  def __init__(self):
    super().__init__(sys.stderr)

  @property
  def stream(self):  # pylint: disable=invalid-overridden-method
    return sys.stderr

  @stream.setter
  def stream(self, value):
    del value


def _is_own(name: str) -> bool:
  return any(name == own or name.startswith(own + ".") for own in OWN_LOGGERS)


def _mark(handler: logging.Handler, fmt: str, level: int = logging.NOTSET) -> logging.Handler:
  setattr(handler, _MARK, True)
  handler.setFormatter(logging.Formatter(fmt))
  handler.setLevel(level)
  return handler


def _drop_handlers(logger: logging.Logger, *, only_ours: bool) -> None:
  for handler in list(logger.handlers):
    ours = getattr(handler, _MARK, False)
    if ours or not only_ours:
      logger.removeHandler(handler)
    if ours:
      handler.close()


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
  """warnings.showwarning: our modules' warnings to our console logger, the rest to the file."""
  if file is not None:  # An explicit target (warnings.showwarning(..., file=f)): honour it.
    _original_showwarning(message, category, filename, lineno, file, line)
    return
  text = warnings.formatwarning(message, category, filename, lineno, line).rstrip()
  ours = os.path.abspath(str(filename)).startswith(_OWN_DIRS)
  logging.getLogger("streamrl.warnings" if ours else "py.warnings").warning("%s", text)


def configure_logging(
    workdir: str | os.PathLike | None = None,
    level: int = logging.INFO,
    *,
    console: TextIO | None = None,
) -> str | None:
  """Sends StreamRL's log lines to the console and every other library's to a file.

  With a `workdir`:
  - loggers "streamrl" (and its children) and "__main__" write to the console
    from `level` up, and to `<workdir>/libraries.log` as well (for context);
  - every other logger (vllm, ray, orbax/absl, jax, ...) writes from INFO up
    to `<workdir>/libraries.log` only, as do Python warnings raised outside
    StreamRL's own code (ours go to the console as "streamrl.warnings").
  Without one (or with a remote "gs://..." path, which a log file cannot
  use), other libraries print only from WARNING up, on the console.

  Libraries that attach their own console handlers (Ray, vLLM, transformers)
  are re-routed here and again whenever `adopt_library_loggers` runs (init_ray
  and the progress bar call it); vLLM is also told not to install one
  (VLLM_CONFIGURE_LOGGING=0, unless set) in this process and those it starts.
  Calling this again (e.g. for each run of a sweep) replaces the previous
  setup and closes its file.

  Args:
    workdir: the run directory; created if missing.
    level: the lowest level of our own lines on the console.
    console: where our lines go; default whatever sys.stderr is at the time
      of each line.

  Returns:
    The path of the library log, or None when there is none.

  Raises:
    streamrl.errors.UserError: `workdir` is a file or cannot be created.
  """
  global _configured, _original_showwarning
  from streamrl import errors  # pylint: disable=g-import-not-at-top

  os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
  log_path = None
  if workdir is not None and "://" not in os.fspath(workdir):
    workdir = errors.check_workdir(os.fspath(workdir))
    try:
      os.makedirs(workdir, exist_ok=True)
    except OSError as e:
      raise errors.UserError(
          f"cannot create the run directory {workdir} ({e.strerror}); pass another " "--workdir."
      ) from e
    log_path = os.path.join(workdir, LIBRARY_LOG_NAME)

  def console_handler(level_: int = logging.NOTSET) -> logging.Handler:
    handler = _StderrHandler() if console is None else logging.StreamHandler(console)
    return _mark(handler, _CONSOLE_FORMAT, level_)

  root = logging.getLogger()
  _drop_handlers(root, only_ours=False)  # Also absl's handler, installed by app.run.
  ours = [console_handler()]
  if log_path is not None:
    file_handler = _mark(logging.FileHandler(log_path, mode="a", encoding="utf-8"), _FILE_FORMAT)
    root.addHandler(file_handler)
    root.setLevel(logging.INFO)
    ours.append(file_handler)
  else:
    # A handler level, not just the root's: loggers with their own level
    # (absl's follows --verbosity, INFO by default) would pass INFO lines on.
    root.addHandler(console_handler(logging.WARNING))
    root.setLevel(logging.WARNING)
  for name in OWN_LOGGERS:
    logger = logging.getLogger(name)
    _drop_handlers(logger, only_ours=True)
    logger.setLevel(level)
    logger.propagate = False
    for handler in ours:
      logger.addHandler(handler)
  if _original_showwarning is None:
    _original_showwarning = warnings.showwarning
  warnings.showwarning = _show_warning
  _configured = True
  global _library_log
  _library_log = log_path
  adopt_library_loggers()
  return log_path


def point_output_at(path: str) -> None:
  """Points this process's file descriptors 1 and 2 (Python's and C's
  stdout/stderr, and what processes started later inherit) at `path`."""
  sys.stdout.flush()
  sys.stderr.flush()
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
  os.dup2(fd, 1)
  os.dup2(fd, 2)
  os.close(fd)


@contextlib.contextmanager
def output_to_library_log() -> Iterator[None]:
  """Sends this process's raw stdout/stderr (C++ warnings, tqdm bars, and the
  inherited output of any process started meanwhile, e.g. vLLM's engine
  core) to the library log while the block runs; a no-op without one."""
  if _library_log is None:
    yield
    return
  saved = os.dup(1), os.dup(2)
  try:
    point_output_at(_library_log)
    yield
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for f in saved:
      os.close(f)


def configure_actor_logging(
    workdir: str | os.PathLike | None, level: int = logging.INFO
) -> str | None:
  """`configure_logging` for a Ray actor (or any worker process), called first thing in it.

  Call it before the actor imports vLLM. The library log is the same
  `<workdir>/libraries.log` as the driver's (lines carry their process id).
  Our own lines go to the actor's stderr: with `log_to_driver=False` (see
  `streamrl.cluster.init_ray`) that is Ray's worker log in the session
  directory, /tmp/ray/session_latest/logs/worker-*.err (the trainer actor
  redirects its stderr to <workdir>/trainer.log, which the launcher copies
  to the console). Errors still reach the launcher as exceptions.

  When the workdir cannot be written on this node (e.g. a remote node
  without the shared filesystem), library warnings go to the actor's stderr
  instead, and one warning says so.

  Args:
    workdir: the run directory, or None for no library log.
    level: the lowest level of our own lines.

  Returns:
    The library log's path, or None.
  """
  os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
  try:
    return configure_logging(workdir, level)
  except (ValueError, OSError) as e:  # UserError is a ValueError.
    configure_logging(None, level)
    logging.getLogger(__name__).warning(
        "No library log on this node (%s); other libraries' warnings go to "
        "this process's stderr.",
        e,
    )
    return None


def adopt_library_loggers() -> list[str]:
  """Re-routes library loggers that print to the console by themselves.

  Ray, vLLM and transformers attach a console handler to their top logger
  and stop propagation, which would bypass `configure_logging`; this removes
  such handlers (any non-file StreamHandler, and Ray's own handler) from
  every logger outside StreamRL's and lets those loggers propagate to the
  root, i.e. into the library log. Cheap enough to call often; does nothing
  before `configure_logging` has run in this process.

  Returns:
    The names of the loggers changed.
  """
  if not _configured:
    return []
  changed = []
  for name, logger in list(logging.root.manager.loggerDict.items()):
    if not isinstance(logger, logging.Logger) or _is_own(name):
      continue
    console = [
        h
        for h in logger.handlers
        if not getattr(h, _MARK, False)
        and not isinstance(h, logging.FileHandler)
        and (isinstance(h, logging.StreamHandler) or type(h).__name__ == "PlainRayHandler")
    ]
    if not console:
      continue
    for handler in console:
      logger.removeHandler(handler)
    logger.propagate = True
    changed.append(name)
  return changed
