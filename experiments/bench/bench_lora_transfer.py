"""LoRA adapter vs full weights over the cross-datacenter path, at Qwen2-0.5B shapes.

  python experiments/bench/bench_lora_transfer.py [--rank=8] [--link_gbit=1.0] [--reps=3] [--quick]

The transfer service as a LoRA run uses it (`trainer.lora_rank`): the
publisher in datacenter A, 4 receiver processes in datacenter B (each its
own host label, so every byte crosses TCP), every A->B byte through one
token bucket of --link_gbit (`transfer.cross_dc_bytes_per_s`), relay tree
with fanout 2, each chunk checksum-verified and signed. Two payloads, one
after the other, each with fresh receivers:

  full:    random bf16 tensors with Qwen2-0.5B's HF names and shapes
           (`bench_transfer.qwen2_like`, 494M parameters) -- what a full
           fine-tuning run pushes for every version;
  adapter: a rank --rank adapter on q, k, v, o, gate, up and down of all 24
           layers, PEFT-named in bf16 (`streamrl.models.lora.peft_tensors`'
           layout) -- what a LoRA run pushes for every version.

Each version is timed (publish -> all 4 acks), --reps versions in all
(a fresh random payload each, so no delta applies; best time reported).
Ends with `RESULT full_s=.. adapter_s=.. full_mb=.. adapter_mb=..
speedup=.. bytes_ratio=..`. About a minute at 1 Gbit/s.
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments import harness
from experiments.bench import bench_transfer

_RANK = flags.DEFINE_integer("rank", 8, "The adapter's rank (trainer.lora_rank).")
# --link_gbit and --chunk_mib are bench_transfer's flags; --reps (versions per
# payload) and --quick the harness's.

# Qwen2-0.5B: hidden 896, MLP 4864, 24 layers, 2 kv heads of 64.
_SHAPES = {"hidden": 896, "inter": 4864, "layers": 24, "kv": 128}


def qwen2_adapter(rank: int, quick: bool, seed: int = 0) -> dict:
  """PEFT-named bf16 adapter tensors of rank `rank` on every projection."""
  import ml_dtypes
  import numpy as np

  from streamrl.models import lora

  h, f, n, kv = (512, 2048, 4, 128) if quick else tuple(_SHAPES.values())
  dims = {
      "self_attn.q_proj": (h, h),
      "self_attn.k_proj": (h, kv),
      "self_attn.v_proj": (h, kv),
      "self_attn.o_proj": (h, h),
      "mlp.gate_proj": (h, f),
      "mlp.up_proj": (h, f),
      "mlp.down_proj": (f, h),
  }
  rng = np.random.default_rng(seed)
  out = {}
  for i in range(n):
    for module, (fan_in, fan_out) in dims.items():
      name = f"{lora.PEFT_PREFIX}{i}.{module}"
      a = rng.standard_normal((rank, fan_in), dtype=np.float32) / np.sqrt(fan_in)
      b = 1e-3 * rng.standard_normal((fan_out, rank), dtype=np.float32)
      out[f"{name}.lora_A.weight"] = a.astype(ml_dtypes.bfloat16)
      out[f"{name}.lora_B.weight"] = b.astype(ml_dtypes.bfloat16)
  assert lora.is_adapter(out)
  return out


def timed_versions(make, chunk: int, link_bytes_per_s: float, versions: int) -> tuple[float, int]:
  """Best publish -> 4 acks time over `versions` fresh payloads, and bytes on the link per version."""
  from streamrl.transfer import Publisher, Transfer, new_secret, schema_of

  cfg = Transfer(
      chunk_bytes=chunk,
      use_shm=False,
      topology="tree",
      fanout=2,
      cross_dc_bytes_per_s=link_bytes_per_s,
      delta_cross_dc=False,
  )
  first = make(0)
  secret = new_secret()
  pub = Publisher(cfg, dc="A", host="trainer", secret=secret)
  procs = bench_transfer._receivers(  # pylint: disable=protected-access
      pub, secret, cfg, "B", lambda i: f"b-host{i}", schema_of(first)
  )
  try:
    times = []
    for v in range(versions):
      tensors = first if v == 0 else make(v)
      t, _ = bench_transfer._timed_publish(pub, tensors)  # pylint: disable=protected-access
      times.append(t)
    wan = pub.stats["cross_dc_full_bytes"] / versions
  finally:
    bench_transfer._stop(procs)  # pylint: disable=protected-access
    pub.close()
  return min(times), int(wan)


def main(argv):
  del argv
  # pylint: disable=protected-access
  quick, reps = harness.QUICK.value, harness.reps(3)
  link_gbit = bench_transfer._LINK_GBIT.value
  link, chunk = link_gbit * 1e9 / 8, bench_transfer._CHUNK_MIB.value << 20
  t0 = time.perf_counter()
  adapter_s, adapter_b = timed_versions(
      lambda seed: qwen2_adapter(_RANK.value, quick, seed), chunk, link, reps
  )
  full_s, full_b = timed_versions(
      lambda seed: bench_transfer.qwen2_like(quick, seed), chunk, link, reps
  )
  full_mb = sum(x.nbytes for x in bench_transfer.qwen2_like(quick).values()) / 1e6
  adapter_mb = sum(x.nbytes for x in qwen2_adapter(_RANK.value, quick).values()) / 1e6
  print(f"{'payload':<28}{'MB':>10}{'WAN MB/version':>16}{'time s':>10}")
  print(f"{'full weights (bf16)':<28}{full_mb:>10.1f}{full_b / 1e6:>16.1f}{full_s:>10.2f}")
  print(
      f"{f'adapter rank {_RANK.value} (bf16)':<28}{adapter_mb:>10.1f}"
      f"{adapter_b / 1e6:>16.1f}{adapter_s:>10.2f}"
  )
  print(
      f"link {link_gbit} Gbit/s, 4 receivers in B, relay tree; total {time.perf_counter() - t0:.0f} s"
  )
  harness.report(
      full_s=f"{full_s:.3f}",
      adapter_s=f"{adapter_s:.3f}",
      full_mb=f"{full_mb:.1f}",
      adapter_mb=f"{adapter_mb:.2f}",
      speedup=f"{full_s / adapter_s:.1f}",
      bytes_ratio=f"{adapter_b / full_b:.4f}",
  )


if __name__ == "__main__":
  app.run(main)
