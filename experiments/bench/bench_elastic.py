r"""Elastic generation end to end, and the simulator's replay of the same run.

  python experiments/bench/bench_elastic.py [--iterations=9] [--prompts=64] [--observe=3]
      [--workdir=/tmp/streamrl_bench_elastic] [--out=experiments/out/bench_elastic]

Everything real: Ray raylets (`streamrl.cluster.local.LocalCluster`: a head,
a training node in dc0, a generation node in dc1 with 2 generation slots,
token authentication on), vLLM engines on generator actors, the JAX trainer
on a trainer actor, weights through the checkpoint-transfer service. Ends
with one line

  RESULT instances_start=1 instances_max=2 lost=0 duplicated=0 version_errors=0
         calib_rel_err=<x> measured_samples_per_s=<x> predicted_samples_per_s=<x>
         two_instance_slowdown=<x> share_cost=<x> other_cores=<x> instances_end=1 wall_s=<x>

What it does:
  1. Starts the cluster (always stopped again, on errors and Ctrl-C too).
     With --pin_nodes (default) each worker node's `ray start` runs under
     `taskset`: its raylet and every actor it starts share that node's
     cores, the generation node the first core of this machine, the training
     node the second. A node's CPU count then means what it says, as on a
     real cluster; unpinned, the two instances of a sync run would spread
     over both cores while the trainer idles.
  2. Runs `launch/main.py --config=configs/ppo.py` against it as a
     subprocess, the way a user joins (the address on the command line,
     RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH in the environment):
     pipeline.mode sync, one generator instance to start with,
     elastic.enabled with 1..2 instances, elastic.observe_iterations
     --observe, no schedule: every change is the policy's. The workload is
     generation-bound: the tiny PPO policy (actor, critic, reference) without
     warm start (outputs of ~30-43 of max_tokens=56 tokens), one request in
     flight per instance (engine.max_num_seqs=1), one PPO epoch over one
     mini-batch of the 64 samples: generation ~4x training per iteration.
     So the policy adds an instance after its first full window; the two
     instances time-share the generation node's core, save nothing, and
     the policy releases the added one a window later (cooldown 4: no
     second try within 9 iterations).
  3. Reads the run: metrics.jsonl (per-iteration scalars and `wall_time`),
     elastic.jsonl (the changes and their reasons) and the TensorBoard
     histograms `response_length` and `staleness` (per-sample values,
     bucketed; their min and max are exact).
       instances_start: generators/instances of iteration 0 (logged before
         the policy's change after an iteration: the count that served it);
       instances_max: the most over the iterations and elastic.jsonl;
       lost: sum over the configured iterations of max(0, expected -
         samples/count), expected = prompts_per_iteration * group_size; an
         iteration without a metrics row (the run died) loses all of it;
       duplicated: sum of samples/duplicated;
       version_errors: samples whose staleness (iteration - weight version)
         lies outside the mode's bound, [0, 0] in sync ([0, max_staleness]
         in async), counted in the staleness histograms (exact for small
         integers; 1 per iteration from staleness/max if one is missing);
       measured samples/s: total samples / summed time/iteration_s over
         iterations --warmup .. end (iteration 0 holds the trainer's XLA
         compiles and the engine's first round). time/iteration_s covers an
         iteration's generation, training and weight push; what happens
         between iterations (the policy, an added instance's start-up and
         catch-up, the checkpoint; `gap s` in the table) is in neither it
         nor the simulator. `wall clock` samples/s counts it (and the final
         evaluation, ~2 s).
  4. The generator alone, on the same cluster right after the run (a
     subprocess on the training node's core, nothing else running): the
     run's StreamGenerationService, engine settings and initial policy, one
     instance, the run's first prompt batch --alone_reps times (after one
     untimed batch: a fresh engine's first rounds are slow); then, in the
     elastic run, one instance added (`add_instance`, the elastic path) and
     the same batches (same seeds, same lengths) on both.
  5. The cost models, measured on this machine: `launch/measure.py` (same
     config, the run's workdir for its cached initial policy, pinned to the
     generation node's core): the PTL(BS) profile and prefill cost of one
     in-process engine with one torch thread (as each instance has: 1 CPU
     over 2 slots, at least 1), and the trainer's forward and update seconds
     per token on one real batch. As in experiments/sim/calibrate_sim.py, the
     profile gets a per-request cost (request set-up, first step, output
     processing, the sample's trip through Ray), the one-instance
     generator-alone batches minus their replay with the profile alone; if
     that comes out negative (the profile's timings last well under a
     second and catch the machine's slow moments), the profile is scaled
     to those batches instead. The weight push is the run's median
     time/weight_update_s over the measured iterations (export, publish,
     every instance's verified load): a measured input, not fitted.
     `streamrl.sim.calibrate.predict_elastic_throughput` then replays the
     run: the ElasticPolicy with the run's `elastic.*` settings, free slots =
     2 - instances, gen_cores = the generation node's CPUs in instance
     threads (1: the instances time-share one core), share_cost = what
     that time-sharing costs over perfect sharing, measured on the
     generator-alone batches of step 4 (two instances' time over the
     simulator's replay of them, relative to the same ratio on one
     instance; floored at 1), added_round_s = what the added instance's
     first round took over the later two-instance rounds (a fresh engine's
     slow start; floored at 0), batch, mini-batches,
     in-flight cap, and per iteration the run's own output lengths (rebuilt
     from that iteration's `response_length` histogram: exact below ~10
     tokens, within a ~10 % bucket above; the rebuilt mean is checked against
     response_length/mean) with the batch's mean prompt length.
     calib_rel_err = |predicted - measured| / measured samples/s, same window.
  6. Prints per iteration measured vs predicted (instances, gen s, train s,
     iteration s) with the cores other jobs kept busy meanwhile (/proc/stat
     minus this process tree), both sets of decisions, the generator-alone
     comparison (one instance, two instances, the added one's first round;
     two_instance_slowdown = two instances' batch time / one's, where
     perfect sharing says 1.0; the prediction with share_cost 1 for
     comparison; other_cores = the mean of `other` over the
     measured iterations) and the RESULT line; writes summary.json and
     costs.json under --out.

The steps live in elastic_setup.py (options, the pinned cluster, the launch),
elastic_costs.py (the cost measurements), elastic_analysis.py (the run read
back, the replay, the tables) and elastic_run.py (`run`, all of it in order),
which experiments/sim/calibrate_sim.py calls for its cluster arms.

With --trainer_processes=2 (experiments/sim/calibrate_sim.py's sync_2train arm,
with --warmup=2: the sharded programs also compile in iteration 1) the run is
sync with elastic generation off and two trainer processes
(cluster.trainer_processes=2; the training node gets two training slots and
a CPU for each, both processes on its one core). launch/measure.py times the
trainer in one process; what the second process adds (gloo collectives, the
operations sent to it, two processes sharing the core: ~2.5x here) is then
measured apart, on a second, shorter run of the same config on the same
cluster (another seed, so other prompts and lengths; --trainer_alone_iterations,
the first two left out): its time/training_s per trained token, whose median
rescales the forward and update costs before the simulator replays the run.

--costs_from=<an earlier run's summary.json> (same flags) uses that run's
cost measurements instead of measuring them again: launch/measure.py's and,
with --trainer_processes > 1, the trainer alone's (the calibration's later
repeats: costs measured once on this machine, apart from every run they
predict; ~1.5 minutes saved per repeat, ~4.5 with two trainer processes).
The generator-alone batches are measured in every run.

About 5-6 minutes on the 2-core machine (9-10 with --trainer_processes=2),
~10 when other jobs keep a core busy.

Measured results: experiments/RESULTS.md (section bench_elastic.py).
"""

