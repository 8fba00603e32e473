"""One-command GPU check of the trainer side: steps, bf16 export, DLPack.

  python experiments/gpu_check.py            # one H200: under 8 minutes
  python experiments/gpu_check.py --smoke    # tiny shapes, any CPU: seconds

Needs JAX, Flax, optax, Orbax and torch, not vLLM: nothing here imports it,
directly or through streamrl (each measurement reports `vllm_imported`, and
the check fails if any did; tests/trainer/test_gpu_check.py runs --smoke
with a vllm package on the path that refuses to be imported).

For Qwen2-0.5B and Qwen2-1.5B shapes (random weights; tied embeddings, q/k/v
bias, vocab 151936), each in its own process (`trainer_workload.run_isolated`
-- the same code as bench_trainer.py):

1. trainer steps with the real `step.update_step`: bf16 compute, fp32 master
   weights and AdamW state, fp32 LM head, `--remat` per decoder block, the
   trainer's default logprob chunk; `--batch` x `--seq_len` tokens, one
   untimed step, then `--steps` timed: tokens/s, MFU (peak bf16 FLOP/s by
   device kind) and peak memory (`peak_bytes_in_use`, and the compiled
   step's own estimate);
2. the weight export in bf16 -- `hf.HFTensors(policy, "bfloat16")`, what
   `RLTrainer.export_weights()` returns for bf16 generators -- walked fully
   to host numpy arrays: seconds per GB;
3. the DLPack hand-off of a JAX array to torch
   (`torch.utils.dlpack.from_dlpack`), fp32 and bf16: values equal, same
   memory (no copy), and a CUDA tensor on a GPU.

Ends with one line
  RESULT device=.. tokens_per_s_0_5b=.. mfu_0_5b=.. peak_gib_0_5b=..
      tokens_per_s_1_5b=.. mfu_1_5b=.. peak_gib_1_5b=.. export_s_per_gb=..
      dlpack_ok=1 vllm_imported=0 ok=1
(export_s_per_gb: the 1.5B model's). The exit status is 1 when a loss is not
finite, the DLPack check fails or vLLM was imported.
"""

import sys
import time


from absl import app, flags  # noqa: E402

from experiments import trainer_workload as tw  # noqa: E402

_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes (seconds on a CPU), same code path.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed steps per model.")
_REMAT = flags.DEFINE_enum("remat", "dots", ["none", "full", "dots"], "Decoder-block remat.")
_BUDGET_S = flags.DEFINE_integer(
    "budget_s", 450, "Wall-clock limit of the whole check; each model gets what is left."
)

MODELS = (("0_5b", "qwen2_0_5b", "smoke_small"), ("1_5b", "qwen2_1_5b", "smoke_large"))


def main(_):
  # Not streamrl.settings: it needs ml_collections, which the GPU machine lacks.
  from streamrl.models.config import DEFAULT_LOGPROB_CHUNK  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  smoke = _SMOKE.value
  seq_len, batch, steps = (64, 2, 1) if smoke else (_SEQ_LEN.value, _BATCH.value, _STEPS.value)
  compute = dict(
      dtype="bfloat16",
      fp32_lm_head=True,
      remat=_REMAT.value,
      logprob_chunk=16 if smoke else DEFAULT_LOGPROB_CHUNK,
  )
  results = {}
  for tag, full, tiny in MODELS:
    spec = tw.arm(
        tag,
        model=tiny if smoke else full,
        seq_len=seq_len,
        batch=batch,
        steps=steps,
        compute=compute,
        export=True,
        dlpack=True,
    )
    left = _BUDGET_S.value - (time.perf_counter() - t0)
    r = tw.run_isolated(spec, timeout_s=max(left, 1.0))
    results[tag] = r
    peak = r["runtime_peak_bytes"] or r["compiled_peak_bytes"]
    print(
        f"{spec['model']} ({r['params'] / 1e6:.1f}M params) on {r['device']}: "
        f"{r['tokens_per_s']:.0f} tokens/s, mfu {r['mfu']:.3f}, peak {tw.fmt_bytes(peak)} "
        f"(compiled estimate {tw.fmt_bytes(r['compiled_peak_bytes'])}), compile "
        f"{r['compile_s']:.0f}s, loss {r['loss']:.4f}; export {r['export_gb']:.2f} GB bf16 at "
        f"{r['export_s_per_gb']:.2f} s/GB; dlpack {r['dlpack_ok']} ({r['dlpack_device']})",
        flush=True,
    )
  rs = list(results.values())
  dlpack_ok = all(r["dlpack_ok"] for r in rs)
  vllm = any(r["vllm_imported"] for r in rs) or "vllm" in sys.modules
  ok = dlpack_ok and not vllm and all(r["finite"] for r in rs)
  fields = [f"device={rs[0]['device'].replace(' ', '_')}"]
  for tag, r in results.items():
    peak = r["runtime_peak_bytes"] or r["compiled_peak_bytes"]
    fields += [
        f"tokens_per_s_{tag}={r['tokens_per_s']:.1f}",
        f"mfu_{tag}={r['mfu']:.3f}",
        f"peak_gib_{tag}={peak / 2**30:.3f}",
    ]
  fields += [
      f"export_s_per_gb={results['1_5b']['export_s_per_gb']:.3f}",
      f"dlpack_ok={int(dlpack_ok)}",
      f"vllm_imported={int(vllm)}",
      f"wall_s={time.perf_counter() - t0:.0f}",
      f"ok={int(ok)}",
  ]
  print("RESULT " + " ".join(fields), flush=True)
  sys.exit(0 if ok else 1)


if __name__ == "__main__":
  app.run(main)
