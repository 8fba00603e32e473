"""The trainer's GPU benchmark: arms in their own processes, most important first.

  python experiments/check/gpu_check.py                  # one H100/H200: under 8 minutes
  python experiments/check/gpu_check.py --only=init      # also on a CPU: the 1.5B random init
  python experiments/check/gpu_check.py --only=export    # also on a CPU: the bf16 export, both ways
  python experiments/check/gpu_check.py --quick          # tiny shapes, any CPU: seconds

Needs JAX, Flax, optax and torch, not vLLM: nothing here imports it, directly
or through streamrl (each arm reports `vllm_imported`, and the check fails if
any did; tests/trainer/test_gpu_check.py runs --quick with a vllm package on
the path that refuses to be imported). Every arm runs in a fresh process
(`trainer_workload.run_isolated`), so its peak memory is its own.

Arms (`--only=NAME,...` runs a subset; the order below is the order they run in
and what a short budget keeps):

  init          Qwen2-1.5B shapes' random initialisation through
                `sharding.random_init` (the benchmark's and bench_trainer's
                path): `init_s_1_5b`, `init_compile_s_1_5b`; on a CPU also the
                earlier one-jit init for comparison (`init_legacy_*`).
  base_1_5b     1.5B at --batch x --seq_len tokens, the earlier step: reference
                attention, fp32 LM head, remat "dots".
  fused_1_5b    ... with fused attention (jax.nn.dot_product_attention).
  head_1_5b     ... and a bf16 LM head (fp32 accumulation).
  minimal_1_5b  ... and remat "minimal" (projections and attention output kept).
  none_1_5b     ... and no remat.
  batch_1_5b    minimal_1_5b at twice the batch.
  best_0_5b     Qwen2-0.5B with fused attention, bf16 head, remat minimal at
                8 x 1024 tokens (against the 37,678 tokens/s of the earlier step
                on an H200, experiments/RESULTS.md).
  slice_7b      Qwen2.5-7B's shapes with 4 of its 28 layers on one GPU: memory
                and time per layer, extrapolated to 28 layers at fsdp=4 and held
                against the memory plan (streamrl/trainer/memory_plan.py).
  export        the 0.5B bf16 export to host arrays in HF layout: on the device
                (`hf.HFTensors`) against the earlier host-side layout, s/GB.
  handoff       the colocated hand-off: HF-layout bf16 tensors on the device,
                DLPack to torch and copied into torch tensors on the same GPU, s/GB.

Each step arm reports tokens/s, MFU (peak bf16 FLOP/s by device kind), peak
memory, compile seconds and the logprob difference of its first step's loss
to base_1_5b's. Ends with one `RESULT key=value ...` line of every number.
The exit status is 1 when a loss is not finite, a hand-off check fails or vLLM
was imported.
"""

import sys
import time

from absl import app, flags

from experiments import harness
from experiments import trainer_workload as tw

