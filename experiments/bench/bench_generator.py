"""Throughput cost of our streaming generator, and the cost of a weight update.

  python experiments/bench/bench_generator.py [--quick] [--in_process] [--workdir=/tmp/streamrl_bench]

Takes ~4 minutes on 2 busy cores (first run also builds the 0.5B dir, ~2 GB).

Part 1 runs the same prompts with the same sampling through two identically
configured vLLM engines (same model dir, float32, max_num_seqs, max_model_len,
enforce_eager, prefix caching, `processed_logprobs` with `logprobs=0`, the same
per-prompt seeds and stop ids): our `GeneratorInstance.generate` stream,
consumed to the end, and plain `vllm.LLM.generate`. Repetitions alternate
ours / plain, plain / ours, ... after one untimed warm-up of each, so the noise
of a shared machine hits both alike; the reported ratio is the median of the
per-pair ratios (the ratio of the fastest runs is printed too). Prompts repeat across repetitions, so both engines serve them
from an equally warm prefix cache. The prompts are random characters in the policy's own
tokens (`--model=mid`: its SentencePiece tokenizer and chat template).

Part 2 times `GeneratorInstance.update_weights(hf.to_hf_tensors(model))`:
the Flax -> HF conversion and the engine reload (a safetensors file in
/dev/shm -> engine worker -> in-place reload -> prefix cache dropped)
separately, for the tiny model and for a random-weight model with Qwen2-0.5B's
shapes (494M params, 24 layers, vocab 151936, with the 64-token char
tokenizer; experiments/bench/big_model.py). The 0.5B update is skipped, with a note and `nan`, when free
memory is below what it was measured to need (see _COPIES_UPDATE).

By default the engines run vLLM's multiprocess engine core, which is what users
get; `--in_process` sets VLLM_ENABLE_V1_MULTIPROCESSING=0 instead.

Part 3 (0.5B shapes) times the updates a run makes: the local engine from the
trainer's lazy export (`hf.HFTensors`, converted tensor by tensor into the
file), and `StreamGenerationService.update(...).wait()` with one Ray instance
for each weight-delivery backend (`ray`, `transfer`; --nobackends skips it).

Ends with `RESULT generator_overhead_ratio=.. weight_update_s_tiny=..
weight_update_s_0p5b=.. weight_update_s_0p5b_lazy=.. weight_update_s_0p5b_ray=..
weight_update_s_0p5b_transfer=.. load_avg_1m=..` (weight updates: median of
--updates runs; weight_update_s_0p5b is conversion + reload).
"""

import os
import statistics
import time

from absl import app, flags

from experiments import harness
from experiments.bench import big_model as big

# --quick: a small workload, 1 rep, 1 update, a 2-layer big model (explicit flags win).
_IN_PROCESS = flags.DEFINE_bool(
    "in_process", False, "Run the engines in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."
)
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 256, "Prompts per repetition.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "max_tokens of every request.")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "Engine max_num_seqs (both engines).")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 256, "Engine max_model_len (both engines).")
_UPDATES = flags.DEFINE_integer("updates", 3, "Weight updates timed per model.")
_SKIP_BIG = flags.DEFINE_bool("skip_0p5b", False, "Skip the 0.5B weight-update measurement.")
_BACKENDS = flags.DEFINE_bool(
    "backends", True, "Also time each weight-delivery backend (one Ray instance) at 0.5B shapes."
)
_BIG_LAYERS = flags.DEFINE_integer(
    "big_layers", 24, "Layers of the 0.5B-shaped model (--quick: 2)."
)

