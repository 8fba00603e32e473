"""What bench_trainer.py and gpu_check.py share: one trainer arm, measured.

An arm is a JSON-able dict (`arm(...)`): a model shape (Qwen2-0.5B or -1.5B,
optionally with fewer layers, or a tiny smoke shape), a batch of `batch` x
`seq_len` random tokens, and a `ComputeConfig` (dtype, fp32 LM head, remat,
logprob chunk). `measure(spec)` builds the model directly in its sharding on
a mesh over all local devices (fp32 master weights, AdamW state), compiles
the real `step.update_step` ahead of time, runs one untimed step and then
`steps` timed ones, and returns what it saw:

  tokens_per_s         batch * seq_len / mean step time (all tokens are
                       forwarded and backpropagated, prompt and response)
  compiled_peak_bytes  the compiled step's own estimate from
                       `memory_analysis()` (works on CPU): arguments + outputs
                       not aliased to them + temporaries
  runtime_peak_bytes   device.memory_stats()["peak_bytes_in_use"] (GPU; None
                       on CPU, which keeps no such statistic)
  peak_bytes_per_token the runtime peak where there is one, else the compiled
                       one, divided by batch * seq_len
  mfu                  model FLOP/s / the device's peak bf16 FLOP/s (nan
                       where `PEAK_BF16_FLOPS` has no entry, e.g. CPU)

and, when asked, the bf16 weight export (`hf.HFTensors(policy, "bfloat16")`,
what `RLTrainer.export_weights` returns for bf16 generators, walked fully:
seconds per GB) and the DLPack hand-off of a JAX array to torch.

`rl_arm(...)` / `measure_rl(spec)` time the RL trainer itself (`RLTrainer`:
snapshot, prepare, the PPO updates, the metrics' fetch) on a recorded job's
lengths, per phase, in wall and CPU seconds (bench_trainer.py --rl_job).

`run_isolated(spec)` runs `measure` in a fresh Python process, so each arm's
peak is its own (JAX has no way to reset "peak_bytes_in_use") and its memory
is returned when it ends. Model FLOPs per token: 6 x matmul parameters
(including the LM head, not the embedding lookup) + 6 x layers x heads x
head_dim x seq_len for causal attention (half of PaLM's 12 LHQT: masked
scores are not useful work); rematerialised recompute is not counted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Dense bf16 peak FLOP/s by a substring of `device.device_kind`, first match
# wins (no sparsity): NVIDIA's datasheets.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def model_config(name: str, layers: int | None = None):
  """A ModelConfig by name; `layers` overrides the layer count."""
  from streamrl.models.config import ModelConfig  # pylint: disable=g-import-not-at-top

  qwen2 = dict(
      vocab_size=151936,
      tie_embeddings=True,
      qkv_bias=True,
      rope_theta=1e6,
      rms_norm_eps=1e-6,
      max_position_embeddings=32768,
      family="qwen2",
  )
  shapes = {
      "qwen2_0_5b": dict(
          hidden_size=896,
          intermediate_size=4864,
          num_layers=24,
          num_heads=14,
          num_kv_heads=2,
          head_dim=64,
          **qwen2,
      ),
      "qwen2_1_5b": dict(
          hidden_size=1536,
          intermediate_size=8960,
          num_layers=28,
          num_heads=12,
          num_kv_heads=2,
          head_dim=128,
          **qwen2,
      ),
      "qwen2_5_7b": dict(
          qwen2,
          vocab_size=152064,
          tie_embeddings=False,
          hidden_size=3584,
          intermediate_size=18944,
          num_layers=28,
          num_heads=28,
          num_kv_heads=4,
          head_dim=128,
      ),
      # Seconds on a laptop CPU; the same code path as the real shapes.
      "smoke_small": dict(
          qwen2,
          vocab_size=1024,
          hidden_size=64,
          intermediate_size=128,
          num_layers=2,
          num_heads=4,
          num_kv_heads=2,
          head_dim=16,
      ),
      "smoke_large": dict(
          qwen2,
          vocab_size=2048,
          hidden_size=96,
          intermediate_size=192,
          num_layers=3,
          num_heads=6,
          num_kv_heads=2,
          head_dim=16,
      ),
  }
  if name not in shapes:
    raise ValueError(f"Unknown model {name!r}; use one of {sorted(shapes)}.")
  kw = shapes[name]
  if layers:
    kw = dict(kw, num_layers=layers)
  return ModelConfig(**kw)


def arm(
    name: str,
    *,
    model: str,
    seq_len: int,
    batch: int,
    steps: int,
    compute: dict,
    layers: int | None = None,
    micro_batches: int = 1,
    export: bool = False,
    dlpack: bool = False,
    seed: int = 0,
    kind: str = "step",
    legacy: bool = False,
) -> dict:
  """One measurement's spec (JSON-able; `compute` holds ComputeConfig fields;
  `kind` picks the measurement: step, init, export or handoff, see `MEASURES`)."""
  return dict(
      kind=kind,
      legacy=legacy,
      name=name,
      model=model,
      layers=layers,
      seq_len=seq_len,
      batch=batch,
      steps=steps,
      compute=compute,
      micro_batches=micro_batches,
      export=export,
      dlpack=dlpack,
      seed=seed,
  )


def peak_flops(device) -> float:
  """The device's dense bf16 peak FLOP/s, nan when unknown (CPUs)."""
  if device.platform != "gpu":
    return math.nan
  kind = device.device_kind
  return next((f for key, f in PEAK_BF16_FLOPS if key in kind), math.nan)


