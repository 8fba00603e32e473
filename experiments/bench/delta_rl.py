r"""Delta transfer on a real RL run: bytes a delta would put on the slow link vs full versions.

  python experiments/bench/delta_rl.py [--iterations=8] [--workdir=/tmp/streamrl_delta_rl] [--quick]

What runs: the tiny PPO policy of configs/ppo.py with its defaults (colocated
mode: the real in-process vLLM engine, ``LocalRollout``, generates, the JAX
trainer trains with actor + critic + reference, weights are pushed to the
engine every iteration; each iteration is ``train.train_iteration`` on the
mode from ``pipeline.make_mode``, as in a real run), warm-started once into
``--workdir`` (``warmstart.prepare_model_dir`` reuses the cached warm start
there). The lr schedule is the config's: its
horizon is ``trainer.num_iterations`` (250), not ``--iterations``, so the
steps measured here see the lr a real run sees at its start.

What is measured: version 0 is the warm start (what the generators hold when
the run begins), version v the weights after iteration v
(``trainer.export_weights()``). Every version is laid out exactly as the transfer
service publishes it (``manifest.write_payload``: a safetensors payload cut
into ``--chunk_mib`` chunks, an XXH3 checksum each) in two dtypes: float32 as trained, and
bfloat16 (``ml_dtypes.bfloat16``, round-to-nearest from the fp32 master: what a
GPU generator would hold). For each version v and k in {1, 2, 4} the
payload is delta-encoded against version v-k chunk by chunk with the service's
own ``delta.encode_chunk`` (what ``TcpPlane.send`` does on a cross-datacenter
edge when the far side holds v-k), every chunk is decoded with
``delta.decode_chunk`` and must reproduce the full chunk bit for bit and
match its checksum (the script raises otherwise). Ratio = wire bytes of the
delta version / wire bytes of the full version, both counting the per-chunk
frame headers as ``TcpPlane.send`` writes them. k=1: a far side that got
every version; k=2, 4: one that missed 1 or 3 versions.

Size caveat: the tiny policy has ~0.4M parameters (1.6 MB fp32, 0.8 MB bf16),
so with the service's 4 MiB chunks each version is ONE chunk and the
sparse/dense/raw choice is made once for the whole model; on a real model it
is made per 4 MiB chunk. The ratio itself is a property of how many words
change and by how much, which the per-iteration "changed" columns show.

Ends with ``RESULT delta_bytes_ratio_fp32=<mean k=1> delta_bytes_ratio_bf16=<mean k=1>
delta_bytes_ratio_bf16_k4=<mean k=4>`` (means over the iterations measured).
"""

import time

from absl import app, flags

from experiments import harness

_ITERATIONS = flags.DEFINE_integer(
    "iterations", 8, "RL iterations to run (one weight version each)."
)
_CHUNK_MIB = flags.DEFINE_integer(
    "chunk_mib", 4, "Payload chunk size, MiB (the service's default)."
)
_LEVEL = flags.DEFINE_integer("level", 1, "zlib level of the delta encoder (transfer.delta_level).")

LAGS = (1, 2, 4)
DTYPES = ("fp32", "bf16")


def load_config(quick: bool):
  """configs/ppo.py (or --config) in colocated mode (``--quick``: 16 prompts), as typed
  settings."""
  overrides = {"log.progress": False, "pipeline.mode": "colocated"}
  if quick:
    # 4 optimizer steps per iteration as in the default (2 mini-batches x 2 epochs).
    overrides.update(
        {
            "trainer.prompts_per_iteration": 16,
            "trainer.mini_batch_size": 8,
            "trainer.micro_batch_size": 8,
        }
    )
  return harness.settings("configs/ppo.py", overrides)


def lr_at(s, step: int) -> float:
  """The actor's lr at optimizer step ``step`` of run settings ``s``
  (``step_lib.lr_schedule``, as the trainer builds it)."""
  from streamrl.trainer import step as step_lib

  sched = step_lib.lr_schedule(s.optimizer, lr=s.optimizer.lr, decay_steps=s.optimizer_steps)
  return float(sched(step))


class Version:
  """One weight version as the service lays it out: payload bytes + manifest (with checksums)."""

  def __init__(self, tensors: dict, version: int, chunk_bytes: int):
    import numpy as np
    from streamrl.transfer.manifest import payload_size, write_payload

    self.buf = np.empty(payload_size(tensors), np.uint8)
    self.manifest = write_payload(tensors, memoryview(self.buf), version, chunk_bytes)

  def chunk(self, i: int) -> memoryview:
    a, b = self.manifest.chunk_range(i)
    return memoryview(self.buf)[a:b]


def frame_bytes() -> int:
  """Header bytes TcpPlane.send writes before each chunk (frame + index/encoding/checksum)."""
  from streamrl.transfer.planes import CHUNK_FRAME_BYTES

  return CHUNK_FRAME_BYTES


