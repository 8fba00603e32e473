r"""Pipeline modes side by side: colocated, sync, stream, async on one workload.

  python experiments/bench/bench_modes.py [--quick] [--blocks=2] [--iterations=8]

What runs (everything real: vLLM engines, Ray actors, the JAX trainer), each
mode exactly as a real run (`streamrl.train.run`) runs it:
  * The tiny PPO policy of configs/ppo.py, warm-started once into
    `--workdir` (`warmstart.prepare_model_dir`); every mode starts from those
    weights and a fresh optimizer state, in a trainer of its own
    (`RLTrainer.from_settings`; trainers of equal settings share their
    compiled update step). Before any arm, the jitted functions are compiled
    for every padded length the workload can produce and for each mode's
    loss config (async's rollout correction differs), so no arm pays a
    compile that another got for free.
  * Each mode's rollout is the real one: `colocated` runs a vLLM engine in
    this process (`LocalRollout`) and uses both cores; the others run one
    Ray generator actor (`StreamGenerationService` on a local Ray) pinned to
    core 0 and pin this process (the trainer) to core 1. The mode comes
    from `pipeline.make_mode` (with its generation scheduler) with
    `rounds(it)` from `pipeline.make_rounds`, and every iteration is
    `train.train_iteration` + `train.iteration_scalars` on a `Timeline`.
    Same prompts (PromptLoader seed) and sampling seeds (`local.round_seed`)
    in every mode; the `it0 digest` column hashes iteration 0's samples
    (same weights everywhere): equal digests, identical generations.
  * Blocks: in each of `--blocks` blocks every arm runs `--warmup` untimed +
    `--iterations` timed iterations on a freshly built rollout and mode that
    first loads the arm's current weights, as a resumed run does
    (`rollout.update(trainer.export_weights(), next iteration).wait()`). The
    arm order rotates from block to block, so the load of a shared machine
    falls on all arms alike, and only one engine holds memory at a time.
    Start-up and the untimed iterations (first generations on a fresh engine
    are slow) stay outside the measurement. Throughput = samples / wall
    seconds summed over an arm's timed iterations.
  * Generation alone: one Ray generator instance on the generator core,
    generating the same batches with the same seeds, nothing else running.
    Training alone: the trainer pinned to its core, doing the loop's trainer
    work on those samples (rewards, old/ref logprobs, values, advantages, PPO
    updates: `modes_workload.train_alone`; the Flax->HF weight export is
    reported apart). Both in every block too.

Workload (defaults): every size from configs/ppo.py, the StreamRL default
(work traces, 64 prompts per iteration, PPO with critic and reference,
mini-batches of 32 in ragged micro-batches of 8, 2 PPO epochs, max_tokens
320); the disaggregated arms use its scheduler (ranker + skew dispatch) and
transfer service, colocated is the FIFO baseline without transfer
(configs/colocated.py). `async_partial` is async with `pipeline.partial=on`
(streamrl/pipeline/partial.py); its unfinished responses are carried from
one block to the next, as a resumed run carries them. Each mini-batch is
padded to its longest sample: sync/async/colocated cut the length-sorted
batch into mini-batches, stream fills one mini-batch per length bucket as
samples arrive (`stream.LengthBatcher`). Every arm trains its own policy
from the same warm start, so their response lengths drift apart over the
iterations; the response tokens/s line compares the arms on tokens.

The string-task workload of earlier rounds is `--max_num_seqs=4
--max_tokens=56 --mini_batch=16 --ppo_epochs=1 --override=task.kind=synthetic
--override=engine.max_model_len=128 --override=scheduler.kind=fifo
--override=transfer.enabled=False`.

Measured results: experiments/RESULTS.md (section bench_modes.py).

The trainer runs in this process (the loop is called directly, so
`cluster.trainer_actor` does not apply): one set of compiled functions then
serves every arm. It is pinned to the trainer's core like a TrainerActor,
except that XLA sized its thread pool before the pinning (two threads on one
core; a check here: 0.64-0.69 CPU-s per training iteration either way).

Columns: `gen s`, `train s`, `push s` are the loop's own
time/generation_s, time/training_s, time/weight_update_s means; `idle:*` the
bubble fraction of each stage (`Timeline.busy_seconds` over the timed
iterations); `cpu:this` / `cpu:gen` the cores' worth of CPU that this
process (trainer; colocated: trainer + engine) and the generator actor used
over the timed iterations (1.0 = a whole core): well below 1 on a busy stage
means the machine's other load took its core.

Writes under `--out` (default experiments/out/bench_modes): one
timeline_<mode>.json per mode (`Timeline.to_json`; labels "gen k", "train k",
"epochs k" name iteration k), timeline_<mode>.png of each mode's last block,
timeline_all.png (experiments/diag/plot_timeline.py) and summary.json. The arms
are in experiments/bench/modes_arms.py.

Ends with
  RESULT colocated=1.00 sync=<x> stream=<x> async=<x> pipeline_efficiency=<x>
         async_partial=<x> partial_vs_async=<x>
         async_partial_sibling=<x> sibling_vs_async=<x>
         [<mode>_trained_tokens_per_s=<x> ... ranker_recall20=<x>]
         [<mode>_sim_err=<x> ... max_sim_err=<x>]
(mode throughputs in samples/s / colocated's; efficiency = async /
min(generation alone, training alone); the partial and sibling keys when that
arm runs; the bracketed ones with an environment, where a sample is a
trajectory, trained tokens are the policy's and the ranker's recall@20 is on
trajectory length; `_sim_err` with `--predict`, the default).

The simulator's prediction (`--predict`): once every arm's engine is gone,
an in-process instance on the generator's core is profiled (PTL(BS) and
prefill, experiments/sim/calibrate_arms.py's `measure_generator`), and each
mode's samples/s is predicted from the parts measured alone in the blocks
(generator alone, trainer alone, and on every core for colocated, one push
per block) as experiments/sim/calibrate_sim.py predicts, on the mode's own
output and prompt lengths (`modes_arms.predict_modes`): `<mode>_sim_err` is
predicted / measured - 1. Unlike calibrate_sim, the overlapping modes
(stream, async) get the sides' isolated speeds, not their speeds while both
run.

The mid-scale benchmark model (`--model=mid`, experiments/harness.py's
`MODEL_PRESETS`; its warm start is cached in --workdir under the same name
bench_skew and length_stats use, so a cached one can be copied in):

  python experiments/bench/bench_modes.py --model=mid --workdir=/tmp/streamrl_bench_modes_mid

The agentic workload (multi-turn trajectories with the calculator, a slow
tool standing in for a search API or code runner):

  python experiments/bench/bench_modes.py --config=agentic \
      --override=env.extra_tool_latency_s=0.2 --modes=colocated,async,async_partial
"""