def flops_per_token(cfg, seq_len: int) -> float:
  """Model FLOPs (forward + backward) per trained token; see the module doc."""
  matmul = cfg.num_params
  if not cfg.tie_embeddings:
    matmul -= cfg.vocab_size * cfg.hidden_size  # the lookup table is no matmul
  attention = 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
  return 6 * matmul + attention


def random_batch(cfg, batch: int, seq_len: int, seed: int) -> dict:
  """A PPO mini-batch of random tokens: the second half of each row is the
  response; old / generator logprobs at the uniform distribution's value."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (batch, seq_len)).astype(np.int32)
  mask = np.zeros((batch, seq_len), np.float32)
  mask[:, seq_len // 2 - 1 : seq_len - 1] = 1.0
  uniform = np.float32(-np.log(cfg.vocab_size)) * mask
  zeros = np.zeros((batch, seq_len), np.float32)
  return {
      "tokens_bt": tokens,
      "mask_bt": mask,
      "old_logp_bt": uniform,
      "gen_logp_bt": uniform,
      "ref_logp_bt": zeros,
      "advantages_bt": rng.normal(size=(batch, seq_len)).astype(np.float32) * mask,
      "returns_bt": zeros,
      "old_values_bt": zeros,
  }


def _export_seconds_per_gb(policy, host_layout: bool = False, cast_only: bool = False):
  """Walks the bf16 export of `policy` to contiguous host arrays; returns
  (seconds per GB, GB).

  `host_layout=False`: `hf.HFTensors(policy, "bfloat16")`, what
  `RLTrainer.export_weights` hands bf16 generators (cast and HF layout on the
  device, one compiled program per tensor kind). `host_layout=True`: the
  earlier export, kept here to compare against -- cast on the device, copy to
  the host, then the HF layout (transposes) and the contiguous copy on the host.
  `cast_only=True`: the cast on the device alone, no layout change (not an
  export: the floor of any export that casts on the device).
  """
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top

  tensors = hf.HFTensors(policy, "bfloat16")
  entries = hf.layout_entries(policy.cfg)
  params = nnx_pure_params(policy)

  def host(name):
    import jax  # pylint: disable=g-import-not-at-top

    e = entries[name]
    value = hf.get_param(params, e.path).astype(tensors.dtype)
    return np.ascontiguousarray(e.to_hf(np.asarray(jax.device_get(value))), dtype=tensors.dtype)

  def cast(name):
    e = entries[name]
    return np.asarray(_cast_fn(hf.get_param(params, e.path), str(tensors.dtype)))

  read = host if host_layout else cast if cast_only else tensors.__getitem__
  for name in list(tensors)[:4]:  # compiles the programs of one layer's kinds
    read(name)
  nbytes, t0 = 0, time.perf_counter()
  for name in tensors:
    nbytes += read(name).nbytes
  seconds = time.perf_counter() - t0
  gb = nbytes / 1e9
  return seconds / gb, gb


def _cast_fn(x, dtype: str):
  import jax  # pylint: disable=g-import-not-at-top

  return jax.jit(_astype, static_argnums=1)(x, dtype)


def _astype(x, dtype: str):
  return x.astype(dtype)


def nnx_pure_params(model) -> dict:
  """A model's parameters as a pure dict of arrays."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _dlpack_check(x) -> dict:
  """Hands JAX array `x` (fp32 and a bf16 copy) to torch with DLPack.

  Checks that the values are equal, that torch sees the same memory (no
  copy) and, on a GPU, that the tensor is a CUDA tensor.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import torch.utils.dlpack  # pylint: disable=g-import-not-at-top

  out = {"dlpack_ok": True}
  x = jax.device_put(x, jax.devices()[0])  # DLPack takes single-device arrays
  for dtype in ("float32", "bfloat16"):
    a = jax.block_until_ready(x.astype(dtype))
    t0 = time.perf_counter()
    t = torch.utils.dlpack.from_dlpack(a)
    seconds = time.perf_counter() - t0
    want = np.asarray(a.astype(jnp.float32))
    got = t.float().cpu().numpy()
    same_memory = t.data_ptr() == a.unsafe_buffer_pointer()
    on_gpu = jax.devices()[0].platform == "gpu"
    ok = np.array_equal(want, got) and same_memory and (t.is_cuda == on_gpu)
    out["dlpack_ok"] &= bool(ok)
    out[f"dlpack_{dtype}_s"] = seconds
    out["dlpack_device"] = str(t.device)
  return out


def measure(spec: dict) -> dict:
  """Builds, compiles and times one arm in this process (see the module doc)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from streamrl.models.config import ComputeConfig  # pylint: disable=g-import-not-at-top
  from streamrl.models import transformer  # pylint: disable=g-import-not-at-top
  from streamrl.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from streamrl.rl.config import Loss  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import sharding, step  # pylint: disable=g-import-not-at-top
  from streamrl.trainer.config import Optimizer  # pylint: disable=g-import-not-at-top

  cfg = model_config(spec["model"], spec["layers"])
  compute = ComputeConfig(**spec["compute"])
  b, t = spec["batch"], spec["seq_len"]
  mesh = sharding.make_mesh({"fsdp": -1})
  policy = sharding.random_init(
      lambda rngs: Transformer(cfg, rngs=rngs), mesh, spec["seed"], transformer.initializer
  )
  models, state = step.init_state(
      policy, Optimizer(lr=1e-5, warmup_steps=0), decay_steps=1000, compute=compute
  )
  del policy
  put = lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim, shape=x.shape))
  batch = {k: put(v) for k, v in random_batch(cfg, b, t, spec["seed"]).items()}
  loss = Loss(rollout_correction="none")  # the KL default sits in the reward: no loss term

  t0 = time.perf_counter()
  compiled = step.update_step.lower(
      state, batch, models=models, loss=loss, num_micro=spec["micro_batches"]
  ).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  # Arguments + outputs not aliased to them (the state is donated) + temps.
  # (`peak_memory_in_bytes` is not filled in on CPU.)
  compiled_peak = int(
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      - mem.alias_size_in_bytes
      + mem.temp_size_in_bytes
  )

  state, metrics = compiled(state, batch)  # untimed: first-run allocations
  jax.block_until_ready(metrics)
  t0 = time.perf_counter()
  for _ in range(spec["steps"]):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  step_s = (time.perf_counter() - t0) / spec["steps"]

  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  runtime_peak = stats.get("peak_bytes_in_use")
  tokens = b * t
  tokens_per_s = tokens / step_s
  out = dict(
      name=spec["name"],
      model=spec["model"],
      layers=spec["layers"],
      batch=b,
      seq_len=t,
      compute=spec["compute"],
      device=device.device_kind,
      params=cfg.num_params,
      tokens_per_step=tokens,
      compile_s=compile_s,
      step_s=step_s,
      tokens_per_s=tokens_per_s,
      compiled_peak_bytes=compiled_peak,
      runtime_peak_bytes=runtime_peak,
      peak_bytes_per_token=(runtime_peak or compiled_peak) / tokens,
      mfu=tokens_per_s * flops_per_token(cfg, t) / peak_flops(device),
      loss=float(metrics["actor_loss"]),
      finite=bool(np.isfinite(float(metrics["actor_loss"]))),
  )
  if spec["export"]:
    policy = nnx.merge(models.actor_def, state.actor)
    out["export_s_per_gb"], out["export_gb"] = _export_seconds_per_gb(policy)
    out["export_host_layout_s_per_gb"], _ = _export_seconds_per_gb(policy, host_layout=True)
  if spec["dlpack"]:
    try:
      out.update(_dlpack_check(state.actor["trunk"]["embedding_vd"][...]))
    except Exception as e:  # pylint: disable=broad-except  (reported, not fatal)
      out.update(dlpack_ok=False, dlpack_device=f"error: {type(e).__name__}: {e}"[:300])
  out["vllm_imported"] = "vllm" in sys.modules
  return out


