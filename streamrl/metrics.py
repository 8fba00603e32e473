"""Experiment logging: TensorBoard events (no TensorFlow), JSON lines, config, progress.

  writer = MetricsWriter(f"{workdir}/tb", purge_step=resumed_step + 1)
  writer.scalars(step, {"reward/mean": 0.4, **percentiles(lengths, prefix="response_length/")})
  writer.histogram(step, "response_length", lengths)
  writer.text(step, "sample", decoded)
  save_config(config, f"{workdir}/tb")
  bar = Progress(total=config.num_iterations, desc="ppo", initial=resumed_step)
  bar.update(reward=0.41, acc=0.3)

Scalars also go to `<logdir>/metrics.jsonl`, one line per `scalars` call:
{"step": 3, "wall_time": 1.7e9, "reward/mean": 0.4, ...}; non-finite values
are written as null (strict JSON, readable by jq and pandas alike). With
`MetricsWriter(..., log=s.log, run_config=config_dict)` and a
`log.wandb_project`, scalars and histograms go to a Weights & Biases run in
`<logdir>/wandb/` as well (offline unless `log.wandb_mode=online`).

The console shows the progress bar and StreamRL's own log lines only:

  configure_logging(workdir)          # in a launch script, once the workdir is known
  configure_actor_logging(workdir)    # first thing in a Ray actor

Everything other libraries log (vLLM, Ray, Orbax through absl, JAX, ...) and
the Python warnings they raise go to `<workdir>/libraries.log` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import math
import os
import sys
import time
import warnings
from typing import Any, Iterator, Mapping, Sequence, TextIO

import numpy as np

from streamrl.errors import UserError

JSONL_NAME = "metrics.jsonl"


WANDB_MODES = ("offline", "online", "disabled")


@dataclasses.dataclass(frozen=True)
class Log:
  """What a run logs (`log.*`): held-out evaluation every `eval_every`
  iterations (0: never), and the progress bar.

  wandb_project: when set, every scalar (and histogram) also goes to a
  Weights & Biases run of this project, kept in <workdir>/wandb/, with the
  run's config; empty (the default): wandb is never imported. wandb_mode:
  "offline" (the default: nothing leaves the machine; `wandb sync
  <workdir>/wandb/offline-run-*` uploads it later), "online", or "disabled".
  """

  eval_every: int = 25
  progress: bool = True
  wandb_project: str = ""
  wandb_mode: str = "offline"

  def check(self) -> None:
    if self.eval_every < 0:
      raise UserError(
          f"log.eval_every={self.eval_every!r} must be >= 0; fix --config.log.eval_every."
      )
    if self.wandb_mode not in WANDB_MODES:
      raise UserError(f"log.wandb_mode={self.wandb_mode!r} is unknown; use one of {WANDB_MODES}.")
    if self.wandb_project and importlib.util.find_spec("wandb") is None:
      raise UserError(
          f"log.wandb_project={self.wandb_project!r} needs the wandb package; install it "
          "(pip install -e '.[wandb]') or leave log.wandb_project empty."
      )


def _scalar(name: str, value: Any) -> float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {name!r} has shape {arr.shape}; log a scalar (or use histogram()).")
  return float(arr.reshape(()))


# ------------------------------------------------------------------- logging

LIBRARY_LOG_NAME = "libraries.log"
# Loggers whose lines belong on the console; their children ("streamrl.x") too.
OWN_LOGGERS = ("streamrl", "__main__")
_CONSOLE_FORMAT = "%(asctime)s %(levelname)s %(message)s"
_FILE_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
_MARK = "_streamrl_handler"  # Set on the handlers installed here, so a reconfigure can find them.
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
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


class MetricsWriter:
  """TensorBoard event files (via tensorboardX) plus `metrics.jsonl` in `logdir`,
  and a Weights & Biases run when `log.wandb_project` is set.

  Args:
    logdir: created if missing.
    purge_step: when resuming at step k, pass k (the first step that will be
      logged again): TensorBoard then hides events with step >= k from the
      earlier, interrupted run, and metrics.jsonl drops its lines with
      step >= k — so curves have no doubled segments.
    enabled: False makes every call a no-op (non-zero processes of a
      multi-host job).
    log: the run's `log.*` settings; with a `wandb_project`, scalars and
      histograms also go to a W&B run in `<logdir>/wandb/` (a resumed run
      starts a new W&B run, in the same group, named after the workdir).
    run_config: the run's config as a plain dict, the W&B run's config.
  """

  def __init__(
      self,
      logdir: str,
      *,
      purge_step: int | None = None,
      enabled: bool = True,
      log: Log | None = None,
      run_config: Mapping[str, Any] | None = None,
  ):
    self.logdir = os.fspath(logdir)
    self.enabled = enabled
    self._writer = None
    self._jsonl: TextIO | None = None
    self._wandb = None
    if not enabled:
      return
    from tensorboardX import SummaryWriter  # Imported late: only loggers pay for it.

    os.makedirs(self.logdir, exist_ok=True)
    jsonl_path = os.path.join(self.logdir, JSONL_NAME)
    if purge_step is not None and os.path.exists(jsonl_path):
      _truncate_jsonl(jsonl_path, int(purge_step))
    # tensorboardX names files by the second: a restart within the same second
    # would reopen (and truncate) the previous file. The ns suffix keeps names
    # unique and in write order, which TensorBoard's reader relies on.
    self._writer = SummaryWriter(
        self.logdir, purge_step=purge_step, flush_secs=30, filename_suffix=f".{time.time_ns():020d}"
    )
    self._jsonl = open(jsonl_path, "a", encoding="utf-8")
    if log is not None and log.wandb_project:
      self._wandb = _start_wandb(log, self.logdir, run_config)

  def scalars(self, step: int, values: Mapping[str, Any]) -> None:
    """Logs each value (python/numpy/jax scalar) under its name ("group/name" groups in TensorBoard)."""
    if not self.enabled:
      return
    step = int(step)
    floats = {str(k): _scalar(k, v) for k, v in values.items()}
    for name, value in floats.items():
      self._writer.add_scalar(name, value, step)
    row = {"step": step, "wall_time": time.time()}
    row.update({k: (v if math.isfinite(v) else None) for k, v in floats.items()})
    self._jsonl.write(json.dumps(row) + "\n")
    if self._wandb is not None:
      self._wandb.log(floats, step=step)

  def histogram(self, step: int, name: str, values: Sequence[float] | np.ndarray) -> None:
    """A distribution (e.g. response lengths) at `step`; empty inputs are skipped."""
    if not self.enabled:
      return
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size:
      self._writer.add_histogram(name, arr, int(step))
      if self._wandb is not None:
        import wandb  # pylint: disable=g-import-not-at-top

        self._wandb.log({name: wandb.Histogram(arr)}, step=int(step))

  def text(self, step: int, name: str, text: str) -> None:
    """Free text (markdown) in TensorBoard's Text tab, e.g. a decoded sample."""
    if self.enabled:
      self._writer.add_text(name, str(text), int(step))

  def flush(self) -> None:
    if self.enabled:
      self._writer.flush()
      self._jsonl.flush()

  def close(self) -> None:
    if self.enabled and self._writer is not None:
      self._writer.close()
      self._jsonl.close()
      self._writer = None
      self.enabled = False
      if self._wandb is not None:
        self._wandb.finish()
        self._wandb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _start_wandb(log: Log, logdir: str, run_config: Mapping[str, Any] | None):
  """A W&B run of `log.wandb_project` kept in `<logdir>/wandb/`."""
  import wandb  # pylint: disable=g-import-not-at-top  # Only runs that ask for it pay for it.

  name = os.path.basename(os.path.abspath(logdir))
  run = wandb.init(
      project=log.wandb_project,
      mode=log.wandb_mode,
      dir=logdir,
      name=name,
      group=name,
      config=dict(run_config or {}),
      # Quiet on the console (this module says where the run is); the
      # terminal's output, the machine's stats, code and git state stay out.
      settings=wandb.Settings(
          silent=True, console="off", x_disable_stats=True, save_code=False, disable_git=True
      ),
  )
  if log.wandb_mode == "offline":
    run_dir = os.path.dirname(run.dir)  # run.dir is its files/ folder.
    logging.getLogger(__name__).info("Offline W&B run: `wandb sync %s` uploads it.", run_dir)
  return run


