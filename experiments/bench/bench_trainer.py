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
"""

from absl import app, flags

from experiments import harness
from experiments import trainer_workload as tw

_LAYERS = flags.DEFINE_integer("layers", None, "Decoder layers (default: 24 on GPU, 2 on CPU).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", None, "Sequences per step (default: 8 on GPU, 1 on CPU).")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "Compute dtype.")
_CHUNK = flags.DEFINE_integer(
    "chunk", None, "logprob_chunk of the chunked arms (default: the trainer's default)."
)


def main(_):
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
