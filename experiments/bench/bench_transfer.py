"""Checkpoint-transfer service: bandwidth vs memcpy, relay vs direct on a slow link, delta vs full.

  python experiments/bench/bench_transfer.py [--quick] [--reps=3] [--link_gbit=1.0]

Model: random bf16 weights with Qwen2-0.5B's HF names and shapes (494M
parameters, 988 MB; ``--quick``: 4 layers, 32k vocab, ~60M parameters).
Receivers are 4 separate processes (``spawn_receiver``) on this machine whose
load_fn does nothing: an ack means the receiver has the whole version in its
address space, every chunk checksum-verified (XXH3-64) and the safetensors
header and the model's schema checked, as a safetensors file in /dev/shm that
its engines load in place (a generator pays that load the same way whatever
delivered the bytes).
Receivers that receive over TCP fault in their staging file when they join
(before serving) and their second one right after their first version, as in
a long run where two staging files alternate (fresh shared memory costs
~1.3 s/GB to fault in on this VM).

1. Bandwidth (same host, the service's shared-memory path). Service time =
   ``publish`` start -> all 4 acks (snapshot into a shared-memory file +
   checksum per chunk, while the 4 receivers verify each chunk as it is
   reported written, then ack). Files and mappings are recycled between versions
   (see streamrl/transfer/payload.py), as in a run with many versions; the
   untimed warm-up publishes fill that pool. memcpy time = copying the same
   tensors 4 times into one pre-faulted destination (np.copyto; a warm
   destination is the most favourable case for memcpy). Effective bandwidth =
   4 x model bytes / time; ``bandwidth_ratio_vs_memcpy`` = service / memcpy
   bandwidth, best of --reps for both, after one untimed publish. The TCP
   path (tree, fanout 2, no shared memory, every receiver on its own host
   label) is timed once for reference. For scale, the run also times the
   service's two CPU costs alone, in this process: the sender's one copy +
   checksum into a warm buffer (``fill_payload``) and one checksum pass
   over the payload (what each receiver spends verifying), and one BLAKE3
   pass (``manifest.digest``: what a TCP receiver spends on top, checking the
   publisher's signed digests; ``digest_cost_vs_checksum`` = its time / the
   XXH3 pass's).
   Cross-host path: the TCP run verifies every chunk's signed BLAKE3 digest
   (``tcp_signed_ratio_vs_memcpy`` = memcpy time / its time); it is timed a
   second time with ``transfer.tls="on"`` (TLS 1.3 on every connection,
   ``tcp_tls_ratio_vs_memcpy``).
   Copies: ``host_copies_per_update`` = bytes written into host memory for one
   version / model bytes, as the service counts them on the real path (the
   publisher's write into its file, plus what each receiver reports copying
   in its ack: a TCP receiver writes its staging file, which is the file its
   host's engines load; a receiver that maps a same-host file copies
   nothing). Measured on the shared-memory run (4 receivers on the sender's
   host) and, as ``tcp_copies_per_update``, on the TCP run (4 hosts: one
   copy per host expected).
2. Throttled link: the sender is in datacenter A, the 4 receivers in B and
   every A->B byte goes through one token bucket of --link_gbit (the sender's
   WAN uplink). Direct: the sender sends to all 4. Relay: it sends to one
   relay, which re-broadcasts inside B (tree, fanout 2) as chunks arrive.
   ``relay_speedup`` = direct time / relay time (fresh receivers for each).
3. Delta: after the relay run, the relay keeps version 1; version 2 applies
   one AdamW-like step to an fp32 master copy and re-publishes in bf16:
   w <- w - lr * (sign(g) + wd * w), g ~ N(0, 1), lr=--lr (1e-6), wd=0.01.
   sign(g) is bias-corrected Adam's first step, the largest per-element move
   Adam makes, so the change is an upper bound for one step at that lr.
   ``delta_bytes_ratio`` = bytes version 2 put on the A->B link / bytes of
   version 1 (full). The other 3 receivers are stopped first to save memory.

Ends with ``RESULT bandwidth_ratio_vs_memcpy=.. relay_speedup=.. delta_bytes_ratio=..
host_copies_per_update=.. tcp_copies_per_update=.. digest_cost_vs_checksum=..
tcp_signed_ratio_vs_memcpy=.. tcp_tls_ratio_vs_memcpy=..``.
"""

import os
import time

from absl import app, flags

from experiments import harness

