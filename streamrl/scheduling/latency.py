"""Per-token decode latency as a function of batch size: PTL(BS).

A generator instance decoding BS sequences at once spends PTL(BS) seconds per
decode step. PTL grows slowly for small batches (memory-bound decoding) and
then roughly linearly (compute-bound), which is why long-tail prompts are best
served by instances running small batches (paper, Fig. 7).

The profile is a handful of measured points; everything in between is linear
interpolation and everything outside is linear extrapolation of the nearest
segment, floored at a small positive value so that callers can divide by it.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from typing import Any

# The smallest PTL ever returned (seconds). Extrapolating a measured curve to
# tiny batches can cross zero; a positive floor keeps latency estimates
# meaningful and keeps every division by PTL safe.
_MIN_PTL_S = 1e-9

_PAPER_KEY = "ptl_ms_vs_batch_size_7b_h800_fig7"


@dataclasses.dataclass(frozen=True)
class LatencyProfile:
  """Measured per-token decode latency of one generator instance.

  Attributes:
    batch_sizes: strictly increasing batch sizes that were measured (>= 1).
    ptl_s: per-token decode latency in seconds at each batch size (> 0).
    prefill_s_per_token: prefill cost per prompt token in seconds (0 if not
      measured). Used by the simulator; the dispatcher ignores it because
      prefill is small next to long decodes.
    context_s_per_token: what a decode step costs on top of PTL(BS) per token
      of context held by the sequences in flight (attention reads every
      earlier token), in seconds (0 if not measured). PTL(BS) is measured at
      short contexts; an instance given the long tail holds long contexts, so
      without this term its steps look cheaper than they are.
    name: free-form label (model and machine), for logs and plots.
    ptl_rel_se: the profiler's standard error of each PTL over its reps,
      relative to it (empty if not measured): how far two profiles of the
      same engine may differ by chance.
  """

  batch_sizes: tuple[int, ...]
  ptl_s: tuple[float, ...]
  prefill_s_per_token: float = 0.0
  name: str = ""
  context_s_per_token: float = 0.0
  ptl_rel_se: tuple[float, ...] = ()

  def __post_init__(self):
    # Normalise lists (e.g. from JSON) to tuples so the dataclass stays
    # hashable and immutable.
    object.__setattr__(self, "batch_sizes", tuple(int(b) for b in self.batch_sizes))
    object.__setattr__(self, "ptl_s", tuple(float(p) for p in self.ptl_s))
    object.__setattr__(self, "ptl_rel_se", tuple(float(e) for e in self.ptl_rel_se))
    bs, ptl = self.batch_sizes, self.ptl_s
    if not bs:
      raise ValueError(
          "LatencyProfile needs at least one (batch_size, ptl) point; "
          "profile the instance at one or more batch sizes."
      )
    if len(bs) != len(ptl):
      raise ValueError(
          f"LatencyProfile has {len(bs)} batch sizes but {len(ptl)} latencies; "
          "give one latency per batch size."
      )
    if any(b < 1 for b in bs) or any(b2 <= b1 for b1, b2 in zip(bs, bs[1:])):
      raise ValueError(
          f"LatencyProfile batch sizes {bs} must be >= 1 and strictly increasing; "
          "sort them and drop duplicates."
      )
    if any(not (p > 0 and math.isfinite(p)) for p in ptl):
      raise ValueError(
          f"LatencyProfile latencies {ptl} must be positive and finite; " "re-run the profiler."
      )
    if self.ptl_rel_se and (
        len(self.ptl_rel_se) != len(bs)
        or any(not (e >= 0 and math.isfinite(e)) for e in self.ptl_rel_se)
    ):
      raise ValueError(
          f"LatencyProfile.ptl_rel_se {self.ptl_rel_se} must hold one finite value >= 0 "
          "per batch size (or none); re-run the profiler."
      )
    for field in ("prefill_s_per_token", "context_s_per_token"):
      value = getattr(self, field)
      if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"LatencyProfile.{field} must be >= 0; re-run the profiler.")

  def ptl(self, batch_size: float) -> float:
    """Per-token decode latency (s) at `batch_size` sequences in flight.

    Piecewise-linear between measured points, linear extrapolation of the
    first/last segment outside them (flat if only one point was measured).
    batch_size < 1 is treated as 1. The result is always > 0.
    """
    x = max(1.0, float(batch_size))
    bs, ptl = self.batch_sizes, self.ptl_s
    if len(bs) == 1:
      return ptl[0]
    # Index of the segment [bs[i], bs[i+1]] used for x; the end segments are
    # reused for extrapolation.
    i = bisect.bisect_right(bs, x) - 1
    i = min(max(i, 0), len(bs) - 2)
    x0, x1, y0, y1 = bs[i], bs[i + 1], ptl[i], ptl[i + 1]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)  # x1 > x0 by construction.
    return max(y, _MIN_PTL_S)

  def decode_time(self, batch_size: float, num_tokens: float) -> float:
    """Seconds to decode `num_tokens` steps at a constant `batch_size`."""
    return self.ptl(batch_size) * max(0.0, float(num_tokens))

  def to_dict(self) -> dict[str, Any]:
    return {
        "name": self.name,
        "batch_sizes": list(self.batch_sizes),
        "ptl_s": list(self.ptl_s),
        "prefill_s_per_token": self.prefill_s_per_token,
        "context_s_per_token": self.context_s_per_token,
        "ptl_rel_se": list(self.ptl_rel_se),
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "LatencyProfile":
    missing = [k for k in ("batch_sizes", "ptl_s") if k not in d]
    if missing:
      raise ValueError(
          f"latency profile is missing {missing}; expected keys "
          "batch_sizes, ptl_s (and optionally prefill_s_per_token, context_s_per_token, ptl_rel_se, name)."
      )
    return cls(
        batch_sizes=tuple(d["batch_sizes"]),
        ptl_s=tuple(d["ptl_s"]),
        prefill_s_per_token=float(d.get("prefill_s_per_token", 0.0)),
        name=str(d.get("name", "")),
        context_s_per_token=float(d.get("context_s_per_token", 0.0)),
        ptl_rel_se=tuple(d.get("ptl_rel_se", ())),
    )

  def to_json(self, path: str | os.PathLike) -> None:
    """Writes the profile as JSON (seconds), creating parent directories."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
      os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
      json.dump(self.to_dict(), f, indent=2)
      f.write("\n")

  @classmethod
  def from_json(cls, path: str | os.PathLike) -> "LatencyProfile":
    path = os.fspath(path)
    if not os.path.exists(path):
      raise FileNotFoundError(
          f"latency profile {path} does not exist; create it with "
          "streamrl.generator.profiler.profile_instance or use "
          "LatencyProfile.from_paper()."
      )
    with open(path) as f:
      try:
        d = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(
            f"latency profile {path} is not valid JSON ({e}); re-run the profiler."
        ) from None
    return cls.from_dict(d)

  @classmethod
  def from_paper(cls, reference_json: str | os.PathLike | None = None) -> "LatencyProfile":
    """The paper's Fig. 7 curve (Qwen2.5-7B on one H800), converted ms → s.

    Args:
      reference_json: path to a streamrl_paper.json to read the curve from;
        by default the same numbers embedded here are used (the repository's
        copy is experiments/reference/streamrl_paper.json).
    """
    if reference_json:
      if not os.path.exists(reference_json):
        raise FileNotFoundError(
            f"{reference_json} does not exist; pass the path to "
            "streamrl_paper.json or omit it to use the embedded curve."
        )
      with open(reference_json) as f:
        points = json.load(f)[_PAPER_KEY]
    else:
      points = _PAPER_PTL_MS
    items = sorted((int(k), float(v)) for k, v in points.items() if not k.startswith("_"))
    return cls(
        batch_sizes=tuple(b for b, _ in items),
        ptl_s=tuple(v / 1000.0 for _, v in items),
        name="paper-fig7-qwen2.5-7b-h800",
    )


# The paper's Fig. 7 curve, the same numbers as ptl_ms_vs_batch_size_7b_h800_fig7
# in experiments/reference/streamrl_paper.json (tests/sim/test_reference.py
# checks that they agree).
_PAPER_PTL_MS = {"1": 8.5, "16": 9.5, "32": 10.2, "64": 11.7, "128": 15.3, "256": 21.0, "512": 37.0}