def delta_wire(new: Version, base: Version, level: int) -> dict:
  """Encodes ``new`` against ``base`` chunk by chunk, checks exact reconstruction; byte counts.

  Returns {"delta": wire bytes as deltas, "full": wire bytes sent full,
  "changed": fraction of payload words that differ, "enc": encodings used
  (R raw, Z xor+zlib, S xor sparse), "enc_s": encode seconds}.
  """

  import numpy as np
  from streamrl.transfer import delta as delta_lib

  m = new.manifest
  if m.layout != base.manifest.layout:
    raise RuntimeError(
        "versions have different layouts; a delta is impossible (the schema changed)."
    )
  from streamrl.transfer.manifest import checksum

  head, word = frame_bytes(), m.word_bytes
  words = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[word]
  out = {"delta": 0, "full": 0, "changed": 0, "enc": "", "enc_s": 0.0}
  for i in range(m.num_chunks):
    a, b = m.chunk_range(i)
    t0 = time.perf_counter()
    kind, blob = delta_lib.encode_chunk(new.chunk(i), base.chunk(i), word, level)
    out["enc_s"] += time.perf_counter() - t0
    if blob is not None:
      got = np.empty(b - a, np.uint8)
      delta_lib.decode_chunk(kind, blob, base.chunk(i), memoryview(got), word)
      if checksum(got) != m.checksums[i] or not np.array_equal(got, new.buf[a:b]):
        raise RuntimeError(f"chunk {i} of version {m.version} did not reconstruct bit-exactly")
    out["delta"] += head + (b - a if blob is None else len(blob))
    out["full"] += head + (b - a)
    out["changed"] += int(np.count_nonzero(new.buf[a:b].view(words) != base.buf[a:b].view(words)))
    out["enc"] += "RZS"[kind]
  out["changed"] /= m.total_bytes // word
  return out


def median_relative_change(new: dict, old: dict) -> float:
  """Median over all non-zero weights of |new - old| / |old| (fp32 tensors of two versions)."""
  import numpy as np

  rel = []
  for k, w in old.items():
    w = w.reshape(-1)
    nz = w != 0
    rel.append(np.abs(new[k].reshape(-1)[nz] - w[nz]) / np.abs(w[nz]))
  return float(np.median(np.concatenate(rel)))


def bf16_of(tensors: dict) -> dict:
  import ml_dtypes

  return {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}