def measure_init(spec: dict) -> dict:
  """The random initialisation of `spec["model"]` directly in its sharding
  (`sharding.random_init`, the benchmark's and bench_trainer's path): seconds
  in all (`init_s`) and of them compiling (`init_compile_s`, from JAX's own
  compile events). With `spec["legacy"]` also the earlier init -- one jit of
  the whole constructor, its key made inside the trace -- measured the same way.
  """
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from streamrl.models import transformer  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import compiles, sharding  # pylint: disable=g-import-not-at-top

  compiles.install()
  cfg = model_config(spec["model"], spec["layers"])
  mesh = sharding.make_mesh({"fsdp": -1})

  def timed(make) -> tuple[float, float]:
    before = compiles.totals()["compile/seconds"]
    t0 = time.perf_counter()
    model = make()
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - t0, compiles.totals()["compile/seconds"] - before

  build = lambda rngs: transformer.Transformer(cfg, rngs=rngs)
  out = dict(name=spec["name"], device=jax.devices()[0].device_kind, params=cfg.num_params)
  out["init_s"], out["init_compile_s"] = timed(
      lambda: sharding.random_init(build, mesh, spec["seed"], transformer.initializer)
  )
  if spec.get("legacy"):
    legacy = lambda: sharding.init_sharded(lambda: build(nnx.Rngs(spec["seed"])), mesh)
    out["init_legacy_s"], out["init_legacy_compile_s"] = timed(legacy)
  out["vllm_imported"] = "vllm" in sys.modules
  return out


