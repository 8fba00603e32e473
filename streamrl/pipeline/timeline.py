"""Busy intervals of each stage, and the bubbles between them.

Every stage (each generator instance, the trainer) records when it was
working; a stage's bubble fraction over a window is the share of the window
it was idle. Saved as JSON so experiments can draw the pipeline picture.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Timeline:

  def __init__(self):
    self._lock = threading.Lock()
    self.intervals: list[tuple[str, float, float, str]] = []  # stage, start, end, label
    self._copied = 0  # generator intervals already copied from the rollout

  def copy_generator_intervals(self, busy_intervals) -> None:
    """Adds a rollout's new (instance, start, end, n) stream segments as
    stages generator0, generator1, ..."""
    for i, start, end, _ in busy_intervals[self._copied :]:
      self.add(f"generator{i}", start, end)
    self._copied = len(busy_intervals)

  def add(self, stage: str, start: float, end: float, label: str = "") -> None:
    if end > start:
      with self._lock:
        self.intervals.append((stage, start, end, label))

  @contextmanager
  def busy(self, stage: str, label: str = "") -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.add(stage, start, time.perf_counter(), label)

  def busy_seconds(self, stage: str, t0: float, t1: float) -> float:
    """Union of the stage's intervals clipped to [t0, t1] (overlaps count once)."""
    spans = sorted(
        (max(s, t0), min(e, t1))
        for st, s, e, _ in self.intervals
        if st == stage and e > t0 and s < t1
    )
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
      if cur_e is None or s > cur_e:
        if cur_e is not None:
          total += cur_e - cur_s
        cur_s, cur_e = s, e
      else:
        cur_e = max(cur_e, e)
    if cur_e is not None:
      total += cur_e - cur_s
    return total

  def stages(self) -> list[str]:
    return sorted({st for st, *_ in self.intervals})

  def bubble_fractions(self, t0: float, t1: float) -> dict[str, float]:
    """{stage: idle share of [t0, t1]} for every stage seen so far."""
    span = max(t1 - t0, 1e-9)
    return {st: 1.0 - self.busy_seconds(st, t0, t1) / span for st in self.stages()}

  def to_json(self, path: str, origin: float | None = None) -> None:
    origin = min((s for _, s, _, _ in self.intervals), default=0.0) if origin is None else origin
    with open(path, "w") as f:
      json.dump(
          [
              {"stage": st, "start": s - origin, "end": e - origin, "label": lb}
              for st, s, e, lb in self.intervals
          ],
          f,
      )