import json
import os
import statistics

from absl import app, flags, logging as absl_logging

from experiments import harness
from experiments.bench.modes_arms import AloneArms, Arm, predict_modes, rss_gib

# The colocated engine runs in this process (as the Ray actors run theirs):
# no engine-core process, fast start-up. Set before vLLM is imported.
harness.engines_in_process()

from streamrl.workload import (
    MODES,
    Workload,
    config_json,
    describe,
    make_settings,  # noqa: E402
    now,
    precompile,
    with_mode,
)

_MODES = flags.DEFINE_list("modes", list(MODES), "Modes to run.")
_BLOCKS = flags.DEFINE_integer(
    "blocks", 2, "Blocks: every arm runs once per block, in rotating order."
)
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed iterations at the start of each arm's block.")
_ITERATIONS = flags.DEFINE_integer("iterations", 8, "Timed iterations per arm and block.")
_PROMPTS = flags.DEFINE_integer("prompts", None, "trainer.prompts_per_iteration (config's: 64).")
_MINI = flags.DEFINE_integer(
    "mini_batch", None, "trainer.mini_batch_size (= micro_batch_size; config's: 32 and 8)."
)
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", None, "engine.max_num_seqs: requests in flight per instance."
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "sampling.max_tokens (config's: 320).")
_PPO_EPOCHS = flags.DEFINE_integer("ppo_epochs", None, "trainer.ppo_epochs (config's: 2).")
_PLOT = flags.DEFINE_bool("plot", True, "Draw the timeline PNGs.")
_LOG_COMPILES = flags.DEFINE_bool(
    "log_compiles", False, "Log every JAX compile after the precompile step."
)
_PREDICT = flags.DEFINE_bool(
    "predict",
    True,
    "After the blocks, profile the generator and print the simulator's samples/s per mode "
    "against the measured (modes_arms.predict_modes).",
)
_PRECOMPILE_TOKENS = flags.DEFINE_integer(
    "precompile_tokens",
    None,
    "Longest response the jit caches are filled for before the arms (default: "
    "sampling.max_tokens). A policy whose responses stay far shorter (the mid model's) needs "
    "only the short buckets; a longer one pays its compile when met.",
)
_PROFILE_REPS = flags.DEFINE_integer("profile_reps", 2, "Repetitions per PTL(BS) timing.")
_COLOC_THREADS = flags.DEFINE_integer(
    "colocated_engine_threads",
    1,
    "torch threads of colocated's in-process engine (its JAX trainer uses both cores either way).",
)