from __future__ import annotations

import sys

from absl import app, flags, logging as absl_logging

from experiments import harness
from experiments.bench import elastic_run
from experiments.bench.elastic_setup import Options

_ITERATIONS = flags.DEFINE_integer(
    "iterations", Options.iterations, "trainer.num_iterations of the run."
)
_PROMPTS = flags.DEFINE_integer("prompts", Options.prompts, "trainer.prompts_per_iteration.")
_MINI = flags.DEFINE_integer(
    "mini_batch", Options.mini_batch, "trainer.mini_batch_size (= micro_batch_size); one PPO epoch."
)
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", Options.max_num_seqs, "engine.max_num_seqs: requests in flight per instance."
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", Options.max_tokens, "sampling.max_tokens.")
_WARMSTART = flags.DEFINE_integer(
    "warmstart_steps",
    Options.warmstart_steps,
    "warmstart.steps (0: untrained policy, long outputs).",
)
_OBSERVE = flags.DEFINE_integer(
    "observe",
    Options.observe,
    "elastic.observe_iterations (medians over 3 iterations shrug off one slow iteration).",
)
_COOLDOWN = flags.DEFINE_integer("cooldown", Options.cooldown, "elastic.cooldown_iterations.")
_MIN_GAIN = flags.DEFINE_float("min_gain", Options.min_gain, "elastic.min_gain.")
_SLOTS = flags.DEFINE_integer(
    "slots", Options.slots, "Generation slots of the generation node (= elastic.max_instances)."
)
_WARMUP = flags.DEFINE_integer(
    "warmup", Options.warmup, "Leading iterations left out of the measured and predicted samples/s."
)
_PIN = flags.DEFINE_bool(
    "pin_nodes",
    Options.pin_nodes,
    "Run each worker node on cores of its own (taskset), as its CPUs say.",
)
_MEASURE_REPS = flags.DEFINE_integer(
    "measure_reps",
    Options.measure_reps,
    "launch/measure.py --reps (its PTL timings are short: more is steadier).",
)
_TIMEOUT = flags.DEFINE_integer("timeout_s", Options.timeout_s, "Longest the run may take.")
_TRAINER_PROCESSES = flags.DEFINE_integer(
    "trainer_processes",
    Options.trainer_processes,
    "cluster.trainer_processes of the run. Above 1 the run is the calibration's "
    "trainer-processes arm: elastic generation off (one instance throughout), the "
    "processes sharing the training node's core; the trainer's costs then come from "
    "another, shorter run of the same trainer (--trainer_alone_iterations).",
)
_TRAINER_ALONE_ITERATIONS = flags.DEFINE_integer(
    "trainer_alone_iterations",
    Options.trainer_alone_iterations,
    "With --trainer_processes > 1: iterations of the separate run whose training "
    "phases (after its first two, which compile) give the trainer's seconds per token.",
)
_COSTS_FROM = flags.DEFINE_string(
    "costs_from",
    "",
    "The summary.json of an earlier run with the same flags whose cost measurements "
    "(launch/measure.py's, the trainer alone's) to use instead of measuring again.",
)


