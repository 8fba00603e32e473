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
are written as null (strict JSON, readable by jq and pandas alike).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any, Mapping, Sequence, TextIO

import numpy as np

JSONL_NAME = "metrics.jsonl"


def _scalar(name: str, value: Any) -> float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {name!r} has shape {arr.shape}; log a scalar (or use histogram()).")
  return float(arr.reshape(()))


def configure_logging(level: int = logging.INFO) -> None:
  """StreamRL's own log lines at `level`; other libraries' (e.g. Orbax's
  per-save chatter) only from WARNING up."""
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s",
                      force=True)
  logging.getLogger("streamrl").setLevel(level)


class MetricsWriter:
  """TensorBoard event files (via tensorboardX) plus `metrics.jsonl` in `logdir`.

  Args:
    logdir: created if missing.
    purge_step: when resuming at step k, pass k (the first step that will be
      logged again): TensorBoard then hides events with step >= k from the
      earlier, interrupted run, and metrics.jsonl drops its lines with
      step >= k — so curves have no doubled segments.
    enabled: False makes every call a no-op (non-zero processes of a
      multi-host job).
  """

  def __init__(self, logdir: str, *, purge_step: int | None = None, enabled: bool = True):
    self.logdir = os.fspath(logdir)
    self.enabled = enabled
    self._writer = None
    self._jsonl: TextIO | None = None
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
    self._writer = SummaryWriter(self.logdir, purge_step=purge_step, flush_secs=30,
                                 filename_suffix=f".{time.time_ns():020d}")
    self._jsonl = open(jsonl_path, "a", encoding="utf-8")

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

  def histogram(self, step: int, name: str, values: Sequence[float] | np.ndarray) -> None:
    """A distribution (e.g. response lengths) at `step`; empty inputs are skipped."""
    if not self.enabled:
      return
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size:
      self._writer.add_histogram(name, arr, int(step))

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

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


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
  return {f"{prefix}mean": float(arr.mean()), f"{prefix}p50": float(p50), f"{prefix}p90": float(p90),
          f"{prefix}max": float(arr.max())}


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

  def __init__(self, total: int, desc: str = "", *, initial: int = 0, file: TextIO | None = None,
               min_interval_s: float = 0.0):
    self.total = int(total)
    self.desc = desc
    self.n = int(initial)
    self._initial = int(initial)
    self._file = file if file is not None else sys.stderr
    self._min_interval_s = float(min_interval_s)
    self._start = time.monotonic()
    self._last_print = -math.inf
    self._bar = None
    isatty = getattr(self._file, "isatty", None)
    if isatty is not None and isatty():
      try:
        from tqdm import tqdm
      except ImportError:
        tqdm = None
      if tqdm is not None:
        self._bar = tqdm(total=self.total, desc=desc, initial=self.n, file=self._file, dynamic_ncols=True)

  def update(self, n: int = 1, **postfix: Any) -> None:
    """Advances by `n` units and shows `postfix` (e.g. reward=0.41) next to the bar."""
    self.n += int(n)
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
    text = f"{self.desc + ' ' if self.desc else ''}{self.n}/{self.total} ({pct:.0f}%) " \
           f"elapsed {_fmt_duration(elapsed)} eta {eta}"
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