def measure_export(spec: dict) -> dict:
  """The bf16 export of a randomly initialised `spec["model"]`, both ways
  (`_export_seconds_per_gb`), in one process, alternating `spec["steps"]` times."""
  import jax  # pylint: disable=g-import-not-at-top

  from streamrl.models import transformer  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import sharding  # pylint: disable=g-import-not-at-top

  cfg = model_config(spec["model"], spec["layers"])
  mesh = sharding.make_mesh({"fsdp": -1})
  policy = sharding.random_init(
      lambda rngs: transformer.Transformer(cfg, rngs=rngs),
      mesh,
      spec["seed"],
      transformer.initializer,
  )
  device, host, floor = [], [], []
  for _ in range(max(1, spec["steps"])):  # interleaved: the machine's load hits each alike
    s_gb, gb = _export_seconds_per_gb(policy)
    device.append(s_gb)
    host.append(_export_seconds_per_gb(policy, host_layout=True)[0])
    floor.append(_export_seconds_per_gb(policy, cast_only=True)[0])
  return dict(
      name=spec["name"],
      device=jax.devices()[0].device_kind,
      params=cfg.num_params,
      export_gb=gb,
      export_s_per_gb=float(np.median(device)),
      export_host_layout_s_per_gb=float(np.median(host)),
      export_cast_only_s_per_gb=float(np.median(floor)),
      vllm_imported="vllm" in sys.modules,
  )


