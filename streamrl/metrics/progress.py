"""A console progress bar with ETA: tqdm on a terminal, one plain line per update otherwise.

bar = Progress(total=config.num_iterations, desc="ppo", initial=resumed_step)
bar.update(reward=0.41, acc=0.3)
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Mapping, TextIO

from streamrl.metrics.logs import adopt_library_loggers
from streamrl.metrics.writer import scalar


def _fmt_duration(seconds: float) -> str:
  seconds = int(max(0, round(seconds)))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}"


def _fmt_postfix(postfix: Mapping[str, Any]) -> str:
  parts = []
  for k, v in postfix.items():
    try:
      parts.append(f"{k}={scalar(k, v):.4g}")
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