def _truncate_jsonl(path: str, purge_step: int) -> None:
  """Keeps the lines of `path` with step < purge_step (atomically)."""
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    try:
      if int(json.loads(line)["step"]) >= purge_step:
        continue
    except (ValueError, KeyError, TypeError):
      pass  # A torn last line from a crash: keep it, it is harmless to readers that skip bad lines.
    kept.append(line if line.endswith("\n") else line + "\n")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.writelines(kept)
  os.replace(tmp, path)


def save_config(config: Any, logdir: str) -> str:
  """Writes the resolved config to `logdir/config.json` (+ readable `config.txt`); returns the json path.

  `config` is an ml_collections ConfigDict (or a plain dict). Values JSON
  cannot hold (e.g. a callable) are written as their repr, so this never fails
  on an exotic config.
  """
  os.makedirs(logdir, exist_ok=True)
  if hasattr(config, "to_json_best_effort"):
    text_json = config.to_json_best_effort(indent=2, sort_keys=True)
  else:
    text_json = json.dumps(config, indent=2, sort_keys=True, default=repr)
  path = os.path.join(logdir, "config.json")
  with open(path, "w", encoding="utf-8") as f:
    f.write(text_json + "\n")
  with open(os.path.join(logdir, "config.txt"), "w", encoding="utf-8") as f:
    f.write(str(config))
  return path