def measure_handoff(spec: dict) -> dict:
  """The colocated hand-off: every bf16 HF-layout tensor of the policy, made on
  the device (`hf.HFTensors.device_tensors`), given to torch by DLPack (no copy)
  and copied into a torch tensor of the same device in place (what vLLM's
  weight loader does with each tensor of `reload_weights(weights_iterator=...)`):
  seconds per GB and whether the values arrived exactly."""
  import jax  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top

  from streamrl.models import hf, transformer  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import sharding  # pylint: disable=g-import-not-at-top

  cfg = model_config(spec["model"], spec["layers"])
  mesh = sharding.make_mesh({"fsdp": 1})
  policy = sharding.random_init(
      lambda rngs: transformer.Transformer(cfg, rngs=rngs),
      mesh,
      spec["seed"],
      transformer.initializer,
  )
  tensors = hf.HFTensors(policy, "bfloat16")
  targets = {}
  for name, x in tensors.device_tensors():
    targets[name] = torch.empty(x.shape, dtype=torch.bfloat16, device=_torch_device(x))
  times, ok = [], True
  for _ in range(max(2, spec["steps"] + 1)):
    nbytes, t0 = 0, time.perf_counter()
    for name, x in tensors.device_tensors():
      targets[name].copy_(torch.from_dlpack(x))
      nbytes += x.nbytes
    if targets and next(iter(targets.values())).is_cuda:
      torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) / (nbytes / 1e9))
  name = next(iter(targets))
  want = np.asarray(tensors[name].astype(np.float32))
  ok = bool(np.array_equal(want, targets[name].float().cpu().numpy()))
  return dict(
      name=spec["name"],
      device=jax.devices()[0].device_kind,
      handoff_s_per_gb=float(np.median(times[1:])),
      handoff_gb=nbytes / 1e9,
      handoff_ok=ok,
      torch_device=str(targets[name].device),
      vllm_imported="vllm" in sys.modules,
  )


def _torch_device(x) -> str:
  """The torch device of the JAX array `x`'s (single) device."""
  device = next(iter(x.devices()))
  return f"cuda:{device.local_hardware_id}" if device.platform == "gpu" else "cpu"


def measure_rl(spec: dict) -> dict:
  """`experiments/rl_workload.measure_rl` (the RL trainer's cost per iteration
  on a recorded job), run by `run_isolated` like the other measures."""
  sys.path.insert(0, _ROOT)
  from experiments import rl_workload  # pylint: disable=g-import-not-at-top

  return rl_workload.measure_rl(spec)


MEASURES = {"step": "measure", "init": "measure_init", "export": "measure_export"}
MEASURES["handoff"] = "measure_handoff"
MEASURES["rl"] = "measure_rl"


def run_isolated(spec: dict, timeout_s: float | None = None) -> dict:
  """`measure(spec)` in a fresh Python process; raises with its stderr tail."""
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__), json.dumps(spec)],
      capture_output=True,
      text=True,
      timeout=timeout_s,
      cwd=_ROOT,
  )
  lines = [l for l in proc.stdout.splitlines() if l.startswith("ARM ")]
  if proc.returncode or not lines:
    raise RuntimeError(
        f"arm {spec['name']!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    )
  return json.loads(lines[-1][len("ARM ") :])


def platform() -> str:
  """JAX's default platform ("gpu", "cpu", ...), asked in a child process so
  this one never initialises a GPU (and takes none of its memory)."""
  code = "import jax; print(jax.devices()[0].platform)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  return proc.stdout.split()[-1]


def fmt_bytes(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def table(results: list[dict]) -> str:
  """A small fixed-width table of arms."""
  head = f"{'arm':<14}{'tokens/s':>11}{'step s':>9}{'peak':>12}{'B/token':>11}{'mfu':>7}"
  rows = [head, "-" * len(head)]
  for r in results:
    peak = r["runtime_peak_bytes"] or r["compiled_peak_bytes"]
    rows.append(
        f"{r['name']:<14}{r['tokens_per_s']:>11.1f}{r['step_s']:>9.2f}{fmt_bytes(peak):>12}"
        f"{r['peak_bytes_per_token']:>11.0f}{r['mfu']:>7.3f}"
    )
  return "\n".join(rows)


if __name__ == "__main__":
  _spec = json.loads(sys.argv[1])
  result = globals()[MEASURES[_spec.get("kind", "step")]](_spec)
  print("ARM " + json.dumps(result), flush=True)
