"""LPT (longest processing time first) scheduling inside one generator instance.

With continuous batching an instance runs at most BS sequences at once and
starts a new one whenever one finishes. Starting the longest-predicted prompts
first means the long ones overlap with many short ones instead of starting
last and running alone at the end (the skewness bubble).
"""

from __future__ import annotations

import collections
from typing import Hashable, Iterable, Sequence

import numpy as np


def lpt_order(predicted_lengths: Sequence[float]) -> list[int]:
  """Indices of `predicted_lengths` sorted longest first.

  Stable: equal predictions keep their original relative order, so with no
  information (all equal) LPT degenerates to FIFO.

  Args:
    predicted_lengths: [P] predicted output lengths (or any monotone score).
  Returns:
    [P] permutation of range(P).
  """
  lengths = np.asarray(predicted_lengths, dtype=np.float64).reshape(-1)
  if np.isnan(lengths).any():
    raise ValueError("predicted lengths contain NaN; check the ranker's output before scheduling.")
  return np.argsort(-lengths, kind="stable").tolist()


class AdmissionQueue:
  """Admits requests in a fixed order with at most `max_in_flight` running.

  Usage (simulator or generator loop):
    q = AdmissionQueue(lpt_order(pred), max_in_flight=bs)
    start(q.admit())
    on every finish: q.finish(i); start(q.admit())
  """

  def __init__(self, order: Iterable[Hashable], max_in_flight: int):
    if max_in_flight < 1:
      raise ValueError(
          f"max_in_flight must be >= 1, got {max_in_flight}; " "pass the instance's batch size."
      )
    self._pending = collections.deque(order)
    if len(set(self._pending)) != len(self._pending):
      raise ValueError("admission order contains duplicate ids; each request must appear once.")
    self._max_in_flight = int(max_in_flight)
    self._in_flight: set = set()
    self._finished: list = []

  @property
  def max_in_flight(self) -> int:
    return self._max_in_flight

  @property
  def in_flight(self) -> frozenset:
    return frozenset(self._in_flight)

  @property
  def num_pending(self) -> int:
    return len(self._pending)

  @property
  def finished(self) -> tuple:
    return tuple(self._finished)

  @property
  def done(self) -> bool:
    return not self._pending and not self._in_flight

  def admit(self) -> list:
    """Ids to start now, in admission order; fills free slots up to the cap."""
    started = []
    while self._pending and len(self._in_flight) < self._max_in_flight:
      i = self._pending.popleft()
      self._in_flight.add(i)
      started.append(i)
    return started

  def finish(self, request_id: Hashable) -> None:
    """Marks a running request as finished, freeing its slot."""
    if request_id not in self._in_flight:
      raise ValueError(
          f"request {request_id!r} is not in flight; only admitted, unfinished "
          "requests can finish."
      )
    self._in_flight.remove(request_id)
    self._finished.append(request_id)
