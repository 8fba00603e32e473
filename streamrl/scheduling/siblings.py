"""Group-aware length prediction inside one generator instance.

GRPO samples every prompt `group_size` times, and the responses of one prompt
have related lengths. The ranker only sees the prompt; once one response of
a group has finished, its length says more about its siblings than the
ranker can. `SiblingQueue` holds an instance's requests not yet admitted and
always hands out the one with the longest current estimate (LPT), where a
request's estimate is

    max(mean of [prior weighted `prior_weight`] + [its finished siblings' lengths],
        the most tokens a still-running sibling has so far)

The prior is the dispatcher's calibrated length for the prompt (the recent
length distribution at the ranker's rank: `dispatch.calibrated_lengths`); a
running sibling's tokens are a lower bound on its own length, so a group
whose first response is still going after many tokens is moved forward.

To learn anything before admitting a whole group, admission probes: every
group's first request is admitted before any group's second (in prior
order), then the rest go longest-estimate first. The dispatcher keeps a
group on one instance (`dispatch(..., groups=...)`) so that the siblings an
instance learns from are its own.

A resumed partial response (`LengthHint.done` tokens already generated)
counts its earlier tokens in the lengths its group observes, and is ordered
by what it has left to generate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence


@dataclasses.dataclass(frozen=True)
class LengthHint:
  """What the dispatcher knows of a request's length, sent with the request.

  group: requests with equal groups are samples of one prompt.
  prior: the estimated response length (tokens) before any sibling finished.
  done: tokens the response already has (a resumed partial response).
  """

  group: Hashable
  prior: float
  done: int = 0


def group_estimate(
    prior: float, finished: Sequence[float], running_max: float = 0.0, prior_weight: float = 1.0
) -> float:
  """A group's length estimate: the prior-weighted mean of its finished
  lengths, raised to the longest running sibling's tokens so far."""
  n = len(finished)
  mean = (prior_weight * float(prior) + float(sum(finished))) / (prior_weight + n)
  return max(mean, float(running_max))


class SiblingQueue:
  """Requests not yet admitted on one instance, longest estimate first.

  Items are opaque (the engine's pending requests); `hints[i]` is item i's
  `LengthHint`. The engine's generate loop admits from it and reports to it.
  """

  def __init__(
      self,
      items: Sequence,
      hints: Sequence[LengthHint],
      *,
      prior_weight: float = 1.0,
      probe: bool = True,
  ):
    if len(items) != len(hints):
      raise ValueError(f"{len(items)} requests but {len(hints)} length hints; give one each.")
    if prior_weight <= 0:
      raise ValueError(f"prior_weight must be > 0, got {prior_weight}.")
    self._items = {k: item for k, item in enumerate(items)}
    self._hints = list(hints)
    self._prior_weight = float(prior_weight)
    self._probe = probe
    self._finished: dict[Hashable, list[float]] = {}
    self._running: dict[Hashable, float] = {}
    self._started: set[Hashable] = set()  # groups with an admitted request

  def __len__(self) -> int:
    return len(self._items)

  def __bool__(self) -> bool:
    return bool(self._items)

  def __iter__(self) -> Iterator:
    """The items still pending, in input order (for a stop that returns them)."""
    return iter([self._items[k] for k in sorted(self._items)])

  def clear(self) -> None:
    self._items.clear()

  def _group_length(self, h: LengthHint) -> float:
    return group_estimate(
        h.prior,
        self._finished.get(h.group, ()),
        self._running.get(h.group, 0.0),
        self._prior_weight,
    )

  def estimate(self, k: int) -> float:
    """Item k's estimated remaining length (tokens)."""
    h = self._hints[k]
    return self._group_length(h) - h.done

  def popleft(self):
    """The next request to admit: an unprobed group's first (highest prior
    first), else the longest estimate; ties keep input order."""
    if not self._items:
      raise IndexError("pop from an empty SiblingQueue")
    keys = list(self._items)
    if self._probe:
      unprobed = [k for k in keys if self._hints[k].group not in self._started]
      if unprobed:
        keys = unprobed
    lengths: dict = {}  # group -> its estimate, once per pop

    def remaining(k):
      h = self._hints[k]
      if h.group not in lengths:
        lengths[h.group] = self._group_length(h)
      return lengths[h.group] - h.done

    best = max(keys, key=lambda k: (remaining(k), -k))
    self._started.add(self._hints[best].group)
    return self._items.pop(best)

  def finished(self, hint: LengthHint, new_tokens: int) -> None:
    """A request of `hint.group` finished with `new_tokens` tokens this time."""
    self._finished.setdefault(hint.group, []).append(float(hint.done + new_tokens))

  def running(self, hint: LengthHint, new_tokens: int) -> None:
    """A request of `hint.group` is still running with `new_tokens` so far."""
    total = float(hint.done + new_tokens)
    if total > self._running.get(hint.group, 0.0):
      self._running[hint.group] = total
