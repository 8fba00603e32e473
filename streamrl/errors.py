"""Errors caused by the user's input (a config value, a path, a cluster address).

A `UserError` carries one sentence that names the fix. The launch scripts
(through `streamrl.cli.run_main`) print just that sentence as
`error: <sentence>` and exit with status 2; `--debug` or STREAMRL_DEBUG=1
shows the traceback instead. Anything else is a bug and keeps its traceback.

Two subclasses also keep the built-in type that callers caught before:

  raise MissingFileError(f"{path!r} does not exist; ...")   # also a FileNotFoundError
  raise UnreachableClusterError(f"cannot reach {addr!r}; ...")   # also a ConnectionError

A UserError raised inside a Ray actor reaches the caller of `ray.get` as an
object that is a UserError too, but whose `str()` is Ray's whole remote
traceback; `user_message` digs out the original sentence.
"""

from __future__ import annotations

import os

DEBUG_ENV = "STREAMRL_DEBUG"


class UserError(ValueError):
  """Bad input from the user: the message is one sentence naming the fix."""


class MissingFileError(UserError, FileNotFoundError):
  """A file or directory named by the user does not exist."""


class UnreachableClusterError(UserError, ConnectionError):
  """The cluster address given by the user does not answer as a Ray head."""


class RunStopped(RuntimeError):
  """A process of the run died (or failed) mid-run; the message is one
  sentence naming it, its log, and that rerunning the command resumes."""


def find_user_error(error: BaseException) -> UserError | None:
  """The UserError behind `error`, or None when `error` is not one.

  Ray re-raises an actor's exception as a subclass of both RayTaskError and
  the original type, with the original kept in `.cause`; that original is
  returned so its message is the user's sentence, not Ray's traceback.
  Chained causes (`raise ... from`) are not followed: a bug raised while
  handling a user error is still a bug.
  """
  if not isinstance(error, UserError):
    return None
  cause = getattr(error, "cause", None)
  return cause if isinstance(cause, UserError) else error


def user_message(error: BaseException) -> str:
  """`error`'s sentence on one line (newlines folded into spaces)."""
  found = find_user_error(error)
  text = str(found if found is not None else error).strip()
  return " ".join(text.split()) or type(error).__name__


def debug_requested(argv: list[str] | tuple[str, ...] | None = None) -> bool:
  """True when STREAMRL_DEBUG is set to a true value or argv has --debug.

  Reads argv itself (not absl's FLAGS) so that it also works for errors raised
  before or while flags are parsed.
  """
  if os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
    return True
  on = False
  for arg in argv or ():
    if arg in ("--debug", "-debug", "--debug=true", "--debug=1", "--debug=True"):
      on = True
    elif arg in ("--nodebug", "-nodebug", "--debug=false", "--debug=0", "--debug=False"):
      on = False
    elif arg == "--":
      break
  return on


def check_workdir(path: str, flag: str = "--workdir") -> str:
  """Returns `path` if it can serve as a run directory; UserError otherwise.

  Refused: an empty path, a path that exists but is not a directory, a path
  below a file (a/file/b), and a missing path whose nearest existing parent
  cannot be written. Nothing is created. Remote paths (with "://") are
  passed through unchecked.

  Args:
    path: the directory (it may not exist yet).
    flag: how the user named it, for the message (e.g. "--workdir").
  """
  path = os.fspath(path)
  if not path:
    raise UserError(f"{flag} is empty; pass a directory for the run's logs and checkpoints.")
  if "://" in path:
    return path
  if os.path.exists(path):
    if not os.path.isdir(path):
      raise UserError(
          f"{flag}={path} is a file, not a directory; pass a directory path "
          "(a missing one is created)."
      )
    if not os.access(path, os.W_OK | os.X_OK):
      raise UserError(f"{flag}={path} is not writable; pass a directory you can write to.")
    return path
  parent = nearest_existing(path)
  if not os.path.isdir(parent):
    raise UserError(
        f"{flag}={path} cannot be created because {parent} is a file; pass another "
        "directory path."
    )
  if not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(
        f"{flag}={path} cannot be created in {parent} (not writable); pass a directory "
        "you can write to."
    )
  return path


def nearest_existing(path: str) -> str:
  """`path` itself if it exists, else its nearest existing ancestor."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    up = os.path.dirname(path)
    if up == path:
      break
    path = up
  return path
