"""A request's length predicted from three sources, alone and combined.

- ranker: the length ranker's score of the prompt's tokens, read as a length
  (the recent length distribution at its rank, `dispatch.calibrated_lengths`);
- history: the prompt's own response lengths in earlier epochs, kept per
  prompt id for the run (`LengthHistory`: the newest `per_prompt` lengths of
  at most `max_prompts` prompts, the least recently seen dropped first) and
  saved with its checkpoints;
- siblings: the lengths of its group's samples (the same prompt) that have
  finished this round.

Combined (`combine`): the mean of all the lengths known, the ranker's
estimate counting as `RANKER_WEIGHT` of them,

    (w_r * ranker + sum(history) + sum(siblings)) / (w_r + n_history + n_siblings).

A prompt seen before is thus mostly its own history (a group of 4 seen in
one epoch already outweighs the ranker 4 to 1), an unseen prompt is the
ranker's, and finished siblings move either as they arrive: the same rule
as `siblings.group_estimate`, whose prior is the plan's estimate. A prompt's
lengths drift as the policy learns; keeping only the newest few follows it.

`source_metrics` scores each source on the lengths a round then had: recall
of the longest 20 % and Spearman's rho, over the requests the source had an
estimate for (the history knows only prompts seen before, the siblings only
requests whose group had a finished sample).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np

from streamrl.ranker.metrics import recall_at_top, spearman

SOURCES = ("ranker", "history", "siblings", "combined")
RANKER_WEIGHT = 1.0
# Fewer requests with an estimate than this: the source's metrics are not reported.
MIN_METRIC_REQUESTS = 20


def combine(
    ranker: float,
    history: Sequence[float] = (),
    siblings: Sequence[float] = (),
    ranker_weight: float = RANKER_WEIGHT,
) -> float:
  """The combined length estimate (module docstring): the ranker's estimate
  weighted `ranker_weight`, each length of the prompt's history and of its
  finished siblings weighted 1."""
  total = ranker_weight * float(ranker) + float(sum(history)) + float(sum(siblings))
  return total / (ranker_weight + len(history) + len(siblings))


class LengthHistory:
  """Prompt id -> its newest response lengths, bounded: `per_prompt` lengths
  per prompt, `max_prompts` prompts (the least recently seen dropped first)."""

  def __init__(self, per_prompt: int, max_prompts: int = 1 << 16):
    if per_prompt < 1 or max_prompts < 1:
      raise ValueError(
          f"LengthHistory keeps >= 1 length of >= 1 prompt, got {per_prompt} and {max_prompts}."
      )
    self.per_prompt = int(per_prompt)
    self.max_prompts = int(max_prompts)
    self._lengths: collections.OrderedDict[int, collections.deque] = collections.OrderedDict()
    # An async run's generation thread adds while the trainer's saves a checkpoint.
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return len(self._lengths)

  def __contains__(self, prompt_id: int) -> bool:
    return int(prompt_id) in self._lengths

  def get(self, prompt_id: int) -> tuple[int, ...]:
    """The prompt's lengths, oldest first; () for a prompt not seen."""
    return tuple(self._lengths.get(int(prompt_id), ()))

  def add(self, prompt_id: int, length: int) -> None:
    key = int(prompt_id)
    with self._lock:
      lengths = self._lengths.get(key)
      if lengths is None:
        lengths = self._lengths[key] = collections.deque(maxlen=self.per_prompt)
      self._lengths.move_to_end(key)
      lengths.append(int(length))
      while len(self._lengths) > self.max_prompts:
        self._lengths.popitem(last=False)

  def get_state(self) -> dict:
    """JSON-serialisable contents; `set_state` restores them."""
    with self._lock:
      lengths = [[k, list(v)] for k, v in self._lengths.items()]
    return {"per_prompt": self.per_prompt, "lengths": lengths}

  def set_state(self, state: Mapping) -> None:
    """Takes `get_state()`'s contents (kept within this history's bounds:
    the newest lengths of the most recently seen prompts)."""
    with self._lock:
      self._lengths.clear()
    for key, lengths in state["lengths"]:
      for n in lengths:
        self.add(key, n)


def rank_lengths(scores: Sequence[float], recent: np.ndarray) -> np.ndarray:
  """[P] each score read as a length: the `recent` lengths' quantile at its
  rank (the highest score gets quantile 1 - 0.5 / P, the lowest 0.5 / P; ties
  keep input order), linearly interpolated between the sorted lengths as
  `dispatch.calibrated_lengths` does, here from one sort."""
  scores = np.asarray(scores, dtype=np.float64).reshape(-1)
  lengths = np.sort(np.asarray(recent, dtype=np.float64).reshape(-1))
  p, n = scores.size, lengths.size
  out = np.empty(p)
  q = 1.0 - (np.arange(p) + 0.5) / max(p, 1)
  out[np.argsort(-scores, kind="stable")] = np.interp(q * (n - 1), np.arange(n), lengths)
  return out


def sibling_estimates(groups: Sequence[Hashable], lengths: Sequence[float]) -> list[tuple]:
  """Per request, in the order the requests finished: the lengths of its
  group's requests that finished before it."""
  seen: dict = collections.defaultdict(list)
  out = []
  for g, n in zip(groups, lengths):
    out.append(tuple(seen[g]))
    seen[g].append(float(n))
  return out


def source_metrics(
    estimates: Mapping[str, Iterable[float | None]], lengths: Sequence[float]
) -> dict[str, float]:
  """{"recall_at_20/<source>", "spearman/<source>", "coverage/<source>"} of
  each source's estimates (None: the source had none for that request)
  against the observed `lengths`; a source with fewer than
  `MIN_METRIC_REQUESTS` estimates gets only its coverage."""
  true = np.asarray(lengths, dtype=np.float64)
  out = {}
  for source, values in estimates.items():
    values = list(values)
    if len(values) != true.size:
      raise ValueError(f"{len(values)} {source} estimates for {true.size} lengths; give one each.")
    have = np.asarray([v is not None for v in values], bool)
    out[f"coverage/{source}"] = float(have.mean()) if have.size else 0.0
    if have.sum() < MIN_METRIC_REQUESTS:
      continue
    pred = np.asarray([v for v in values if v is not None], np.float64)
    out[f"recall_at_20/{source}"] = recall_at_top(pred, true[have], 0.2)
    out[f"spearman/{source}"] = spearman(pred, true[have])
  return out