SEED = 0
TEMPERATURE = 1.0
# Free memory the 0.5B update needs, in copies of the float32 weights. Peak
# extra RSS measured at 2 layers (0.6 GiB) / 24 layers (1.8 GiB) when
# update_weights still sent the weights as bytes over the RPC: multiprocess
# 7.6 / -, in-process 4.2 / 2.5. Handing vLLM's own reload a /dev/shm file
# instead measured 4.0 / 2.3 (about 1 GiB of it fixed); update_weights now
# passes such a file (read one tensor at a time in the worker), not
# re-measured for these limits. Kept at the older, larger values: below them
# the step is skipped rather than risk the OOM killer on a shared machine.
_COPIES_UPDATE = {"multiprocess": 7, "in_process": 4}

# Shutdown callables of the engines started here, called explicitly at the
# end: dropping the last reference to an engine did not always stop its
# engine processes, and the script then hung at exit.
_CLOSERS = []


def _shutdown_engines() -> None:
  while _CLOSERS:
    _CLOSERS.pop()()


def _stop(closer) -> None:
  _CLOSERS.remove(closer)
  closer()


def _prompts(n: int, vocab_size: int, tokenizer=None) -> list[tuple[int, list[int]]]:
  """n prompts: with the character tokenizer (`tokenizer` None), 8..40 tokens,
  <bos> then ids of real characters (4..vocab); with the policy's own
  `tokenizer` (a `data.tokenizer.Tokenizer`), random text of 7..39 of the
  character tokenizer's characters as that tokenizer encodes a prompt."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from streamrl.data import tokenizer as tok  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(1234)
  out = []
  for pid in range(n):
    length = int(rng.integers(8, 41))
    if tokenizer is None:
      out.append((pid, [1] + rng.integers(4, vocab_size, size=length - 1).tolist()))
    else:
      text = "".join(rng.choice(list(tok.CHARS), size=length - 1))
      out.append((pid, tokenizer.encode_prompt(text)))
  return out


def _policy_tokenizer(model_dir: str):
  """None for the character tokenizer (the tiny policy's), else the policy's own."""
  from streamrl.data.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  from streamrl.ranker import data as rdata  # pylint: disable=g-import-not-at-top

  if rdata.fingerprint_tokenizer_dir(model_dir) == rdata.char_tokenizer_fingerprint():
    return None
  return Tokenizer(model_dir)


def _plain_params(eos: list[int], prompts, max_tokens: int):
  """The SamplingParams GeneratorInstance builds, one per prompt, for vllm.LLM."""
  from vllm import SamplingParams  # pylint: disable=g-import-not-at-top

  return [
      SamplingParams(
          temperature=TEMPERATURE,
          top_p=1.0,
          max_tokens=max_tokens,
          logprobs=0,
          detokenize=False,
          stop_token_ids=eos,
          seed=SEED + pid,
      )
      for pid, _ in prompts
  ]


def _run_ours(gen, prompts, sampling):
  """(wall s, CPU s of this process, {prompt id: tokens})."""
  t0, c0 = time.perf_counter(), time.process_time()
  samples = list(gen.generate(prompts, sampling, seed=SEED))
  dt, cpu = time.perf_counter() - t0, time.process_time() - c0
  tokens = {s.prompt_id: tuple(s.token_ids) for s in samples}
  return dt, cpu, tokens


def _run_plain(llm, eos, prompts, max_tokens):
  inputs = [{"prompt_token_ids": list(ids)} for _, ids in prompts]
  params = _plain_params(eos, prompts, max_tokens)  # LLM.generate mutates them
  t0, c0 = time.perf_counter(), time.process_time()
  outs = llm.generate(inputs, params, use_tqdm=False)
  dt, cpu = time.perf_counter() - t0, time.process_time() - c0
  tokens = {pid: tuple(o.outputs[0].token_ids) for (pid, _), o in zip(prompts, outs)}
  return dt, cpu, tokens


def bench_throughput(model_dir: str, vocab_size: int, tokenizer=None):
  """Part 1: returns (table rows, summary, our GeneratorInstance, the plain engine's shutdown)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from vllm import LLM  # pylint: disable=g-import-not-at-top

  from streamrl.generator.config import Sampling  # pylint: disable=g-import-not-at-top
  from streamrl.generator.vllm_engine import GeneratorInstance  # pylint: disable=g-import-not-at-top

  n, max_tokens = _NUM_PROMPTS.value, _MAX_TOKENS.value
  prompts = _prompts(n, vocab_size, tokenizer)
  sampling = Sampling(temperature=TEMPERATURE, top_p=1.0, max_tokens=max_tokens)

  t0 = time.perf_counter()
  gen = GeneratorInstance(
      model_dir,
      max_num_seqs=_MAX_NUM_SEQS.value,
      max_model_len=_MAX_MODEL_LEN.value,
      seed=SEED,
      kv_cache_gib=1.0,
  )
  _CLOSERS.append(gen.close)
  print(f"[bench] ours engine up in {time.perf_counter() - t0:.1f}s", flush=True)
  # The same 1 GiB KV cache as GeneratorInstance's. The scheduler settings
  # GeneratorInstance picks (chunked prefill off on CPU, its token budget) are
  # copied from it.
  sched = gen.scheduler_limits()
  t0 = time.perf_counter()
  llm = LLM(
      model=model_dir,
      dtype="float32",
      seed=SEED,
      max_num_seqs=_MAX_NUM_SEQS.value,
      max_model_len=_MAX_MODEL_LEN.value,
      enforce_eager=True,
      kv_cache_memory_bytes=2**30,
      enable_prefix_caching=True,
      enable_chunked_prefill=sched.chunked_prefill,
      max_num_batched_tokens=sched.max_num_batched_tokens,
      logprobs_mode="processed_logprobs",
      disable_log_stats=True,
  )
  plain = llm.llm_engine.vllm_config.scheduler_config
  assert (plain.enable_chunked_prefill, plain.max_num_batched_tokens, plain.max_num_seqs) == (
      sched.chunked_prefill,
      sched.max_num_batched_tokens,
      sched.max_num_seqs,
  )
  llm_closer = llm.llm_engine.engine_core.shutdown
  _CLOSERS.append(llm_closer)
  print(f"[bench] plain engine up in {time.perf_counter() - t0:.1f}s", flush=True)
  eos = list(gen.eos_token_ids)

  arms = {
      "ours": lambda: _run_ours(gen, prompts, sampling),
      "plain": lambda: _run_plain(llm, eos, prompts, max_tokens),
  }

  times = {k: [] for k in arms}
  cpus = {k: [] for k in arms}
  tokens = {}
  # --reps timed repetitions per arm (--quick: 1); rep 0 is the untimed warm-up.
  for rep in range(harness.reps(1 if harness.QUICK.value else 11) + 1):
    # Alternate who goes first, so neither arm always follows the other.
    for name in (("ours", "plain") if rep % 2 else ("plain", "ours")):
      fn = arms[name]
      dt, cpu, toks = fn()
      if rep == 0:
        tokens[name] = toks
        continue
      if toks != tokens[name]:
        print(f"[bench] note: {name} produced different tokens in rep {rep}", flush=True)
      times[name].append(dt)
      cpus[name].append(cpu)
      ntok = sum(len(t) for t in toks.values())
      print(f"[bench] rep {rep} {name:5s} {dt:7.3f}s {ntok / dt:9.1f} tok/s", flush=True)

  ntok = {k: sum(len(t) for t in v.values()) for k, v in tokens.items()}
  same = sum(tokens["ours"][p] == tokens["plain"][p] for p, _ in prompts)
  lengths = [len(t) for t in tokens["ours"].values()]
  ratios = [(ntok["ours"] / o) / (ntok["plain"] / p) for o, p in zip(times["ours"], times["plain"])]
  rows = [
      (
          name,
          statistics.median(ts),
          ntok[name] / statistics.median(ts),
          statistics.median(cpus[name]),
      )
      for name, ts in times.items()
  ]
  info = {
      "ratio": statistics.median(ratios),
      # The least disturbed run of each arm: another view on a noisy machine.
      "best_ratio": min(times["plain"]) / min(times["ours"]),
      "ratios": ratios,
      "same_tokens": same,
      "mean_len": float(np.mean(lengths)),
      "tokens_per_rep": ntok["ours"],
      "sched": f"chunked_prefill={sched.chunked_prefill}, "
      f"max_num_batched_tokens={sched.max_num_batched_tokens}",
  }
  return rows, info, gen, llm_closer


def time_updates(gen, models) -> list[tuple[float, float]]:
  """(conversion s, reload s) of gen.update_weights(to_hf_tensors(m)) per model."""
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top

  out = []
  for model in models:
    t0 = time.perf_counter()
    tensors = hf.to_hf_tensors(model)
    t1 = time.perf_counter()
    gen.update_weights(tensors)
    t2 = time.perf_counter()
    del tensors
    out.append((t1 - t0, t2 - t1))
    print(
        f"[bench] update -> v{gen.weight_version}: convert {t1 - t0:.3f}s "
        f"reload {t2 - t1:.3f}s",
        flush=True,
    )
  return out


def time_lazy_updates(gen, models) -> list[float]:
  """Seconds of gen.update_weights(hf.HFTensors(m)) per model: the path a run
  takes (the trainer's lazy export, converted tensor by tensor into the file)."""
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top

  out = []
  for model in models:
    t0 = time.perf_counter()
    gen.update_weights(hf.HFTensors(model, "float32"))
    out.append(time.perf_counter() - t0)
    print(f"[bench] lazy update -> v{gen.weight_version}: {out[-1]:.3f}s", flush=True)
  return out


def time_backends(model_dir: str, model, updates: int) -> dict[str, list[float]]:
  """Seconds of `StreamGenerationService.update(HFTensors).wait()` per update, one
  instance, for each weight-delivery backend (streamrl/generator/delivery.py)."""
  import ray  # pylint: disable=g-import-not-at-top

  from streamrl import cluster  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top
  from streamrl.generator.service import StreamGenerationService  # pylint: disable=g-import-not-at-top
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top

  out = {}
  info = cluster.init_ray(None, generator_cpus=1, trainer_cpus=1)
  try:
    for name, transfer in (
        ("ray", settings.Transfer()),
        ("transfer", settings.Transfer(enabled=True)),
    ):
      engine = settings.Engine(
          max_num_seqs=8, max_model_len=_MAX_MODEL_LEN.value, kv_cache_gib=1.0, num_instances=1
      )
      svc = StreamGenerationService(
          model_dir, engine, dtype="float32", seed=SEED, cluster=info, transfer=transfer
      )
      try:
        times = []
        for version in range(1, updates + 1):
          t0 = time.perf_counter()
          svc.update(hf.HFTensors(model, "float32"), version).wait()
          times.append(time.perf_counter() - t0)
          print(f"[bench] {name} backend update -> v{version}: {times[-1]:.3f}s", flush=True)
        out[name] = times
      finally:
        svc.close()
  finally:
    ray.shutdown()
  return out


def _check_generates(gen, vocab_size: int, max_tokens: int = 8, tokenizer=None) -> None:
  """The engine still serves after the updates, at the new weight version."""
  from streamrl.generator.config import Sampling  # pylint: disable=g-import-not-at-top

  prompts = _prompts(4, vocab_size, tokenizer)
  samples = list(gen.generate(prompts, Sampling(max_tokens=max_tokens), seed=SEED))
  assert len(samples) == 4 and all(s.weight_version == gen.weight_version for s in samples)


def main(argv):
  try:
    _main(argv)
  finally:
    _shutdown_engines()


def _main(argv):
  del argv
  if harness.QUICK.value:
    for flag, value in (
        ("num_prompts", 64),
        ("max_tokens", 32),
        ("updates", 1),
        ("big_layers", 2),
    ):
      if not flags.FLAGS[flag].present:  # flags given explicitly win
        flags.FLAGS[flag].value = value
  if _IN_PROCESS.value:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
  harness.quiet_engines()

  from flax import nnx  # pylint: disable=g-import-not-at-top

  from streamrl.data import tokenizer as tok  # pylint: disable=g-import-not-at-top
  from streamrl.generator.vllm_engine import GeneratorInstance  # pylint: disable=g-import-not-at-top
  from streamrl.models import hf  # pylint: disable=g-import-not-at-top
  from streamrl.models.transformer import Transformer  # pylint: disable=g-import-not-at-top

  mode = (
      "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
      if _IN_PROCESS.value
      else "multiprocess engine core (vLLM default)"
  )
  print(f"[bench] engine mode: {mode}", flush=True)
  workdir = harness.workdir("/tmp/streamrl_bench")  # where the model dirs are built
  tiny_dir = harness.tiny_policy(directory=workdir)  # --model, else the random tiny policy
  tiny_cfg = hf.read_config(tiny_dir)
  # Prompts in the policy's own tokens (--model=mid: its SentencePiece tokenizer).
  tokenizer = _policy_tokenizer(tiny_dir)

  # Part 1.
  rows, info, gen, llm_closer = bench_throughput(tiny_dir, tiny_cfg.vocab_size, tokenizer)

  # Part 2, tiny: a fresh random model per update (built outside the timing).
  models = [Transformer(tiny_cfg, rngs=nnx.Rngs(100 + i)) for i in range(_UPDATES.value)]
  upd = {"tiny": time_updates(gen, models)}
  _check_generates(gen, tiny_cfg.vocab_size, tokenizer=tokenizer)
  # Both stop before the big engine starts, and together: in-process engines
  # share vLLM's global distributed state, which a shutdown tears down.
  _stop(gen.close)
  _stop(llm_closer)
  del gen, llm_closer, models

  big_cfg = big.big_config(_BIG_LAYERS.value)
  big_name = f"0.5B shapes, {big_cfg.num_layers} layers"
  weights_gib = big_cfg.num_params * 4 / 2**30
  notes, peaks, lazy, backends = [], {}, [], {}
  if not _SKIP_BIG.value:
    big_dir = big.build_big_dir(os.path.join(workdir, f"qwen2_0p5b_l{big_cfg.num_layers}"), big_cfg)
    t0 = time.perf_counter()
    big_gen = GeneratorInstance(
        big_dir, max_num_seqs=8, max_model_len=_MAX_MODEL_LEN.value, seed=SEED, kv_cache_gib=1.0
    )
    _CLOSERS.append(big_gen.close)
    print(f"[bench] big engine up in {time.perf_counter() - t0:.1f}s", flush=True)
    big_model = big.random_model(big_cfg, seed=2)  # new values, same shapes
    # The same model for each update: reload cost does not depend on values.
    copies = _COPIES_UPDATE["in_process" if _IN_PROCESS.value else "multiprocess"]
    need = copies * weights_gib
    if big.available_gib() < need:
      notes.append(
          f"{big_name}: skipped, needs ~{need:.0f} GiB free ({copies} copies of "
          f"{weights_gib:.1f} GiB of weights), {big.available_gib():.0f} GiB available"
      )
      print(f"[bench] {notes[-1]}", flush=True)
    else:
      with big.PeakMemory() as mem:
        upd[big_name] = time_updates(big_gen, [big_model] * _UPDATES.value)
      peaks[big_name] = mem.extra_gib
      lazy = time_lazy_updates(big_gen, [big_model] * _UPDATES.value)
    _check_generates(big_gen, tok.VOCAB_SIZE)
    _stop(big_gen.close)
    del big_gen
    if _BACKENDS.value and lazy:
      backends = time_backends(big_dir, big_model, _UPDATES.value)
    del big_model

  def med(xs, i):
    return statistics.median(x[i] for x in xs)

  def tot(xs):
    return statistics.median(a + b for a, b in xs)

  print()
  print(
      f"engine: {mode}; tiny model {tiny_cfg.num_params / 1e6:.2f}M params, float32, "
      f"enforce_eager, max_num_seqs={_MAX_NUM_SEQS.value}, max_model_len={_MAX_MODEL_LEN.value}, "
      f"{info['sched']} (both engines)"
  )
  print(
      f"workload: {_NUM_PROMPTS.value} prompts (8..40 tokens) x max_tokens={_MAX_TOKENS.value}, "
      f"T={TEMPERATURE}, per-prompt seeds; mean generated length {info['mean_len']:.1f} "
      f"({info['tokens_per_rep']} tokens/rep); {info['same_tokens']}/{_NUM_PROMPTS.value} "
      f"prompts gave identical tokens ours vs plain"
  )
  # In the multiprocess engine this process is only the front end (our loop or
  # LLM.generate's, output processing); its CPU time is the overhead a
  # streaming loop could add, and it is far less noisy than wall time.
  cpu_label = "front-end CPU s" if not _IN_PROCESS.value else "process CPU s"
  print(f"{'arm':20s} {'median s':>9s} {'tok/s':>9s} {cpu_label:>16s}")
  for name, dt, tps, cpu in rows:
    print(f"{name:20s} {dt:9.3f} {tps:9.1f} {cpu:16.3f}")
  print(
      f"ratio ours/plain per pair: {' '.join(f'{r:.3f}' for r in info['ratios'])} "
      f"-> median {info['ratio']:.3f} (goal >= 0.90); fastest ours / fastest plain "
      f"{info['best_ratio']:.3f}"
  )
  print()
  print(
      "weight update = hf.to_hf_tensors(model) [convert] + GeneratorInstance.update_weights "
      "[reload: safetensors file in /dev/shm, RPC to the engine, in-place reload, prefix-cache reset]; "
      f"median of {_UPDATES.value}"
  )
  print(
      f"{'model / path':32s} {'params':>8s} {'convert s':>10s} {'reload s':>9s} "
      f"{'total s':>8s} {'extra RSS GiB':>14s}"
  )
  for name, xs in upd.items():
    params = tiny_cfg.num_params if name.startswith("tiny") else big_cfg.num_params
    extra = f"{peaks[name]:14.1f}" if name in peaks else f"{'':14s}"
    print(
        f"{name:32s} {params / 1e6:7.1f}M {med(xs, 0):10.3f} {med(xs, 1):9.3f} "
        f"{tot(xs):8.3f} {extra}"
    )
  print(
      "extra RSS = peak minus start of the summed RSS of this process and the engine "
      f"processes ({weights_gib:.2f} GiB of float32 weights in the big model)"
  )
  for note in notes:
    print(note)
  big_s = f"{tot(upd[big_name]):.3f}" if big_name in upd else "nan"
  median = lambda xs: f"{statistics.median(xs):.3f}" if xs else "nan"
  print(
      "0.5B updates the way a run makes them (median, s): local engine from the lazy export "
      f"{median(lazy)}; one Ray instance per backend: "
      + ", ".join(f"{k} {median(v)}" for k, v in backends.items())
  )
  harness.report(
      summary={"throughput": info, "updates": upd, "lazy": lazy, "backends": backends},
      generator_overhead_ratio=f"{info['ratio']:.3f}",
      weight_update_s_tiny=f"{tot(upd['tiny']):.3f}",
      weight_update_s_0p5b=big_s,
      weight_update_s_0p5b_lazy=median(lazy),
      weight_update_s_0p5b_ray=median(backends.get("ray")),
      weight_update_s_0p5b_transfer=median(backends.get("transfer")),
      load_avg_1m=f"{os.getloadavg()[0]:.2f}",
  )


if __name__ == "__main__":
  app.run(main)
