"""Trainer step: throughput and peak memory, remat on/off, chunked/unchunked logprobs.

  python experiments/bench/bench_trainer.py [--layers=N] [--seq_len=T] [--batch=B]
      [--reps=S] [--dtype=bfloat16|float32] [--chunk=C] [--quick]

A random Qwen2-0.5B-shaped policy (hidden 896, 14 heads / 2 kv heads of 64,
MLP 4864, vocab 151936, tied embeddings, q/k/v bias) trained with the real
`step.update_step` (PPO actor loss, AdamW, fp32 master weights) on batches of
`batch` random sequences of `seq_len` tokens. Four arms, each in its own
process (`trainer_workload.run_isolated`, so each peak is its own), in one
run:

  default     the trainer's defaults (settings.Trainer: remat, logprob_chunk,
              fp32_lm_head) at --dtype
  unchunked   default with logprob_chunk=0: fp32 [b, t, vocab] logits
  remat_full  default with remat="full" (each block keeps only its input)
  remat_dots  default with remat="dots" (keeps the weight matmuls' outputs)

Peak memory is the compiled step's own estimate (`memory_analysis()`) and, on
a GPU, `peak_bytes_in_use`; MFU uses the device's peak bf16 FLOP/s
(`trainer_workload.PEAK_BF16_FLOPS`, nan on CPU).

Defaults by platform (each flag overrides):
  GPU: the whole model (24 layers), 8 x 1024 tokens, 5 timed steps: a few
       minutes, mostly compilation.
  CPU: 2 layers (the full vocabulary, so the LM head and the logprob chunks
       weigh as in the real model; with 2 of 24 layers they weigh more, and
       the parameter-sized buffers of the update dominate the peak), 1 x 1024
       tokens, 2 timed steps: about 5 minutes on 2 cores. XLA's CPU compiler
       merges rematerialised blocks back into the forward pass (see
       `ComputeConfig.remat`), so on CPU the remat arms save nothing and
       only cost time: their ratios mean something on a GPU only.
  --quick: the tiny smoke shape (trainer_workload's "smoke_small"), 1 x 64
       tokens, 1 timed step: seconds, the same code path.

Ends with
  RESULT tokens_per_s=.. peak_bytes_per_token=.. mfu=.. remat_peak_ratio=..
      remat_dots_peak_ratio=.. chunk_peak_ratio=.. remat_speed_ratio=..
      chunk_speed_ratio=..
where the first three are the default arm's, *_peak_ratio = peak of the arm /
peak of its baseline (remat_*: remat_* / default; chunk: default / unchunked)
and *_speed_ratio the same for tokens/s.

  python experiments/bench/bench_trainer.py --rl_job [--baseline=COMMIT]
      [--iterations=N] [--reps=R] [--lengths=PATH] [--model=DIR]

instead times the RL trainer on configs/grpo.py's job as a run's trainer
does it, pinned to one core (`rl_workload.measure_rl`): the tiny
warm-started policy of bench_peers.py (--model, default its workdir's
warm start), N iterations of samples with the prompts and response lengths a
run recorded (--lengths, default bench_peers' StreamRL length_pairs.jsonl),
each batch once untimed (compiles) and once timed. Per phase (snapshot,
prepare, updates, metric fetch): wall and CPU milliseconds per iteration.
With --baseline the same arm also runs on that commit's streamrl/ (a `git
archive` in a temporary directory), the two alternating R times (default 2),
so the machine's load falls on both alike; the ratio is of CPU time, the
closer measure on a shared machine. Ends with

  RESULT cpu_ms_per_iteration=.. wall_ms_per_iteration=.. prepare_cpu_ms=..
      update_cpu_ms=.. [baseline_cpu_ms_per_iteration=.. cpu_ratio=..]
"""

import glob
import os
import shutil
import subprocess
import tempfile

import numpy as np
from absl import app, flags

from experiments import harness
from experiments import rl_workload
from experiments import trainer_workload as tw

