"""Prompt and output length distributions for the simulator.

Every distribution has `sample(rng, n) -> (prompt_lens [n], output_lens [n])`
(int64, >= 1) and `max_output`.

`PaperLengths` follows the paper's description of its data (reference JSON,
"output_length_shape"): prompts mostly under 1K tokens (up to ~6K); outputs
peak near 2K of a 20K maximum with a flat tail from ~12K to 20K; the 5K and
10K variants are the 20K distribution scaled down. Our reading of that shape
(not fitted to any result): output body lognormal with mode at 10 % of the
maximum and sigma 0.6; 10 % of outputs in a uniform tail from 60 % to 100 % of
the maximum; prompts lognormal with median 400 tokens, sigma 0.7, capped at
6K (not scaled with the output maximum).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


def _check_positive_ints(name: str, values: np.ndarray) -> np.ndarray:
  if values.size == 0:
    raise ValueError(f"the {name} length distribution is empty; give at least one length.")
  if not np.all(np.isfinite(values)) or np.any(values <= 0):
    raise ValueError(
        f"{name} lengths must be positive (smallest given: {np.min(values)}); "
        "drop zero or negative lengths."
    )
  return values


@dataclasses.dataclass(frozen=True)
class PaperLengths:
  """Paper-shaped lengths (see module doc); `max_output` sets the scale."""

  max_output: int = 20480
  body_mode_frac: float = 0.1
  body_sigma: float = 0.6
  tail_weight: float = 0.10
  tail_start_frac: float = 0.6
  prompt_median: float = 400.0
  prompt_sigma: float = 0.7
  prompt_max: int = 6144

  def __post_init__(self):
    if self.max_output < 1:
      raise ValueError(f"max_output must be a positive number of tokens, got {self.max_output}.")
    if not 0 <= self.tail_weight <= 1:
      raise ValueError(f"tail_weight must be in [0, 1], got {self.tail_weight}.")

  def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    mode = self.body_mode_frac * self.max_output
    mu = np.log(mode) + self.body_sigma**2  # lognormal mode = exp(mu - sigma^2)
    body = rng.lognormal(mu, self.body_sigma, size=n)
    tail = rng.uniform(self.tail_start_frac * self.max_output, self.max_output, size=n)
    is_tail = rng.random(n) < self.tail_weight
    out = np.where(is_tail, tail, body)
    out = np.clip(np.rint(out), 1, self.max_output).astype(np.int64)
    prompt = rng.lognormal(np.log(self.prompt_median), self.prompt_sigma, size=n)
    prompt = np.clip(np.rint(prompt), 1, self.prompt_max).astype(np.int64)
    return prompt, out


@dataclasses.dataclass(frozen=True)
class FixedLengths:
  """Every sample has the same prompt and output length (closed-form tests)."""

  prompt_len: int
  output_len: int

  def __post_init__(self):
    _check_positive_ints("output", np.asarray([self.output_len], dtype=np.float64))
    _check_positive_ints("prompt", np.asarray([self.prompt_len], dtype=np.float64))

  @property
  def max_output(self) -> int:
    return self.output_len

  def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    del rng
    return (
        np.full(n, self.prompt_len, dtype=np.int64),
        np.full(n, self.output_len, dtype=np.int64),
    )


@dataclasses.dataclass(frozen=True)
class EmpiricalLengths:
  """Resamples observed (prompt, output) pairs, e.g. from a measured run."""

  prompt_lens: tuple[int, ...]
  output_lens: tuple[int, ...]

  def __post_init__(self):
    p = _check_positive_ints("prompt", np.asarray(self.prompt_lens, dtype=np.float64).reshape(-1))
    o = _check_positive_ints("output", np.asarray(self.output_lens, dtype=np.float64).reshape(-1))
    if p.size != o.size:
      raise ValueError(
          f"got {p.size} prompt lengths but {o.size} output lengths; give one pair per sample."
      )
    object.__setattr__(self, "prompt_lens", tuple(int(x) for x in p))
    object.__setattr__(self, "output_lens", tuple(int(x) for x in o))

  @property
  def max_output(self) -> int:
    return max(self.output_lens)

  def sample(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    idx = rng.integers(0, len(self.output_lens), size=n)
    return (
        np.asarray(self.prompt_lens, dtype=np.int64)[idx],
        np.asarray(self.output_lens, dtype=np.int64)[idx],
    )


def from_lengths(
    output_lens: Sequence[int], prompt_lens: Sequence[int] | int = 256
) -> EmpiricalLengths:
  """EmpiricalLengths from lists (a scalar prompt length is broadcast)."""
  o = tuple(int(x) for x in np.asarray(output_lens).reshape(-1))
  if np.isscalar(prompt_lens):
    p = (int(prompt_lens),) * len(o)
  else:
    p = tuple(int(x) for x in np.asarray(prompt_lens).reshape(-1))
  return EmpiricalLengths(prompt_lens=p, output_lens=o)


def paper_lengths(max_output: int) -> PaperLengths:
  """The paper's 5K / 10K / 20K shapes: `max_output` in tokens (5120, 10240, 20480)."""
  return PaperLengths(max_output=int(max_output))


LengthDistribution = PaperLengths | FixedLengths | EmpiricalLengths