def load_config():
  prompts, mini, blocks = _PROMPTS.value, _MINI.value, _BLOCKS.value
  warm, iters = _WARMUP.value, _ITERATIONS.value
  if harness.QUICK.value:
    prompts, mini, blocks, warm, iters = 16, 8, 2, 1, 1
  # One more iteration than run: async starts generating the next batch
  # during the last timed iteration, as in steady state. Same value in every
  # mode (it sets the lr decay horizon).
  s = make_settings(
      prompts=prompts,
      mini_batch=mini,
      num_iterations=blocks * (warm + iters) + 1,
      max_num_seqs=_MAX_NUM_SEQS.value,
      max_tokens=_MAX_TOKENS.value,
      extra={"trainer.ppo_epochs": _PPO_EPOCHS.value} if _PPO_EPOCHS.value else None,
      overrides=harness.override_list(),
      # --config: configs/<name>.py, by name or path (ppo, grpo, agentic: multi-turn
      # trajectories with the calculator tool; env.extra_tool_latency_s a slow tool).
      config_name=os.path.splitext(os.path.basename(harness.CONFIG.value or "ppo"))[0],
  )
  return s, blocks, warm, iters


def save_timeline(res: dict, out_dir: str) -> str:
  from streamrl.pipeline.timeline import Timeline  # pylint: disable=g-import-not-at-top

  tl = Timeline()
  for stage, start, end, label in res["timeline"]:
    tl.add(stage, start, end, label)
  path = os.path.join(out_dir, f"timeline_{res['mode']}.json")
  origin = res["windows"][0][1]
  tl.to_json(path, origin=origin)
  res["timeline_json"] = path
  res["origin"] = origin
  return path


def precompile_bounded(work: Workload, settings_list, num_batches: int) -> None:
  """`workload.precompile`, its samples bounded by the longest prompt plus
  --precompile_tokens instead of sampling.max_tokens (the settings, hence the
  jitted programs' static arguments, stay the arms' own)."""
  longest = max(
      len(work.tokenizer.encode_prompt(ex.prompt))
      for batch in work.batches(num_batches)
      for ex in batch
  )
  s0, t0 = work.s, now()
  distinct = {}
  for x in settings_list:
    distinct.setdefault(x.loss.resolved(x.pipeline.mode), x)
  for x in distinct.values():
    trainer = work.trainer(x)
    trainer.warm_up(
        longest + _PRECOMPILE_TOKENS.value,
        chunk_sizes=sorted({s0.samples_per_iteration, s0.trainer.mini_batch_size}),
        snapshot_copies=(True, False),
    )
    trainer.export_weights()
  print(
      f"precompiled {len(distinct)} trainer config(s) for samples of up to "
      f"{longest + _PRECOMPILE_TOKENS.value} tokens ({now() - t0:.0f} s)",
      flush=True,
  )


