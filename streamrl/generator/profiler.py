"""Measures a generator instance's per-token decode latency PTL(BS), context and prefill cost.

Each timed cell is BS requests with distinct random prompts of equal length
that decode exactly L tokens each (EOS ignored), all admitted at once. The
time of a cell is modelled as

    T(BS, P, L) = a(BS, P) + L * (PTL(BS) + ctx * BS * (P - P0))

where a() holds what does not scale with the number of decode steps
(prefill, request set-up, the first step), P0 is the decode cells' prompt
length and ctx the cost per token of context held in flight. Several
lengths L per batch size and several prompt lengths P at the largest batch
size give one linear least-squares fit of every PTL(BS) and ctx together.
Prefill cost per prompt token comes from BS requests with long against
one-token prompts and one output token. Every rep times every cell once, in
a shuffled order; the fit runs on the cells' medians, and per
rep for the spread.

Fixed-length decoding ignores EOS (`GeneratorInstance.generate(...,
ignore_eos=True)`), so every request decodes exactly the length asked for.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Sequence

import numpy as np

from streamrl.generator.config import Sampling
from streamrl.generator.vllm_engine import GeneratorInstance
from streamrl.scheduling.latency import LatencyProfile

_log = logging.getLogger(__name__)


def _random_prompts(
    rng: np.random.Generator, n: int, length: int, vocab_lo: int, vocab_hi: int, first_id: int
) -> list[tuple[int, list[int]]]:
  # Distinct random prompts so the prefix cache never turns prefill into a hit.
  return [(first_id + i, rng.integers(vocab_lo, vocab_hi, size=length).tolist()) for i in range(n)]


def _time_batch(instance, prompts, max_tokens: int, seed: int, clock) -> tuple[float, int]:
  sampling = Sampling(temperature=1.0, max_tokens=max_tokens)
  t0 = clock()
  samples = list(
      instance.generate(prompts, sampling, seed=seed, max_in_flight=len(prompts), ignore_eos=True)
  )
  dt = clock() - t0
  return dt, sum(len(s.token_ids) for s in samples)


def _fit(cells, medians, sizes, p0, contexts):
  """Weighted least squares of T(bs, P, L) = a[bs, P] + L * (PTL[bs] + ctx * bs * (P - p0)).

  cells: (bs, P, L) per timing; medians: its seconds. Relative residuals
  (weights 1/T), so the short cells count as much as the long ones.
  -> (PTL per size, ctx)."""
  groups = sorted({(bs, p) for bs, p, _ in cells})
  cols = len(groups) + len(sizes) + (1 if contexts else 0)
  a = np.zeros((len(cells), cols))
  for row, (bs, p, length) in enumerate(cells):
    a[row, groups.index((bs, p))] = 1.0
    a[row, len(groups) + sizes.index(bs)] = length
    if contexts:
      a[row, -1] = length * bs * (p - p0)
  y = np.asarray(medians, np.float64)
  w = 1.0 / np.maximum(y, 1e-12)
  coef, *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
  ptl = coef[len(groups) : len(groups) + len(sizes)]
  return [float(x) for x in ptl], (float(coef[-1]) if contexts else 0.0)


def profile_instance(
    instance: GeneratorInstance,
    batch_sizes: Sequence[int],
    *,
    prompt_len: int = 16,
    gen_lens: Sequence[int] = (8, 24, 40),
    prefill_prompt_len: int = 128,
    prefill_batch: int = 8,
    context_prompt_len: int | None = None,
    reps: int = 5,
    seed: int = 0,
    token_range: tuple[int, int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    name: str = "",
    path: str | None = None,
) -> LatencyProfile:
  """Measures PTL(BS) at each batch size, the context and the prefill cost; optionally saves JSON.

  Every rep times every cell once, in an order shuffled per rep (so a slow
  spell of a shared machine hits all cells alike, not one batch size): the
  decode cells (each batch size x each of `gen_lens`, prompts of
  `prompt_len`), the context cells (the largest batch size x `gen_lens`, at
  half of and at `context_prompt_len`) and the two prefill cells. PTL(BS)
  and the context cost come from one weighted least-squares fit over the
  cells' medians (`_fit`); each rep's own fit gives the spread stored with
  the profile (`ptl_rel_se`: the standard error of each PTL over the reps,
  relative to it).

  Args:
    instance: a started GeneratorInstance (idle).
    batch_sizes: batch sizes to measure (each <= instance.max_num_seqs).
    prompt_len: prompt tokens of the decode measurements.
    gen_lens: two or more increasing decode lengths; PTL is the slope over them.
    prefill_prompt_len, prefill_batch: shape of the prefill measurement.
    context_prompt_len: the longest prompt of the context measurement
      (default: as long as max_model_len allows); 0 skips it.
    reps: repetitions of every cell (>= 2 for a spread).
    token_range: [lo, hi) of prompt token ids (default: 4 .. vocab size, which
      skips the special tokens of the character tokenizer).
    clock: time source. Wall time by default; `time.process_time` measures
      the work of this process only, which on a shared machine is far less
      noisy — valid when the engine runs in-process
      (VLLM_ENABLE_V1_MULTIPROCESSING=0) with one compute thread.
    name: stored in the profile.
    path: if given, the profile is written there as JSON.
  Returns:
    The LatencyProfile (seconds).
  """
  lens = [int(x) for x in gen_lens]
  if len(lens) < 2 or lens[0] < 1 or any(b <= a for a, b in zip(lens, lens[1:])):
    raise ValueError(f"gen_lens must be two or more increasing positive lengths, got {gen_lens}.")
  sizes = sorted({int(b) for b in batch_sizes})
  if not sizes or sizes[0] < 1 or sizes[-1] > instance.max_num_seqs:
    raise ValueError(
        f"batch sizes {list(batch_sizes)} must lie in [1, max_num_seqs="
        f"{instance.max_num_seqs}]; raise max_num_seqs or measure fewer."
    )
  if max(prompt_len + lens[-1], prefill_prompt_len + 1) > instance.max_model_len:
    raise ValueError(
        f"prompt_len + gen_lens[-1] and prefill_prompt_len + 1 must fit max_model_len="
        f"{instance.max_model_len}; shorten them."
    )
  if context_prompt_len is None:
    context_prompt_len = instance.max_model_len - lens[-1]
  if context_prompt_len + lens[-1] > instance.max_model_len:
    raise ValueError(
        f"context_prompt_len + gen_lens[-1] must fit max_model_len={instance.max_model_len}; "
        "shorten it."
    )
  lo, hi = token_range or (4, instance.model_config.vocab_size)
  rng = np.random.default_rng(seed)
  next_id = [10_000_000]

  def prompts(n, length):
    out = _random_prompts(rng, n, length, lo, hi, next_id[0])
    next_id[0] += n
    return out

  contexts = []
  if context_prompt_len > prompt_len:
    contexts = sorted(
        {max(prompt_len + 1, (prompt_len + context_prompt_len) // 2), context_prompt_len}
    )
  decode = [(bs, prompt_len, n) for bs in sizes for n in lens]
  decode += [(sizes[-1], p, n) for p in contexts for n in lens]
  prefill = [(prefill_batch, prefill_prompt_len, 1), (prefill_batch, 1, 1)]
  warm: dict[tuple, int] = {}  # (bs, prompt) -> shortest decode length timed there
  for bs, p, n in decode + prefill:
    warm[bs, p] = min(n, warm.get((bs, p), n))
  for (bs, p), n in warm.items():
    _time_batch(instance, prompts(bs, p), n, seed, clock)  # Warm-up, untimed.
  times: dict[tuple, list[float]] = {c: [] for c in decode + prefill}
  for _ in range(reps):
    order = list(times)
    rng.shuffle(order)
    for cell in order:
      bs, p, n = cell
      dt, ntok = _time_batch(instance, prompts(bs, p), n, seed, clock)
      if ntok != bs * n:
        raise RuntimeError(
            f"expected {bs * n} tokens at BS={bs}, got {ntok}: the engine "
            "stopped early, so fixed-length decoding is not in effect."
        )
      times[cell].append(dt)
  ptl, context = _fit(
      decode, [statistics.median(times[c]) for c in decode], sizes, prompt_len, contexts
  )
  per_rep = [
      _fit(decode, [times[c][r] for c in decode], sizes, prompt_len, contexts)[0]
      for r in range(reps)
  ]
  se = [
      float(np.std([p[i] for p in per_rep], ddof=1) / np.sqrt(reps) / abs(ptl[i]))
      if reps > 1
      else 0.0
      for i in range(len(sizes))
  ]
  for i, bs in enumerate(sizes):
    # On a busy machine a slope can come out <= 0; floor it at a tiny
    # positive value so the profile stays valid, and say so.
    if ptl[i] <= 0:
      _log.warning("PTL at BS=%d measured %.3g s (noise); flooring it.", bs, ptl[i])
      ptl[i], se[i] = 1e-6, 0.0
    _log.info("PTL(BS=%d) = %.3f ms (+- %.1f %%)", bs, 1e3 * ptl[i], 100 * se[i])
  context = max(0.0, context)
  _log.info("decode cost per context token in flight: %.3g us", 1e6 * context)
  long_, short = (times[c] for c in prefill)
  pre = [max(0.0, a - b) / (prefill_batch * (prefill_prompt_len - 1)) for a, b in zip(long_, short)]
  profile = LatencyProfile(
      batch_sizes=tuple(sizes),
      ptl_s=tuple(ptl),
      prefill_s_per_token=statistics.median(pre),
      name=name,
      context_s_per_token=context,
      ptl_rel_se=tuple(se),
  )
  if path:
    profile.to_json(path)
  return profile