_LAYERS = flags.DEFINE_integer("layers", None, "Decoder layers (default: 24 on GPU, 2 on CPU).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", None, "Sequences per step (default: 8 on GPU, 1 on CPU).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
_CHUNK = flags.DEFINE_integer(
    "chunk", None, "logprob_chunk of the chunked arms (default: the trainer's default)."
)
_RL_JOB = flags.DEFINE_bool("rl_job", False, "Time the RL trainer on configs/grpo.py's job.")
_BASELINE = flags.DEFINE_string("baseline", "", "--rl_job: also time this commit's trainer.")
_ITERATIONS = flags.DEFINE_integer("iterations", 12, "--rl_job: iterations per arm.")
_PEERS_WORKDIR = "/tmp/streamrl_bench_peers"
_LENGTHS = flags.DEFINE_string(
    "lengths",
    os.path.join(_PEERS_WORKDIR, "streamrl", "length_pairs.jsonl"),
    "--rl_job: a run's length_pairs.jsonl.",
)

_RL_PHASES = ("snapshot", "prepare", "update", "fetch")


def _archive(commit: str, into: str) -> str:
  """streamrl/ and configs/ of `commit` under `into`; returns `into`."""
  tar = subprocess.run(
      ["git", "archive", commit, "streamrl", "configs"],
      cwd=tw._ROOT,
      capture_output=True,
      check=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", into], input=tar, check=True)
  return into


def rl_job():
  model_dir = harness.MODEL.value
  if not model_dir or model_dir in harness.MODEL_PRESETS:  # bench_peers' warm start
    model_dir = sorted(glob.glob(os.path.join(_PEERS_WORKDIR, "warmstart-*")))[-1]
  common = dict(model_dir=model_dir, lengths=_LENGTHS.value, iterations=_ITERATIONS.value)
  arms = [rl_workload.rl_arm("current", **common)]
  tmp = None
  if _BASELINE.value:
    tmp = tempfile.mkdtemp(prefix="bench_trainer_baseline_")
    arms.append(
        rl_workload.rl_arm(
            f"baseline {_BASELINE.value}", src=_archive(_BASELINE.value, tmp), **common
        )
    )
  runs = {a["name"]: [] for a in arms}
  try:
    for _ in range(harness.reps(2 if _BASELINE.value else 1)):
      for spec in arms:
        r = tw.run_isolated(spec)
        runs[spec["name"]].append(r)
        print(
            f"  {r['name']}: {r['total_cpu_ms']:.0f} CPU ms, {r['total_wall_ms']:.0f} wall ms "
            "per iteration ("
            + ", ".join(f"{k} {r[f'{k}_cpu_ms']:.0f}" for k in _RL_PHASES)
            + f" CPU ms; update dispatch {r['update_dispatch_ms']:.0f} ms; "
            f"{r['programs']} programs, {r['timed_compiles']} compiled while timed)",
            flush=True,
        )
  finally:
    if tmp:
      shutil.rmtree(tmp, ignore_errors=True)
  mean = lambda name, key: float(np.mean([r[key] for r in runs[name]]))
  keys = dict(
      cpu_ms_per_iteration=f"{mean('current', 'total_cpu_ms'):.1f}",
      wall_ms_per_iteration=f"{mean('current', 'total_wall_ms'):.1f}",
      prepare_cpu_ms=f"{mean('current', 'prepare_cpu_ms'):.1f}",
      update_cpu_ms=f"{mean('current', 'update_cpu_ms'):.1f}",
  )
  if _BASELINE.value:
    base = arms[1]["name"]
    keys.update(
        baseline_cpu_ms_per_iteration=f"{mean(base, 'total_cpu_ms'):.1f}",
        baseline_prepare_cpu_ms=f"{mean(base, 'prepare_cpu_ms'):.1f}",
        baseline_update_cpu_ms=f"{mean(base, 'update_cpu_ms'):.1f}",
        cpu_ratio=f"{mean('current', 'total_cpu_ms') / mean(base, 'total_cpu_ms'):.3f}",
    )
  harness.report(summary={"runs": runs}, **keys)


def main(_):
  if _RL_JOB.value:
    rl_job()
    return
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top

  gpu = tw.platform() == "gpu"
  defaults = settings.Trainer()
  chunk = defaults.logprob_chunk if _CHUNK.value is None else _CHUNK.value
  base = dict(
      dtype=_DTYPE.value,
      fp32_lm_head=defaults.fp32_lm_head,
      remat=defaults.compute(_DTYPE.value).remat,  # "auto" as an unplanned run has it
      logprob_chunk=chunk,
  )
  quick = harness.QUICK.value
  common = dict(
      model="smoke_small" if quick else "qwen2_0_5b",
      layers=_LAYERS.value or (None if gpu or quick else 2),
      seq_len=64 if quick else _SEQ_LEN.value,
      batch=_BATCH.value or (8 if gpu else 1),
      steps=harness.reps(1 if quick else 5 if gpu else 2),
  )
  arms = [
      tw.arm("default", compute=base, **common),
      tw.arm("unchunked", compute=dict(base, logprob_chunk=0), **common),
      tw.arm("remat_full", compute=dict(base, remat="full"), **common),
      tw.arm("remat_dots", compute=dict(base, remat="dots"), **common),
  ]
  cfg = tw.model_config(common["model"], common["layers"])
  print(
      f"{common['model']} shape, {cfg.num_layers} layers ({cfg.num_params / 1e6:.0f}M params), "
      f"{common['batch']} x {common['seq_len']} tokens, compute {_DTYPE.value}, "
      f"default remat={base['remat']} logprob_chunk={chunk}",
      flush=True,
  )
  results = {}
  for spec in arms:
    r = tw.run_isolated(spec)
    results[spec["name"]] = r
    peak = r["runtime_peak_bytes"] or r["compiled_peak_bytes"]
    print(
        f"  {r['name']}: {r['tokens_per_s']:.1f} tokens/s, peak {tw.fmt_bytes(peak)}, "
        f"compile {r['compile_s']:.0f}s, loss {r['loss']:.4f}",
        flush=True,
    )
  print(tw.table(list(results.values())))

  def peak(name):
    r = results[name]
    return r["runtime_peak_bytes"] or r["compiled_peak_bytes"]

  d = results["default"]
  speed = lambda a, b: results[a]["tokens_per_s"] / results[b]["tokens_per_s"]
  harness.report(
      summary={"arms": results},
      tokens_per_s=f"{d['tokens_per_s']:.1f}",
      peak_bytes_per_token=f"{d['peak_bytes_per_token']:.0f}",
      mfu=f"{d['mfu']:.3f}",
      remat_peak_ratio=f"{peak('remat_full') / peak('default'):.3f}",
      remat_dots_peak_ratio=f"{peak('remat_dots') / peak('default'):.3f}",
      chunk_peak_ratio=f"{peak('default') / peak('unchunked'):.3f}",
      remat_speed_ratio=f"{speed('remat_full', 'default'):.3f}",
      chunk_speed_ratio=f"{speed('default', 'unchunked'):.3f}",
  )


if __name__ == "__main__":
  app.run(main)