def simulate(work: Workload, s, results: dict, alone: AloneArms, out: str) -> dict:
  """The generator's PTL profile (an in-process instance on the generator's
  core, once every arm's engine is gone), then the simulator's prediction of
  each mode from the costs measured alone (`modes_arms.predict_modes`),
  printed against the measured samples/s."""
  from experiments.sim.calibrate_arms import measure_generator  # pylint: disable=g-import-not-at-top
  from streamrl import cluster  # pylint: disable=g-import-not-at-top
  from streamrl.workload import generator_cores, unpin  # pylint: disable=g-import-not-at-top

  t0 = now()
  prompt = statistics.fmean(n for b in alone.per_batch for n in b["prompt_lens"])
  cluster.pin_process_threads(generator_cores(s))
  try:
    profile = measure_generator(
        work, int(round(prompt)), os.path.join(out, "profile.json"), _PROFILE_REPS.value
    )
  finally:
    work.close_local()
    unpin()
  predicted = predict_modes(s, results, alone, profile)
  print(
      f"\nsimulator (profile {now() - t0:.0f} s; PTL ms "
      + " ".join(f"{b}:{1e3 * t:.1f}" for b, t in zip(profile.batch_sizes, profile.ptl_s))
      + f"; push {statistics.fmean(alone.push_s):.2f} s):"
  )
  print(
      f"{'mode':11s} {'measured':>8s} {'predicted':>9s} {'error':>7s} {'sim gen s':>9s} "
      f"{'sim train s':>11s}"
  )
  for m, p in predicted.items():
    meas = results[m]["samples_per_s"]
    print(
        f"{m:11s} {meas:8.2f} {p['samples_per_s']:9.2f} {p['samples_per_s'] / meas - 1:+7.1%} "
        f"{p['gen_s']:9.2f} {p['train_s']:11.2f}"
    )
  return predicted


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  import logging  # pylint: disable=g-import-not-at-top

  logging.getLogger("streamrl").setLevel(logging.WARNING)
  s, blocks, warm, iters = load_config()
  modes = list(_MODES.value)
  for m in modes:
    if m not in MODES:
      raise app.UsageError(f"--modes has {m!r}; use some of {', '.join(MODES)}.")
  out = harness.out_dir()  # timelines, PNGs and summary.json
  workdir = harness.workdir("/tmp/streamrl_bench_modes")  # the warm-started policy's cache
  t_all = now()
  print(
      f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start", flush=True
  )
  print(
      f"workload: {describe(s)}; {blocks} blocks of {warm} untimed + {iters} timed iterations "
      "per arm",
      flush=True,
  )
  work = Workload(s, workdir)
  if _PRECOMPILE_TOKENS.value:
    precompile_bounded(
        work, [with_mode(s, m) for m in modes + ["sync"]], blocks * (warm + iters) + 1
    )
  else:
    precompile(work, [with_mode(s, m) for m in modes + ["sync"]], blocks * (warm + iters) + 1)
  arms = {m: Arm(work, m, _COLOC_THREADS.value) for m in modes}
  alone = AloneArms(work, every_core=_PREDICT.value and "colocated" in modes)
  if _LOG_COMPILES.value:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_log_compiles", True)
    absl_logging.set_verbosity(absl_logging.INFO)

  for b in range(blocks):
    order = modes[b % len(modes) :] + modes[: b % len(modes)]
    print(
        f"--- block {b + 1}/{blocks}: {', '.join(order)}, alone "
        f"(load {os.getloadavg()[0]:.1f}, rss {rss_gib():.1f} GiB)",
        flush=True,
    )
    for mode in order:
      arms[mode].run_block(warm + iters, warm)
    alone.run_block(warm + iters, warm)
  results = {m: arms[m].result() for m in modes}
  gen, trn = alone.results()
  predicted = {}
  if _PREDICT.value:
    try:
      predicted = simulate(work, s, results, alone, out)
    except Exception as e:  # pylint: disable=broad-except
      # The measured arms stand without it.
      print(f"simulator: no prediction ({type(e).__name__}: {e})", flush=True)

  tput = {m: results[m]["samples_per_s"] for m in modes}
  tput["gen_alone"], tput["train_alone"] = gen["samples_per_s"], trn["samples_per_s"]
  base = tput.get("colocated")
  limit = min(tput["gen_alone"], tput["train_alone"])

  # Table.
  stages = sorted({st for m in modes for st in results[m]["bubbles"]})
  head = (
      f"{'mode':11s} {'samples/s':>9s} {'vs coloc':>8s} {'gen s':>6s} {'train s':>7s} "
      f"{'push s':>6s} "
      + " ".join(f"{'idle:' + st:>15s}" for st in stages)
      + f" {'staleness':>9s} {'cpu:this':>8s} {'cpu:gen':>7s} {'it0 digest':>10s}"
  )
  print("\n" + head)
  print("-" * len(head))
  for m in modes:
    r = results[m]
    ratio = f"{tput[m] / base:8.2f}" if base else f"{'-':>8s}"
    print(
        f"{m:11s} {tput[m]:9.2f} {ratio} {r['generation_s']:6.2f} {r['training_s']:7.2f} "
        f"{r['weight_update_s']:6.2f} "
        + " ".join(f"{r['bubbles'].get(st, 1.0):15.2f}" for st in stages)
        + f" {r['staleness_mean']:9.2f} {r['cpu_this']:8.2f} {r['cpu_gen']:7.2f} "
        f"{r['digest_it0']:>10s}"
    )
  for k, name, res, cpu_k in (
      ("gen_alone", "gen alone", gen, "cpu_gen"),
      ("train_alone", "train alone", trn, "cpu_this"),
  ):
    ratio = f"{tput[k] / base:8.2f}" if base else f"{'-':>8s}"
    extra = f"  it0 digest {gen['digest_it0']}" if k == "gen_alone" else ""
    print(f"{name:11s} {tput[k]:9.2f} {ratio}   {cpu_k}={res[cpu_k]:.2f}{extra}")
  print(
      f"train alone with the Flax->HF weight export: {trn['samples_per_s_with_export']:.2f} samples/s"
  )
  # CPU work per iteration does not depend on how much of a core the
  # machine's other load left us: it shows where work grew, not time.
  print(
      "CPU seconds per timed iteration (this process / generator actor): "
      + "; ".join(
          f"{m} {results[m]['cpu_s_per_iteration'][0]:.2f}/{results[m]['cpu_s_per_iteration'][1]:.2f}"
          for m in modes
      )
      + f"; gen alone -/{gen['cpu_s_per_iteration']:.2f}; "
      f"train alone {trn['cpu_s_per_iteration']:.2f}/-"
  )
  print(
      "per timed iteration samples/s (median, min-max): "
      + "; ".join(
          f"{m} {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})"
          for m, v in ((m, results[m]["samples_per_s_per_iteration"]) for m in modes)
      )
  )
  loads = [x for m in modes for x in results[m]["load"]]
  print(f"load average during the blocks: {min(loads):.1f}-{max(loads):.1f} (2 cores)")

  # Timelines: the whole run per mode; the pictures show the last block.
  summary = {
      "config": config_json(s),
      "throughput": tput,
      "modes": {},
      "gen_alone": gen,
      "train_alone": trn,
  }
  for m in modes:
    res = results[m]
    save_timeline(res, out)
    # The last block's timed iterations (its untimed first one, on a fresh
    # engine, is slow and would squeeze the rest), with a margin before.
    last_timed = res["timed"][-iters:]
    span = last_timed[-1][2] - last_timed[0][1]
    res["plot_window"] = (
        max(last_timed[0][1] - 0.15 * span, res["windows"][-(warm + iters)][1]) - res["origin"],
        last_timed[-1][2] - res["origin"],
    )
    res["timed_windows"] = [(i, s - res["origin"], e - res["origin"]) for i, s, e in res["timed"]]
    summary["modes"][m] = {
        k: v for k, v in res.items() if k not in ("timeline", "windows", "timed")
    }
  with open(os.path.join(out, "summary.json"), "w") as f:  # what plot_summary reads
    json.dump(summary, f, indent=1, default=str)
  if _PLOT.value:
    from experiments.diag import plot_timeline  # pylint: disable=g-import-not-at-top

    pngs = plot_timeline.plot_summary(out)
    for p in pngs:
      print(f"timeline picture: {p}")
  print(f"total {now() - t_all:.0f} s, load average {os.getloadavg()[0]:.1f} at end", flush=True)

  fmt = lambda m: f"{tput[m] / base:.2f}" if (base and m in tput) else "nan"
  eff = tput["async"] / limit if "async" in tput else float("nan")
  # Each arm trains its own policy, and on the work traces the policies drift
  # apart in length: response tokens per second, next to samples per second.
  tok = {m: results[m]["tokens_per_s"] for m in modes}
  if "colocated" in tok:
    print(
        "response tokens/s vs colocated: "
        + ", ".join(f"{m} {tok[m] / tok['colocated']:.2f}" for m in modes),
        flush=True,
    )
  result = {m: fmt(m) for m in ("colocated", "sync", "stream", "async")}
  result["pipeline_efficiency"] = f"{eff:.2f}"
  if "async_partial" in tput:
    vs_async = tput["async_partial"] / tput["async"] if "async" in tput else float("nan")
    result.update(async_partial=fmt("async_partial"), partial_vs_async=f"{vs_async:.2f}")
  if "async_partial_sibling" in tput:
    vs_async = tput["async_partial_sibling"] / tput["async"] if "async" in tput else float("nan")
    result["async_partial_sibling"] = fmt("async_partial_sibling")
    result["sibling_vs_async"] = f"{vs_async:.2f}"
  if s.env.enabled:
    # A sample is a trajectory; trained tokens are the policy's (observations are masked).
    for m in modes:
      r = results[m]
      print(
          f"agentic {m}: {tput[m]:.2f} trajectories/s, {r['policy_tokens_per_s']:.1f} trained "
          f"tokens/s, {r['env_turns_mean']:.2f} turns/trajectory, engine idle on tools "
          f"{r['env_engine_idle_s']:.2f} s/iteration, ranker recall@20 on trajectory length "
          f"{r['ranker_recall20']:.2f} (oracle 1.00, random order 0.20)",
          flush=True,
      )
    for m in modes:
      result[f"{m}_trained_tokens_per_s"] = f"{results[m]['policy_tokens_per_s']:.1f}"
    recalls = [results[m]["ranker_recall20"] for m in modes]
    recalls = [r for r in recalls if r == r]
    result["ranker_recall20"] = f"{statistics.fmean(recalls) if recalls else float('nan'):.2f}"
  if predicted:
    err = {m: p["samples_per_s"] / tput[m] - 1.0 for m, p in predicted.items()}
    summary["predicted"] = predicted
    result.update({f"{m}_sim_err": f"{e:+.3f}" for m, e in err.items()})
    result["max_sim_err"] = f"{max(abs(e) for e in err.values()):.3f}"
  harness.report(out=out, summary=summary, **result)
  import ray  # pylint: disable=g-import-not-at-top

  if ray.is_initialized():
    ray.shutdown()


if __name__ == "__main__":
  app.run(main)
