"""Metrics of a run: TensorBoard events (no TensorFlow), JSON lines, its config, W&B.

  writer = MetricsWriter(f"{workdir}/tb", purge_step=resumed_step + 1)
  writer.scalars(step, {"reward/mean": 0.4, **percentiles(lengths, prefix="response_length/")})
  writer.histogram(step, "response_length", lengths)
  writer.text(step, "sample", decoded)
  save_config(config, f"{workdir}/tb")

Scalars also go to `<logdir>/metrics.jsonl`, one line per `scalars` call:
{"step": 3, "wall_time": 1.7e9, "reward/mean": 0.4, ...}; non-finite values
are written as null (strict JSON, readable by jq and pandas alike). With
`MetricsWriter(..., log=s.log, run_config=config_dict)` and a
`log.wandb_project`, scalars and histograms go to a Weights & Biases run in
`<logdir>/wandb/` as well (offline unless `log.wandb_mode=online`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Mapping, Sequence, TextIO

import numpy as np

from streamrl.metrics.config import Log

JSONL_NAME = "metrics.jsonl"


def scalar(name: str, value: Any) -> float:
  """`value` (a python, numpy or jax scalar) as a float; ValueError for an array."""
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric {name!r} has shape {arr.shape}; log a scalar (or use histogram()).")
  return float(arr.reshape(()))


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
    floats = {str(k): scalar(k, v) for k, v in values.items()}
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