def percentiles(values: Sequence[float] | np.ndarray, prefix: str = "") -> dict[str, float]:
  """{prefix+"mean", "p50", "p90", "max"} of `values` (e.g. response lengths, [N]).

  Percentiles interpolate linearly (numpy's default). An empty input gives NaN
  for every key rather than an error: an iteration with no finished samples
  should still log.
  """
  arr = np.asarray(values, dtype=np.float64).reshape(-1)
  if arr.size == 0:
    return {f"{prefix}{k}": float("nan") for k in ("mean", "p50", "p90", "max")}
  p50, p90 = np.percentile(arr, [50, 90])
  return {
      f"{prefix}mean": float(arr.mean()),
      f"{prefix}p50": float(p50),
      f"{prefix}p90": float(p90),
      f"{prefix}max": float(arr.max()),
  }


def _fmt_duration(seconds: float) -> str:
  seconds = int(max(0, round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}"


def _fmt_postfix(postfix: Mapping[str, Any]) -> str:
  parts = []
  for k, v in postfix.items():
    try:
      parts.append(f"{k}={_scalar(k, v):.4g}")
    except (TypeError, ValueError):
      parts.append(f"{k}={v}")
  return " ".join(parts)


class Progress:
  """A console progress bar with ETA: tqdm on a terminal, one plain line per update otherwise.

  Args:
    total: number of units (iterations) of the whole run.
    desc: label in front of the bar.
    initial: units already done (a resumed run); the ETA counts only the
      rate measured in this process.
    file: where to write (default stderr).
    min_interval_s: in plain-line mode, at most one line per this many
      seconds (the last update always prints).
  """

  def __init__(
      self,
      total: int,
      desc: str = "",
      *,
      initial: int = 0,
      file: TextIO | None = None,
      min_interval_s: float = 0.0,
  ):
    self.total = int(total)
    self.desc = desc
    self.n = int(initial)
    self._initial = int(initial)
    self._file = file if file is not None else sys.stderr
    self._min_interval_s = float(min_interval_s)
    self._start = time.monotonic()
    self._last_print = -math.inf
    self._bar = None
    adopt_library_loggers()  # Libraries imported since configure_logging (e.g. vLLM's transformers).
    isatty = getattr(self._file, "isatty", None)
    if isatty is not None and isatty():
      try:
        from tqdm import tqdm
      except ImportError:
        tqdm = None
      if tqdm is not None:
        self._bar = tqdm(
            total=self.total, desc=desc, initial=self.n, file=self._file, dynamic_ncols=True
        )

  def update(self, n: int = 1, **postfix: Any) -> None:
    """Advances by `n` units and shows `postfix` (e.g. reward=0.41) next to the bar."""
    self.n += int(n)
    adopt_library_loggers()
    if self._bar is not None:
      if postfix:
        self._bar.set_postfix_str(_fmt_postfix(postfix), refresh=False)
      self._bar.update(int(n))
      return
    now = time.monotonic()
    if now - self._last_print < self._min_interval_s and self.n < self.total:
      return
    self._last_print = now
    self._file.write(self.line(postfix) + "\n")
    self._file.flush()

  def line(self, postfix: Mapping[str, Any] | None = None) -> str:
    """The plain-text status: 'desc 3/10 (30%) elapsed 0:00:12 eta 0:00:28 | reward=0.41'."""
    elapsed = time.monotonic() - self._start
    done = self.n - self._initial
    pct = 100.0 * self.n / self.total if self.total else 100.0
    eta = _fmt_duration(elapsed / done * (self.total - self.n)) if done > 0 else "?"
    text = (
        f"{self.desc + ' ' if self.desc else ''}{self.n}/{self.total} ({pct:.0f}%) "
        f"elapsed {_fmt_duration(elapsed)} eta {eta}"
    )
    if postfix:
      text += " | " + _fmt_postfix(postfix)
    return text

  def write(self, message: str) -> None:
    """Prints a message without breaking the bar."""
    if self._bar is not None:
      self._bar.write(message, file=self._file)
    else:
      self._file.write(message + "\n")
      self._file.flush()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self) -> "Progress":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


