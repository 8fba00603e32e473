"""Measures a generator instance's per-token decode latency PTL(BS) and prefill cost.

For each batch size BS, BS requests with distinct random prompts of equal
length decode exactly `gen_len` tokens each (EOS ignored), all admitted at
once. Timing two generation lengths L1 < L2 and taking

    PTL(BS) = (T(BS, L2) - T(BS, L1)) / (L2 - L1)

cancels what does not scale with the number of decode steps (prefill, request
set-up, the first step). Prefill cost per prompt token comes from BS requests
with long prompts and one output token. The context cost per token held in
flight is the same slope at the largest BS with long prompts, less PTL(BS),
per token of the extra context. Each timing is the median of `reps`
runs, since the machine may be shared.

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


def profile_instance(
    instance: GeneratorInstance,
    batch_sizes: Sequence[int],
    *,
    prompt_len: int = 16,
    gen_lens: tuple[int, int] = (8, 40),
    prefill_prompt_len: int = 128,
    prefill_batch: int = 8,
    context_prompt_len: int | None = None,
    reps: int = 3,
    seed: int = 0,
    token_range: tuple[int, int] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    name: str = "",
    path: str | None = None,
) -> LatencyProfile:
  """Measures PTL(BS) at each batch size and the prefill cost; optionally saves JSON.

  Args:
    instance: a started GeneratorInstance (idle).
    batch_sizes: batch sizes to measure (each <= instance.max_num_seqs).
    prompt_len: prompt tokens of the decode measurements.
    gen_lens: two decode lengths (L1 < L2); PTL is the slope between them.
    prefill_prompt_len, prefill_batch: shape of the prefill measurement.
    context_prompt_len: prompt tokens of the context measurement (default:
      as long as max_model_len allows); 0 skips it.
    reps: repetitions per timing (median).
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
  l1, l2 = gen_lens
  if not 0 < l1 < l2:
    raise ValueError(f"gen_lens must be two increasing positive lengths, got {gen_lens}.")
  sizes = sorted({int(b) for b in batch_sizes})
  if not sizes or sizes[0] < 1 or sizes[-1] > instance.max_num_seqs:
    raise ValueError(
        f"batch sizes {list(batch_sizes)} must lie in [1, max_num_seqs="
        f"{instance.max_num_seqs}]; raise max_num_seqs or measure fewer."
    )
  if max(prompt_len + l2, prefill_prompt_len + 1) > instance.max_model_len:
    raise ValueError(
        f"prompt_len + gen_lens[1] and prefill_prompt_len + 1 must fit max_model_len="
        f"{instance.max_model_len}; shorten them."
    )
  if context_prompt_len is None:
    context_prompt_len = instance.max_model_len - l2
  if context_prompt_len + l2 > instance.max_model_len:
    raise ValueError(
        f"context_prompt_len + gen_lens[1] must fit max_model_len={instance.max_model_len}; "
        "shorten it."
    )
  lo, hi = token_range or (4, instance.model_config.vocab_size)
  rng = np.random.default_rng(seed)
  next_id = [10_000_000]

  def prompts(n, length):
    out = _random_prompts(rng, n, length, lo, hi, next_id[0])
    next_id[0] += n
    return out

  def decode_slope(bs, plen):
    t = {l1: [], l2: []}
    for _ in range(reps):
      for length in (l1, l2):  # Interleaved, so drifting load hits both.
        dt, ntok = _time_batch(instance, prompts(bs, plen), length, seed, clock)
        if ntok != bs * length:
          raise RuntimeError(
              f"expected {bs * length} tokens at BS={bs}, got {ntok}: the engine "
              "stopped early, so fixed-length decoding is not in effect."
          )
        t[length].append(dt)
    return (statistics.median(t[l2]) - statistics.median(t[l1])) / (l2 - l1)

  ptl = []
  _time_batch(instance, prompts(sizes[-1], prompt_len), l1, seed, clock)  # Warm-up, untimed.
  for bs in sizes:
    slope = decode_slope(bs, prompt_len)
    # On a busy machine the difference can come out <= 0; floor it at a tiny
    # positive value so the profile stays valid, and say so.
    if slope <= 0:
      _log.warning("PTL at BS=%d measured %.3g s (noise); flooring it.", bs, slope)
      slope = 1e-6
    ptl.append(slope)
    _log.info("PTL(BS=%d) = %.2f ms", bs, 1e3 * slope)
  context = 0.0
  if context_prompt_len > prompt_len:
    extra = decode_slope(sizes[-1], context_prompt_len) - ptl[-1]
    context = max(0.0, extra) / (sizes[-1] * (context_prompt_len - prompt_len))
    _log.info("decode cost per context token in flight: %.3g us", 1e6 * context)
  pre = []
  for _ in range(reps):
    dt_long, _ = _time_batch(instance, prompts(prefill_batch, prefill_prompt_len), 1, seed, clock)
    dt_short, _ = _time_batch(instance, prompts(prefill_batch, 1), 1, seed, clock)
    pre.append(max(0.0, dt_long - dt_short) / (prefill_batch * (prefill_prompt_len - 1)))
  profile = LatencyProfile(
      batch_sizes=tuple(sizes),
      ptl_s=tuple(ptl),
      prefill_s_per_token=statistics.median(pre),
      name=name,
      context_s_per_token=context,
  )
  if path:
    profile.to_json(path)
  return profile