def main(argv):
  del argv
  import numpy as np
  from streamrl import pipeline, train
  from streamrl.data.loader import PromptLoader
  from streamrl.generator.local import LocalRollout
  from streamrl.models import hf
  from streamrl.pipeline.timeline import Timeline
  from streamrl.trainer import setup
  from streamrl.trainer.rl_trainer import RLTrainer

  t_start = time.perf_counter()
  # --quick: 5 iterations of 16 prompts (same optimizer steps per iteration).
  iterations = 5 if harness.QUICK.value else _ITERATIONS.value
  chunk = _CHUNK_MIB.value << 20
  s = load_config(harness.QUICK.value)
  workdir = harness.workdir()  # the warm start's cache (reused if its fingerprint matches)
  train_examples, _ = setup.load_examples(s)
  model_dir = setup.policy_dir(s, workdir, train_examples)
  _, policy = hf.load_hf(model_dir)
  tokenizer = setup.make_tokenizer(s, model_dir)
  rewarder = setup.make_rewarder(s, tokenizer)
  trainer = RLTrainer.from_settings(policy, s)
  loader = PromptLoader(train_examples, s.trainer.prompts_per_iteration, seed=s.seed)
  rollout = LocalRollout(model_dir, s.engine, dtype=s.model.dtype, seed=s.seed)
  try:
    mode = pipeline.make_mode(
        s,
        rollout,
        model_dir=model_dir,
        workdir=workdir,
        rounds=pipeline.make_rounds(loader, tokenizer, s.advantage.group_size),
    )
  except BaseException:
    rollout.close()
    raise
  timeline = Timeline()
  print(f"policy {model_dir}; set-up {time.perf_counter() - t_start:.0f} s", flush=True)

  first = dict(trainer.export_weights())  # kept across updates: materialised
  n_params = sum(t.size for t in first.values())
  history = {"fp32": [Version(first, 0, chunk)], "bf16": [Version(bf16_of(first), 0, chunk)]}
  for d in DTYPES:
    m = history[d][0].manifest
    print(
        f"{d}: {n_params / 1e6:.2f}M params, payload {m.total_bytes / 1e6:.2f} MB in "
        f"{m.num_chunks} chunk(s) of {_CHUNK_MIB.value} MiB, word {m.word_bytes} B"
    )
  tr = s.trainer
  opt = s.optimizer
  print(
      f"actor: AdamW lr={opt.lr} (warmup {opt.warmup_steps} steps, cosine over "
      f"{tr.num_iterations} iterations), weight_decay={opt.weight_decay}, grad_clip={opt.grad_clip}; "
      f"{tr.ppo_epochs} epochs x {s.samples_per_iteration // tr.mini_batch_size}"
      f" mini-batches per iteration; zlib level {_LEVEL.value}",
      flush=True,
  )

  ratios = {(d, k): [] for d in DTYPES for k in LAGS}
  prev = first
  rows, enc_s, enc_bytes = [], 0.0, 0
  cols = "".join(f"{d + ' k' + str(k):>10}" for d in DTYPES for k in LAGS)
  header = (
      f"{'it':>3}{'ver':>4}{'step':>5}{'lr':>9}{'reward':>8}{'gen s':>7}{'train s':>8}"
      f"{'|dw|/|w|':>9}{'fp32 chg':>9}{'bf16 chg':>9}{'bf16 chg4':>10}{cols}{'enc':>6}"
  )
  try:
    for it in range(iterations):
      x = train.train_iteration(
          it, mode, trainer, rewarder, timeline, ppo_epochs=tr.ppo_epochs, seed=s.seed
      )
      sc = train.iteration_scalars(x, timeline, rollout)
      tensors = dict(trainer.export_weights())
      rel = median_relative_change(tensors, prev)
      prev = tensors
      new = {
          "fp32": Version(tensors, it + 1, chunk),
          "bf16": Version(bf16_of(tensors), it + 1, chunk),
      }
      res = {}
      for d in DTYPES:
        for k in LAGS:
          if len(history[d]) >= k:
            r = delta_wire(new[d], history[d][-k], _LEVEL.value)
            res[d, k] = r
            ratios[d, k].append(r["delta"] / r["full"])
            enc_s += r["enc_s"]
            enc_bytes += r["full"]
        history[d] = (history[d] + [new[d]])[-max(LAGS) :]
      step = int(trainer.state.step)
      fmt = (
          lambda d, k: f"{res[d, k]['delta'] / res[d, k]['full']:>10.3f}"
          if (d, k) in res
          else f"{'-':>10}"
      )
      chg4 = f"{res['bf16', 4]['changed']:>10.3f}" if ("bf16", 4) in res else f"{'-':>10}"
      row = (
          f"{it:>3}{it + 1:>4}{step:>5}{lr_at(s, step - 1):>9.2e}{sc['reward/mean']:>8.3f}"
          f"{sc['time/generation_s']:>7.1f}{sc['time/training_s']:>8.1f}{rel:>9.1e}"
          f"{res['fp32', 1]['changed']:>9.3f}{res['bf16', 1]['changed']:>9.3f}{chg4}"
          + "".join(fmt(d, k) for d in DTYPES for k in LAGS)
          + f"{res['fp32', 1]['enc'] + '/' + res['bf16', 1]['enc']:>6}"
      )
      rows.append(row)
      if it == 0:
        print("\n" + header)
      print(row, flush=True)
  finally:
    try:
      mode.close()
    finally:
      rollout.close()

  print("\n" + header + "\n" + "\n".join(rows))  # again, without the engine's log lines in between
  print(
      "\n|dw|/|w|: median relative change of a weight over the iteration (fp32). bf16 words are "
      "2^-8..2^-7 of |w| apart\n(4e-3..8e-3), so a change of relative size r flips the rounded bf16 word "
      "with probability ~ r / that spacing (1 once r exceeds it);\nchg: fraction of payload words (4 B fp32, 2 B bf16) that differ from the version 1 "
      "(chg4: 4) back;\nkN: delta wire bytes / full wire bytes against the version N back; "
      "enc: encoding per chunk for k=1 fp32/bf16 (R raw, Z xor+zlib, S xor sparse)."
  )
  mean = lambda d, k: float(np.mean(ratios[d, k])) if ratios[d, k] else float("nan")
  for d in DTYPES:
    print(
        f"{d}: mean ratio "
        + ", ".join(f"k={k} {mean(d, k):.3f} (n={len(ratios[d, k])})" for k in LAGS)
    )
  print(
      f"every delta chunk reconstructed bit-exactly (checksum + byte compare); encoder "
      f"{enc_bytes / max(enc_s, 1e-9) / 1e6:.0f} MB/s of full payload; total {time.perf_counter() - t_start:.0f} s"
  )
  harness.report(
      summary={"ratios": {f"{d}_k{k}": v for (d, k), v in ratios.items()}},
      delta_bytes_ratio_fp32=f"{mean('fp32', 1):.3f}",
      delta_bytes_ratio_bf16=f"{mean('bf16', 1):.3f}",
      delta_bytes_ratio_bf16_k4=f"{mean('bf16', 4):.3f}",
  )


if __name__ == "__main__":
  app.run(main)