# ------------------------------------------------------------- run summaries

FINAL_METRICS_NAME = "final_metrics.json"  # Written into the run directory by streamrl.train.run.
SUMMARY_METRICS = ("eval/accuracy", "eval/accuracy_greedy", "reward/mean")


def read_final_metrics(run_dir: str) -> dict[str, float] | None:
  """The `final_metrics.json` of a finished run, or None if it is missing or unreadable."""
  try:
    with open(os.path.join(run_dir, FINAL_METRICS_NAME), encoding="utf-8") as f:
      values = json.load(f)
  except (OSError, ValueError):
    return None
  return values if isinstance(values, dict) else None


def _metric(values: Mapping[str, Any] | None, key: str) -> float | None:
  """values[key] as a finite float, else None (missing, null, NaN or not a number)."""
  if not values or key not in values:
    return None
  try:
    x = _scalar(key, values[key])
  except (TypeError, ValueError):
    return None
  return x if math.isfinite(x) else None


def results_table(
    runs: Sequence[tuple[str, Mapping[str, Any] | None]],
    columns: Sequence[str] = SUMMARY_METRICS,
    sort_by: str | None = None,
) -> str:
  """A plain-text table of runs and their final metrics, best first.

    rank  run                       eval/accuracy  eval/accuracy_greedy  reward/mean
       1  optimizer.lr=3e-06                 0.5312                0.5625       0.4410
       2  optimizer.lr=1e-06                 0.4219                     -       0.3902
       -  optimizer.lr=1e-05 (failed)             -                     -            -

  Args:
    runs: (run name, final metrics) pairs; metrics None for a run that left
      none (it failed, or was never run).
    columns: the metric keys to show, in order.
    sort_by: the key ranking the runs, higher is better; default the first
      column. Runs without a finite value for it come last, unranked, in
      their given order; ties keep the given order.

  Returns:
    The table, lines joined by newlines (no trailing newline).
  """
  columns = list(columns)
  key = sort_by or (columns[0] if columns else None)
  indexed = list(enumerate(runs))
  ranked = [(i, r) for i, r in indexed if key is not None and _metric(r[1], key) is not None]
  unranked = [(i, r) for i, r in indexed if key is None or _metric(r[1], key) is None]
  ranked.sort(key=lambda ir: (-_metric(ir[1][1], key), ir[0]))
  header = ["rank", "run", *columns]
  body = []
  for pos, (_, (name, values)) in enumerate(ranked + unranked, start=1):
    cells = [str(pos) if pos <= len(ranked) else "-", str(name)]
    for col in columns:
      x = _metric(values, col)
      cells.append("-" if x is None else f"{x:.4f}")
    body.append(cells)
  widths = [max(len(row[j]) for row in [header, *body]) for j in range(len(header))]

  def fmt(row):  # Names left-aligned, numbers right-aligned.
    return "  ".join(
        c.ljust(w) if j == 1 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
    ).rstrip()

  return "\n".join(fmt(row) for row in [header, *body])