_ONLY = flags.DEFINE_list("only", [], "Arms to run (default: all, in order).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "Tokens per sequence of the 1.5B arms.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per step of the 1.5B arms.")
_BUDGET_S = flags.DEFINE_integer(
    "budget_s", 450, "Wall-clock limit of the whole check; arms that do not fit are skipped."
)

BASE = dict(dtype="bfloat16", fp32_lm_head=True, remat="dots", attention="reference")
FUSED = dict(BASE, attention="fused")
HEAD = dict(FUSED, fp32_lm_head=False)
MINIMAL = dict(HEAD, remat="minimal")
NONE = dict(HEAD, remat="none")
ARMS = (
    "init",
    "base_1_5b",
    "fused_1_5b",
    "head_1_5b",
    "minimal_1_5b",
    "none_1_5b",
    "batch_1_5b",
    "best_0_5b",
    "slice_7b",
    "export",
    "handoff",
)


def specs(smoke: bool, seq_len: int, batch: int, steps: int, cpu: bool) -> dict:
  """{arm: its trainer_workload spec}; `smoke`: the tiny shapes of --quick."""
  big, small, seven = (
      ("smoke_large", "smoke_small", "smoke_large")
      if smoke
      else (
          "qwen2_1_5b",
          "qwen2_0_5b",
          "qwen2_5_7b",
      )
  )
  if smoke:
    seq_len, batch, steps = 64, 2, 1
  chunk = 16 if smoke else 512
  step = lambda name, model, compute, **kw: tw.arm(
      name,
      model=model,
      seq_len=kw.pop("seq_len", seq_len),
      batch=kw.pop("batch", batch),
      steps=steps,
      compute=dict(compute, logprob_chunk=chunk),
      **kw,
  )
  return {
      "init": tw.arm(
          "init",
          model=big,
          seq_len=0,
          batch=0,
          steps=1,
          compute={},
          kind="init",
          legacy=cpu or smoke,
      ),
      "base_1_5b": step("base_1_5b", big, BASE),
      "fused_1_5b": step("fused_1_5b", big, FUSED),
      "head_1_5b": step("head_1_5b", big, HEAD),
      "minimal_1_5b": step("minimal_1_5b", big, MINIMAL),
      "none_1_5b": step("none_1_5b", big, NONE),
      "batch_1_5b": step("batch_1_5b", big, MINIMAL, batch=2 * batch),
      "best_0_5b": step("best_0_5b", small, MINIMAL, seq_len=64 if smoke else 1024),
      "slice_7b": step(
          "slice_7b",
          seven,
          MINIMAL,
          layers=2 if smoke else 4,
          seq_len=64 if smoke else 2048,
          batch=2,
      ),
      "export": tw.arm(
          "export", model=small, seq_len=0, batch=0, steps=3, compute={}, kind="export"
      ),
      "handoff": tw.arm(
          "handoff", model=small, seq_len=0, batch=0, steps=3, compute={}, kind="handoff"
      ),
  }


def slice_extrapolation(r: dict, layers: int = 28, fsdp: int = 4) -> dict:
  """The 7B slice's per-layer memory and time scaled to the whole model at fsdp=4,
  with the memory plan of the same step for comparison."""
  from streamrl.models.config import ComputeConfig  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import memory_plan  # pylint: disable=g-import-not-at-top

  cfg4 = tw.model_config(r["model"], r["layers"])
  full = tw.model_config(r["model"])
  per_layer_params = (full.num_params - cfg4.num_params) / (full.num_layers - cfg4.num_layers)
  peak = r["runtime_peak_bytes"] or r["compiled_peak_bytes"]
  # Per layer: 16 bytes of state per parameter plus what the step keeps per layer.
  per_layer = (peak - 16 * (cfg4.num_params - cfg4.num_layers * per_layer_params)) / cfg4.num_layers
  compute = ComputeConfig(**r["compute"])
  t = memory_plan.Trainee(
      full,
      compute,
      micro_batch_size=r["batch"] * fsdp,
      seq_len=r["seq_len"],
      fsdp=fsdp,
      snapshot=False,
      platform="gpu",
  )
  return {
      "slice_7b_gib_per_layer": per_layer / 2**30,
      "slice_7b_s_per_layer": r["step_s"] / cfg4.num_layers,
      "slice_7b_gib_28_layers_fsdp4": (
          per_layer * layers / fsdp + 16 * (full.num_params - layers * per_layer_params) / fsdp
      )
      / 2**30,
      "slice_7b_plan_gib_fsdp4": memory_plan.plan(t, 1 << 50, "gpu", fsdp).total / 2**30,
  }


def main(_):
  t0 = time.perf_counter()
  cpu = tw.platform() == "cpu"
  arms = _ONLY.value or list(ARMS)
  unknown = sorted(set(arms) - set(ARMS))
  if unknown:
    raise app.UsageError(f"Unknown arm(s) {unknown}; use some of {list(ARMS)}.")
  all_specs = specs(harness.QUICK.value, _SEQ_LEN.value, _BATCH.value, harness.reps(5), cpu)
  results, fields, skipped = {}, [], []
  for name in (a for a in ARMS if a in arms):
    left = _BUDGET_S.value - (time.perf_counter() - t0)
    if left < 20:
      skipped.append(name)
      continue
    try:
      results[name] = r = tw.run_isolated(all_specs[name], timeout_s=left)
    except Exception as e:  # pylint: disable=broad-except  (one arm failing is reported)
      print(f"{name}: failed: {str(e)[-600:]}", flush=True)
      fields.append(f"{name}_failed=1")
      continue
    print(f"{name}: {r}", flush=True)
    fields += arm_fields(name, r, results)
  vllm = any(r.get("vllm_imported") for r in results.values()) or "vllm" in sys.modules
  finite = all(r.get("finite", True) for r in results.values())
  handoff = results.get("handoff", {}).get("handoff_ok", True)
  ok = finite and handoff and not vllm and not any(f.endswith("_failed=1") for f in fields)
  device = next((r["device"] for r in results.values()), "none").replace(" ", "_")
  harness.report(
      summary={"arms": results},
      device=device,
      **dict(f.split("=", 1) for f in fields),
      skipped=",".join(skipped) or "none",
      vllm_imported=int(vllm),
      wall_s=f"{time.perf_counter() - t0:.0f}",
      ok=int(ok),
  )
  sys.exit(0 if ok else 1)


def arm_fields(name: str, r: dict, results: dict) -> list[str]:
  """The RESULT fields of one arm."""
  if name == "init":
    out = [f"init_s_1_5b={r['init_s']:.2f}", f"init_compile_s_1_5b={r['init_compile_s']:.2f}"]
    if "init_legacy_s" in r:
      out += [
          f"init_legacy_s_1_5b={r['init_legacy_s']:.2f}",
          f"init_legacy_compile_s_1_5b={r['init_legacy_compile_s']:.2f}",
      ]
    return out
  if name == "export":
    return [
        f"export_s_per_gb={r['export_s_per_gb']:.3f}",
        f"export_host_layout_s_per_gb={r['export_host_layout_s_per_gb']:.3f}",
        f"export_speedup={r['export_host_layout_s_per_gb'] / r['export_s_per_gb']:.2f}",
        f"export_cast_only_s_per_gb={r['export_cast_only_s_per_gb']:.3f}",
    ]
  if name == "handoff":
    return [f"handoff_s_per_gb={r['handoff_s_per_gb']:.3f}", f"handoff_ok={int(r['handoff_ok'])}"]
  peak = r["runtime_peak_bytes"] or r["compiled_peak_bytes"]
  out = [
      f"tokens_per_s_{name}={r['tokens_per_s']:.1f}",
      f"mfu_{name}={r['mfu']:.3f}",
      f"peak_gib_{name}={peak / 2**30:.4g}",
      f"compile_s_{name}={r['compile_s']:.1f}",
  ]
  base = results.get("base_1_5b")
  if (
      base
      and name.endswith("_1_5b")
      and name != "base_1_5b"
      and r["tokens_per_step"] == base["tokens_per_step"]
  ):
    out.append(f"loss_diff_{name}={abs(r['loss'] - base['loss']):.2e}")
  if name == "slice_7b":
    out += [f"{k}={v:.4g}" for k, v in slice_extrapolation(r).items()]
  return out


if __name__ == "__main__":
  app.run(main)