_LINK_GBIT = flags.DEFINE_float(
    "link_gbit", 1.0, "Rate of the emulated cross-datacenter link, Gbit/s."
)
_LR = flags.DEFINE_float(
    "lr", 1e-6, "Learning rate of the AdamW-like step for the delta measurement."
)
_CHUNK_MIB = flags.DEFINE_integer("chunk_mib", 4, "Payload chunk size, MiB.")
_SKIP_TCP = flags.DEFINE_bool(
    "skip_tcp", False, "Skip the reference TCP bandwidth run (4 GB of staging)."
)
_SKIP_LINK = flags.DEFINE_bool(
    "skip_link", False, "Skip parts 2 and 3 (throttled link, delta); for development."
)

N_RECEIVERS = 4


def qwen2_like(quick: bool, seed: int = 0) -> dict:
  """HF-named random bf16 tensors with Qwen2-0.5B shapes (tied embeddings, qkv bias)."""
  import ml_dtypes
  import numpy as np

  vocab, hidden, inter, layers, kv = (
      (32000, 512, 2048, 4, 128) if quick else (151936, 896, 4864, 24, 128)
  )
  shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
  for i in range(layers):
    p = f"model.layers.{i}."
    shapes.update(
        {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.q_proj.bias": (hidden,),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    )
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in shapes.items():
    if name.endswith("norm.weight"):
      w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
    else:
      w = 0.02 * rng.standard_normal(shape, dtype=np.float32)
    out[name] = w.astype(ml_dtypes.bfloat16)
  return out


def adamw_like_step(tensors: dict, lr: float, wd: float = 0.01, seed: int = 1) -> dict:
  """One step on an fp32 master copy, re-rounded to bf16 (see the module docstring)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  out = {}
  for name, w in tensors.items():
    w32 = w.astype(np.float32)
    sign = rng.integers(0, 2, w.shape, dtype=np.int8).astype(np.float32) * 2 - 1
    w32 -= np.float32(lr) * (sign + np.float32(wd) * w32)
    out[name] = w32.astype(w.dtype)
  return out


def _receivers(pub, secret, cfg, dc, host_of, schema):
  from streamrl.transfer import spawn_receiver
  from streamrl.transfer.process import relay_only

  procs = [
      spawn_receiver(
          f"r{i}",
          dc,
          relay_only,
          pub.address,
          expected_schema=schema,
          config=cfg,
          host=host_of(i),
          secret=secret,
          run_keys=pub.run_keys,
      )
      for i in range(N_RECEIVERS)
  ]
  if not pub.wait_receivers(N_RECEIVERS, timeout=120):
    raise RuntimeError("receiver processes did not register within 120 s")
  return procs


def _stop(procs):
  """SIGTERM: each receiver closes and removes its files from /dev/shm (SIGKILL if stuck)."""
  for p in procs:
    p.terminate()
  for p in procs:
    p.join(30)
    if p.is_alive():
      p.kill()
      p.join(10)


def _timed_publish(pub, tensors, timeout=600.0):
  t0 = time.perf_counter()
  v = pub.publish(tensors)
  if not pub.wait_acks(v, timeout):
    raise RuntimeError(f"version {v} not acknowledged by {pub.missing_acks(v)}: {pub.errors}")
  return time.perf_counter() - t0, v


def _copies(pub, version, model_bytes, receivers=N_RECEIVERS, timeout=10.0):
  """Bytes copied for ``version`` (publisher + every receiver's ack) / model bytes."""
  deadline = time.monotonic() + timeout
  while sum(v >= version for v in pub.acked_versions().values()) < receivers:
    if time.monotonic() > deadline:
      break
    time.sleep(0.01)
  return pub.copied_bytes(version) / model_bytes


def bench_bandwidth(tensors, chunk, reps, skip_tcp):
  import numpy as np
  from streamrl.transfer import Publisher, Transfer, new_secret, schema_of
  from streamrl.transfer.manifest import payload_size

  model_bytes = sum(t.nbytes for t in tensors.values())
  res = {"payload_bytes": payload_size(tensors), "model_bytes": model_bytes}

  dst = {k: np.empty_like(t) for k, t in tensors.items()}
  for k, t in tensors.items():
    np.copyto(dst[k], t)  # pre-fault the destination
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(N_RECEIVERS):
      for k, t in tensors.items():
        np.copyto(dst[k], t)
    best = min(best, time.perf_counter() - t0)
  del dst
  res["memcpy_s"] = best

  from streamrl.transfer.manifest import checksum, digest, fill_payload, plan_payload

  buf = np.zeros(res["payload_bytes"], np.uint8)
  m = plan_payload(tensors, 1, chunk)
  res["fill_s"] = res["checksum_s"] = res["digest_s"] = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in fill_payload(tensors, m, memoryview(buf)):
      pass
    t1 = time.perf_counter()
    for i in range(m.num_chunks):
      a, b = m.chunk_range(i)
      checksum(memoryview(buf)[a:b])
    t2 = time.perf_counter()
    for i in range(m.num_chunks):
      a, b = m.chunk_range(i)
      digest(memoryview(buf)[a:b])
    t3 = time.perf_counter()
    res["fill_s"] = min(res["fill_s"], t1 - t0)
    res["checksum_s"] = min(res["checksum_s"], t2 - t1)
    res["digest_s"] = min(res["digest_s"], t3 - t2)
  del buf

  secret = new_secret()
  cfg = Transfer(chunk_bytes=chunk, use_shm=True)
  pub = Publisher(cfg, dc="A", host="bench-host", secret=secret)
  procs = _receivers(pub, secret, cfg, "A", lambda i: "bench-host", schema_of(tensors))
  try:
    for _ in range(2):  # warm-up: first connections, and the segment pool fills (2 segments)
      _timed_publish(pub, tensors)
    times = [_timed_publish(pub, tensors) for _ in range(reps)]
    res["shm_s"] = min(t for t, _ in times)
    res["shm_copies"] = _copies(pub, times[-1][1], model_bytes)
    assert pub.stats.get("served_tcp", 0) == 0, "same-host receivers should use shared memory"
  finally:
    _stop(procs)
    pub.close()

  # The cross-host path (signed BLAKE3 digests checked by every receiver), plain and over TLS.
  for key, tls in (() if skip_tcp else (("tcp", "off"), ("tls", "on"))):
    cfg = Transfer(chunk_bytes=chunk, use_shm=False, fanout=2, tls=tls)
    pub = Publisher(cfg, dc="A", host="bench-host", secret=secret)
    procs = _receivers(pub, secret, cfg, "A", lambda i: f"host{i}", schema_of(tensors))
    try:
      # once: a second version doubles receiver memory
      res[f"{key}_s"], v = _timed_publish(pub, tensors)
      if key == "tcp":
        res["tcp_copies"] = _copies(pub, v, model_bytes)
    finally:
      _stop(procs)
      pub.close()
  return res


def bench_link(tensors, chunk, link_bytes_per_s, lr):
  from streamrl.transfer import Publisher, Transfer, new_secret, schema_of

  res = {}
  for topology in ("direct", "tree"):
    cfg = Transfer(
        chunk_bytes=chunk,
        use_shm=False,
        topology=topology,
        fanout=2,
        cross_dc_bytes_per_s=link_bytes_per_s,
        delta_cross_dc=True,
    )
    secret = new_secret()
    pub = Publisher(cfg, dc="A", host="trainer", secret=secret)
    procs = _receivers(pub, secret, cfg, "B", lambda i: f"b-host{i}", schema_of(tensors))
    try:
      res[f"{topology}_s"], _ = _timed_publish(pub, tensors)
      res[f"{topology}_wan_bytes"] = pub.stats["cross_dc_full_bytes"]
      if topology == "tree":
        relay = pub.plan().children[0].info.name
        _stop([p for i, p in enumerate(procs) if f"r{i}" != relay])
        step = adamw_like_step(tensors, lr)
        t, v = _timed_publish(pub, step)
        stats = pub.stats
        res["delta_s"] = t
        res["delta_wan_bytes"] = stats.get("cross_dc_delta_bytes", 0)
        res["full_wan_bytes_v1"] = stats["cross_dc_full_bytes"]
        if stats.get("cross_dc_full_bytes") != res["tree_wan_bytes"]:
          raise RuntimeError("version 2 did not travel as a delta")
    finally:
      _stop(procs)
      pub.close()
  return res


def main(argv):
  del argv
  chunk = _CHUNK_MIB.value << 20
  t0 = time.perf_counter()
  tensors = qwen2_like(harness.QUICK.value)
  n_params = sum(t.size for t in tensors.values())
  print(
      f"model: {n_params / 1e6:.0f}M params, {sum(t.nbytes for t in tensors.values()) / 1e9:.3f} GB bf16, "
      f"{len(tensors)} tensors (built in {time.perf_counter() - t0:.1f}s); chunk {_CHUNK_MIB.value} MiB"
  )
  # --reps: timed publishes / memcpy rounds (best is reported).
  bw = bench_bandwidth(tensors, chunk, harness.reps(3), _SKIP_TCP.value)
  nan = float("nan")
  link = (
      dict(
          direct_s=nan,
          tree_s=nan,
          delta_s=nan,
          direct_wan_bytes=nan,
          tree_wan_bytes=nan,
          delta_wan_bytes=nan,
          full_wan_bytes_v1=nan,
      )
      if _SKIP_LINK.value
      else bench_link(tensors, chunk, _LINK_GBIT.value * 1e9 / 8, _LR.value)
  )

  gb = bw["model_bytes"] / 1e9
  total = N_RECEIVERS * gb
  rows = [("memcpy x4 (one process)", bw["memcpy_s"]), ("service, shared memory", bw["shm_s"])]
  if "tcp_s" in bw:
    rows.append(("service, TCP tree fanout 2", bw["tcp_s"]))
    rows.append(("service, TCP tree fanout 2, TLS", bw["tls_s"]))
  print(f"\n{'same host, 4 receivers':<38}{'time s':>9}{'GB/s':>9}")
  for name, s in rows:
    print(f"{name:<38}{s:>9.3f}{total / s:>9.2f}")
  print(
      f"  (alone, one process: sender's copy + checksum {bw['fill_s']:.3f} s, one verify pass "
      f"{bw['checksum_s']:.3f} s, one BLAKE3 pass {bw['digest_s']:.3f} s, one memcpy "
      f"{bw['memcpy_s'] / N_RECEIVERS:.3f} s; "
      f"{os.cpu_count()} cores)"
  )
  print(
      f"\n{'A->B link ' + str(_LINK_GBIT.value) + ' Gbit/s, 4 receivers in B':<38}{'time s':>9}"
      f"{'WAN GB':>9}"
  )
  print(
      f"{'direct (sender -> 4)':<38}{link['direct_s']:>9.2f}{link['direct_wan_bytes'] / 1e9:>9.3f}"
  )
  print(
      f"{'relay (sender -> 1 -> tree)':<38}{link['tree_s']:>9.2f}{link['tree_wan_bytes'] / 1e9:>9.3f}"
  )
  print(
      f"{'relay, next version as delta':<38}{link['delta_s']:>9.2f}{link['delta_wan_bytes'] / 1e9:>9.3f}"
  )
  ratio = bw["memcpy_s"] / bw["shm_s"]
  speedup = link["direct_s"] / link["tree_s"]
  delta_ratio = link["delta_wan_bytes"] / link["full_wan_bytes_v1"]
  extra = f" tcp_ratio={bw['memcpy_s'] / bw['tcp_s']:.3f}" if "tcp_s" in bw else ""
  tcp_copies = bw.get("tcp_copies", nan)
  tcp_signed = bw["memcpy_s"] / bw["tcp_s"] if "tcp_s" in bw else nan
  tcp_tls = bw["memcpy_s"] / bw["tls_s"] if "tls_s" in bw else nan
  print(
      f"host copies per update (bytes copied / model bytes): shared memory, 4 receivers on the "
      f"sender's host {bw['shm_copies']:.3f}; TCP, 4 receiver hosts {tcp_copies:.3f}"
  )
  print(
      f"\nlr={_LR.value}: delta/full bytes on the link {delta_ratio:.3f}; "
      f"memcpy {total / bw['memcpy_s']:.2f} GB/s{extra}; total {time.perf_counter() - t0:.0f}s"
  )
  harness.report(
      summary={"bandwidth": bw, "link": link},
      bandwidth_ratio_vs_memcpy=f"{ratio:.3f}",
      relay_speedup=f"{speedup:.2f}",
      delta_bytes_ratio=f"{delta_ratio:.3f}",
      host_copies_per_update=f"{bw['shm_copies']:.3f}",
      tcp_copies_per_update=f"{tcp_copies:.3f}",
      digest_cost_vs_checksum=f"{bw['digest_s'] / bw['checksum_s']:.2f}",
      tcp_signed_ratio_vs_memcpy=f"{tcp_signed:.3f}",
      tcp_tls_ratio_vs_memcpy=f"{tcp_tls:.3f}",
  )


if __name__ == "__main__":
  app.run(main)