def options() -> Options:
  """The flags as elastic_run's Options (--reps: the generator-alone batches on
  one instance and on two; --override: extra config overrides for the run and
  the measurement)."""
  return Options(
      workdir=harness.workdir(Options.workdir),
      out=harness.out_dir(Options.out),
      iterations=_ITERATIONS.value,
      prompts=_PROMPTS.value,
      mini_batch=_MINI.value,
      max_num_seqs=_MAX_NUM_SEQS.value,
      max_tokens=_MAX_TOKENS.value,
      warmstart_steps=_WARMSTART.value,
      observe=_OBSERVE.value,
      cooldown=_COOLDOWN.value,
      min_gain=_MIN_GAIN.value,
      slots=_SLOTS.value,
      warmup=_WARMUP.value,
      pin_nodes=_PIN.value,
      measure_reps=_MEASURE_REPS.value,
      timeout_s=_TIMEOUT.value,
      overrides=harness.overrides(),
      alone_reps=harness.reps(Options.alone_reps),
      trainer_processes=_TRAINER_PROCESSES.value,
      trainer_alone_iterations=_TRAINER_ALONE_ITERATIONS.value,
      costs_from=_COSTS_FROM.value,
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  o = options()
  summary = elastic_run.run(o)
  harness.report(out=o.out, summary=summary, **summary["result"])
  if summary["exit_code"] != 0:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
