r"""Elastic generation end to end, and the simulator's replay of the same run.

  python experiments/bench_elastic.py [--iterations=9] [--prompts=64] [--observe=3]
      [--workdir=/tmp/streamrl_bench_elastic] [--out=experiments/out/bench_elastic]

Everything real: Ray raylets (`streamrl.local_cluster.LocalCluster`: a head,
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
     per token on one real batch. As in experiments/calibrate_sim.py, the
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

With --trainer_processes=2 (experiments/calibrate_sim.py's sync_2train arm,
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

import collections
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags, logging as absl_logging  # pylint: disable=wrong-import-position

from streamrl import local_cluster  # pylint: disable=wrong-import-position

_WORKDIR = flags.DEFINE_string(
    "workdir",
    "/tmp/streamrl_bench_elastic",
    "Root of the cluster's and the run's directories (a fresh run directory each time).",
)
_OUT = flags.DEFINE_string(
    "out",
    os.path.join(ROOT, "experiments", "out", "bench_elastic"),
    "Where summary.json and costs.json go.",
)
_ITERATIONS = flags.DEFINE_integer("iterations", 9, "trainer.num_iterations of the run.")
_PROMPTS = flags.DEFINE_integer("prompts", 64, "trainer.prompts_per_iteration.")
_MINI = flags.DEFINE_integer(
    "mini_batch", 64, "trainer.mini_batch_size (= micro_batch_size); one PPO epoch."
)
_MAX_NUM_SEQS = flags.DEFINE_integer(
    "max_num_seqs", 1, "engine.max_num_seqs: requests in flight per instance."
)
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 56, "sampling.max_tokens.")
_WARMSTART = flags.DEFINE_integer(
    "warmstart_steps", 0, "warmstart.steps (0: untrained policy, long outputs)."
)
_OBSERVE = flags.DEFINE_integer(
    "observe",
    3,
    "elastic.observe_iterations (medians over 3 iterations shrug off one slow iteration).",
)
_COOLDOWN = flags.DEFINE_integer("cooldown", 4, "elastic.cooldown_iterations.")
_MIN_GAIN = flags.DEFINE_float("min_gain", 0.5, "elastic.min_gain.")
_SLOTS = flags.DEFINE_integer(
    "slots", 2, "Generation slots of the generation node (= elastic.max_instances)."
)
_WARMUP = flags.DEFINE_integer(
    "warmup", 1, "Leading iterations left out of the measured and predicted samples/s."
)
_PIN = flags.DEFINE_bool(
    "pin_nodes", True, "Run each worker node on cores of its own (taskset), as its CPUs say."
)
_REPS = flags.DEFINE_integer(
    "measure_reps", 5, "launch/measure.py --reps (its PTL timings are short: more is steadier)."
)
_TIMEOUT = flags.DEFINE_integer("timeout_s", 1500, "Longest the run may take.")
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "Extra config overrides key=value, for the run and the measurement."
)
_ALONE_REPS = flags.DEFINE_integer(
    "alone_reps", 3, "Timed batches of the generator alone, on one instance and on two."
)
_TRAINER_PROCESSES = flags.DEFINE_integer(
    "trainer_processes",
    1,
    "cluster.trainer_processes of the run. Above 1 the run is the calibration's "
    "trainer-processes arm: elastic generation off (one instance throughout), the "
    "processes sharing the training node's core; the trainer's costs then come from "
    "another, shorter run of the same trainer (--trainer_alone_iterations).",
)
_TRAINER_ALONE_ITERATIONS = flags.DEFINE_integer(
    "trainer_alone_iterations",
    5,
    "With --trainer_processes > 1: iterations of the separate run whose training "
    "phases (after its first two, which compile) give the trainer's seconds per token.",
)
_COSTS_FROM = flags.DEFINE_string(
    "costs_from",
    "",
    "The summary.json of an earlier run with the same flags whose cost measurements "
    "(launch/measure.py's, the trainer alone's) to use instead of measuring again.",
)
_CHILD = flags.DEFINE_string(
    "child", "", "Internal: JSON arguments of the generator-alone measurement (a subprocess)."
)

GEN_CPUS = 1  # the generation node's CPUs
TRAIN_CPUS = 1  # the training node's CPUs


def now() -> float:
  return time.perf_counter()


def log(msg: str) -> None:
  print(msg, flush=True)


# ------------------------------------------------------------------ cluster
class PinnedCluster(local_cluster.LocalCluster):
  """A LocalCluster whose worker nodes each run on given cores: `ray start`
  runs under `taskset`, and its raylet and every worker it spawns inherit
  the mask."""

  def __init__(self, nodes, *, cores: dict[str, tuple[int, ...]], **kwargs):
    super().__init__(nodes, **kwargs)
    self.cores = cores

  def _command(self, node, head):
    cmd = super()._command(node, head)
    cores = self.cores.get(node.name)
    if cores:
      cmd = ["taskset", "-c", ",".join(map(str, cores))] + cmd
    return cmd


def node_cores(pin: bool) -> dict[str, tuple[int, ...]]:
  """{node name: cores}: generation node first cores, training node the next."""
  if not pin:
    return {}
  cores = sorted(os.sched_getaffinity(0))
  if len(cores) < (os.cpu_count() or 1):
    log(
        f"warning: this process may run on cores {cores} of the machine's {os.cpu_count()} "
        "(a parent pinned it); the nodes are pinned within those."
    )
  if len(cores) < GEN_CPUS + TRAIN_CPUS or shutil.which("taskset") is None:
    log(
        f"warning: cannot pin the nodes ({len(cores)} cores, taskset "
        f"{'found' if shutil.which('taskset') else 'missing'}); they share every core."
    )
    return {}
  return {
      "generator": tuple(cores[:GEN_CPUS]),
      "trainer": tuple(cores[GEN_CPUS : GEN_CPUS + TRAIN_CPUS]),
  }


# ------------------------------------------------------------- other jobs
class CpuMonitor(threading.Thread):
  """Samples once a second the machine's busy CPU seconds (/proc/stat) and
  the CPU seconds of this process's descendants (the cluster, the run, the
  measurements); the difference is what other jobs on the machine used."""

  def __init__(self, period_s: float = 1.0):
    super().__init__(daemon=True)
    self.period_s = period_s
    self.samples: list[tuple[float, float, float]] = []  # (unix time, busy s, ours s)
    self._ours: dict[int, float] = {}  # pid -> its last CPU seconds
    self._stop_event = threading.Event()
    self._tick = os.sysconf("SC_CLK_TCK")

  def _busy(self) -> float:
    with open("/proc/stat") as f:
      v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...: all but idle and iowait
    return (sum(v[:8]) - v[3] - v[4]) / self._tick

  def _descendants(self) -> None:
    procs = {}
    for name in os.listdir("/proc"):
      if not name.isdigit():
        continue
      try:
        with open(f"/proc/{name}/stat") as f:
          rest = f.read().rsplit(")", 1)[1].split()
      except OSError:
        continue
      procs[int(name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / self._tick)
    mine = {os.getpid()}
    children = collections.defaultdict(list)
    for pid, (ppid, _) in procs.items():
      children[ppid].append(pid)
    todo = [os.getpid()]
    while todo:
      for c in children.get(todo.pop(), []):
        if c not in mine:
          mine.add(c)
          todo.append(c)
    for pid in mine:
      self._ours[pid] = procs[pid][1] if pid in procs else self._ours.get(pid, 0.0)

  def sample(self) -> None:
    self._descendants()
    self.samples.append((time.time(), self._busy(), sum(self._ours.values())))

  def run(self) -> None:
    while not self._stop_event.is_set():
      self.sample()
      self._stop_event.wait(self.period_s)

  def stop(self) -> None:
    self._stop_event.set()
    self.join()
    self.sample()

  def others(self, t0: float, t1: float) -> float | None:
    """Cores other jobs kept busy on average between unix times t0 and t1."""
    import numpy as np  # pylint: disable=g-import-not-at-top

    if len(self.samples) < 2 or t1 - t0 < 2 * self.period_s:
      return None
    if t0 < self.samples[0][0] - self.period_s or t1 > self.samples[-1][0] + self.period_s:
      return None
    t, busy, ours = (np.asarray(x) for x in zip(*self.samples))
    b = np.interp([t0, t1], t, busy)
    o = np.interp([t0, t1], t, ours)
    return max(0.0, float((b[1] - b[0]) - (o[1] - o[0])) / (t1 - t0))


# ---------------------------------------------------------------- overrides
def workload_overrides() -> dict:
  """The config overrides of the run (and of the measurement, minus the cluster)."""
  out = {
      "pipeline.mode": "sync",
      "warmstart.steps": _WARMSTART.value,
      "trainer.num_iterations": _ITERATIONS.value,
      "trainer.prompts_per_iteration": _PROMPTS.value,
      "trainer.mini_batch_size": _MINI.value,
      "trainer.micro_batch_size": _MINI.value,
      "trainer.ppo_epochs": 1,
      "engine.max_num_seqs": _MAX_NUM_SEQS.value,
      "sampling.max_tokens": _MAX_TOKENS.value,
      "engine.num_instances": 1,
      "transfer.enabled": True,
      "elastic.enabled": _TRAINER_PROCESSES.value == 1,
      "elastic.min_instances": 1,
      "elastic.max_instances": _SLOTS.value,
      "elastic.observe_iterations": _OBSERVE.value,
      "elastic.cooldown_iterations": _COOLDOWN.value,
      "elastic.min_gain": _MIN_GAIN.value,
      "task.num_eval": 8,
      "log.eval_every": 0,
      "log.progress": False,
  }
  if _TRAINER_PROCESSES.value > 1:
    out["cluster.trainer_processes"] = _TRAINER_PROCESSES.value
  for item in _OVERRIDES.value:
    key, sep, value = item.partition("=")
    if not sep:
      raise app.UsageError(f"--override={item!r} is not key=value.")
    out[key.strip()] = value.strip()
  return out


def as_flags(overrides: dict) -> list[str]:
  return [
      f"--config.{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in overrides.items()
  ]


def typed_settings(overrides: dict):
  from streamrl import config_utils, settings  # pylint: disable=g-import-not-at-top

  config = config_utils.load_config(os.path.join(ROOT, "configs", "ppo.py"))
  return settings.from_config(config_utils.apply_overrides(config, overrides))


# -------------------------------------------------------------------- steps
def run_elastic(c, run_dir: str, overrides: dict, log_path: str) -> int:
  """launch/main.py against the cluster; its output goes to `log_path`."""
  args = [sys.executable, os.path.join(ROOT, "launch", "main.py")]
  args += [f"--config={os.path.join(ROOT, 'configs', 'ppo.py')}", f"--workdir={run_dir}"]
  args += as_flags({**overrides, "cluster.address": c.address})
  with open(log_path, "w") as out:
    try:
      res = subprocess.run(
          args,
          env={**os.environ, **c.env()},
          stdout=out,
          stderr=subprocess.STDOUT,
          timeout=_TIMEOUT.value,
          cwd=ROOT,
      )
    except subprocess.TimeoutExpired:
      log(f"the run took longer than --timeout_s={_TIMEOUT.value}; stopped it.")
      return 124
  return res.returncode


def measure_costs(run_dir: str, overrides: dict, out_path: str, cores) -> dict:
  """launch/measure.py (the run's config and cached initial policy) on `cores`;
  the trainer's costs are those of one process (what a multi-process trainer
  adds is not in them)."""
  args = [sys.executable, os.path.join(ROOT, "launch", "measure.py")]
  args += [f"--config={os.path.join(ROOT, 'configs', 'ppo.py')}", f"--out={out_path}"]
  args += [f"--workdir={run_dir}", f"--reps={_REPS.value}"]
  args += as_flags({**overrides, "cluster.trainer_processes": 1})
  if cores:
    args = ["taskset", "-c", ",".join(map(str, cores))] + args
  res = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
  if res.returncode != 0:
    raise RuntimeError(f"launch/measure.py failed:\n{(res.stdout + res.stderr)[-3000:]}")
  for line in res.stdout.splitlines():
    if line.startswith(("generated", "wrote")):
      log(f"  measure: {line}")
  with open(out_path) as f:
    return json.load(f)


def trainer_alone(c, base: str, overrides: dict, s) -> dict:
  """The multi-process trainer's seconds per token, measured apart from the run
  it predicts: a second, shorter run of the same config on the same cluster
  (another seed, so other prompts and lengths; sync mode, so its training
  phases run with the generator idle): time/training_s, samples and mean
  response length of each iteration after its first two (which compile the
  sharded programs); `with_trainer_alone` makes seconds per token of them."""
  run_dir = os.path.join(base, "trainer_alone")
  extra = {
      **overrides,
      "seed": s.seed + 1,
      "trainer.num_iterations": _TRAINER_ALONE_ITERATIONS.value,
  }
  log_path = os.path.join(base, "trainer_alone.log")
  rc = run_elastic(c, run_dir, extra, log_path)
  if rc != 0:
    with open(log_path, errors="replace") as f:
      raise RuntimeError(f"the trainer-alone run failed (exit {rc}):\n{f.read()[-3000:]}")
  rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "samples/count" in r]
  rows = sorted(rows, key=lambda r: r["step"])[2:]
  if not rows:
    raise RuntimeError(
        "the trainer-alone run has no iteration after its first two; raise "
        "--trainer_alone_iterations."
    )
  its = [
      {k: r[k] for k in ("time/training_s", "samples/count", "response_length/mean")} for r in rows
  ]
  return {"iterations": its, "log": log_path}


def earlier_costs(path: str, overrides: dict) -> dict:
  """The cost measurements of an earlier run (its summary.json), checked to be
  of the same workload: costs measured once, on this machine, apart from the
  runs they predict. Returns {"costs": launch/measure.py's, "trainer_alone":
  the multi-process trainer's or None, "from": path}."""
  try:
    with open(path) as f:
      earlier = json.load(f)
  except (OSError, ValueError) as e:
    raise app.UsageError(
        f"--costs_from={path} cannot be read ({e}); pass the summary.json of an "
        "earlier run that completed."
    ) from e
  if not isinstance(earlier, dict) or not isinstance(earlier.get("costs_measured"), dict):
    raise app.UsageError(
        f"--costs_from={path} holds no cost measurements; pass the summary.json of an "
        "earlier run that completed."
    )
  alone = earlier.get("trainer_alone")
  if _TRAINER_PROCESSES.value > 1 and (not isinstance(alone, dict) or not alone.get("iterations")):
    raise app.UsageError(
        f"--costs_from={path} holds no trainer-alone measurement; pass the summary.json of an "
        f"earlier --trainer_processes={_TRAINER_PROCESSES.value} run."
    )
  overrides = json.loads(json.dumps(overrides, default=str))  # as summary.json holds them
  if earlier.get("overrides") != overrides:
    diff = sorted(
        k
        for k in set(overrides) | set(earlier.get("overrides") or {})
        if overrides.get(k) != (earlier.get("overrides") or {}).get(k)
    )
    raise app.UsageError(
        f"--costs_from={path} measured another workload (settings {', '.join(diff)} "
        "differ); run without it or pass the same flags as that run."
    )
  if alone is not None:
    alone = {"iterations": alone["iterations"], "log": alone.get("log"), "from": path}
  return {"costs": earlier["costs_measured"], "trainer_alone": alone, "from": path}


def with_trainer_alone(costs: dict, alone: dict) -> dict:
  """`costs` with the trainer's forward and update seconds per token (prompt +
  response, the prompt's mean length as launch/measure.py saw it) scaled, in
  launch/measure.py's one-process proportion, to the median of `alone`'s."""
  prompt = costs["generation"]["mean_prompt_len"]
  per_token = [
      x["time/training_s"] / (x["samples/count"] * (prompt + x["response_length/mean"]))
      for x in alone["iterations"]
  ]
  from streamrl.sim.calibrate import rescale_trainer  # pylint: disable=g-import-not-at-top

  alone["per_token"] = per_token
  alone["s_per_token"] = statistics.median(per_token)
  return dict(costs, trainer=rescale_trainer(costs["trainer"], alone["s_per_token"]))


def generator_alone_child(args: dict) -> None:
  """The generator alone, through the run's own path (this runs as a
  subprocess on the training node's cores, where the trainer ran, joined to
  the run's cluster): a StreamGenerationService as the run builds it (the
  run's engine settings, its initial policy, one instance on the generation
  node, samples streamed back through Ray), warmed up on one untimed batch,
  then the run's first prompt batch `reps` times; then one instance added
  (the elastic path) and the same batches again on both, the first of them
  the new instance's first round. Nothing else runs on the cluster. Writes
  the batch times and lengths to args["out"]."""
  os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
  from streamrl.workload import Workload  # pylint: disable=g-import-not-at-top
  from streamrl import cluster as cluster_lib  # pylint: disable=g-import-not-at-top
  from streamrl.generator.local import round_seed  # pylint: disable=g-import-not-at-top
  from streamrl.generator.service import StreamGenerationService  # pylint: disable=g-import-not-at-top

  s = typed_settings(args["overrides"])
  work = Workload(s, args["run_dir"])  # the run's cached initial policy, its prompts
  info = cluster_lib.init_ray_for(s.cluster)
  t0 = now()
  svc = StreamGenerationService(
      work.model_dir,
      s.engine,
      dtype=s.model.dtype,
      seed=s.seed,
      cluster=info,
      stall_timeout_s=s.pipeline.stall_timeout_s,
      log_dir=args["log_dir"],
      placement=s.cluster,
      max_instances=s.elastic.max_instances,
  )
  out = {"start_s": now() - t0, "one": [], "two": []}
  try:
    requests, _ = work.requests(work.batches(1)[0])

    def batch(k: int) -> dict:
      t0 = now()
      got = {q.prompt_id: q for q in svc.generate(requests, s.sampling, seed=round_seed(s.seed, k))}
      dt = now() - t0
      order = [got[rid] for rid, _ in requests]
      return {
          "gen_s": dt,
          "prompt_lens": [len(q.prompt_token_ids) for q in order],
          "output_lens": [max(1, len(q.token_ids)) for q in order],
          "instances": len(svc.live_instances),
      }

    # The first generations on a fresh engine are slow: one whole batch untimed.
    batch(10_000)
    out["one"] = [batch(k) for k in range(args["reps"])]
    if args["two"]:
      t0 = now()
      svc.add_instance("bench: two instances sharing the generation node")
      out["add_s"] = now() - t0
      out["two"] = [batch(k) for k in [0] + list(range(args["reps"]))]
    out["placement"] = {
        i: {k: svc.placement[i].get(k) for k in ("cores", "datacenter", "pid")}
        for i in svc.live_instances
    }
  finally:
    svc.close()
  with open(args["out"], "w") as f:
    json.dump(out, f)


def elastic_run() -> bool:
  """Whether the run is the elastic one (one trainer process): the multi-process
  trainer's run keeps one generator instance throughout."""
  return _TRAINER_PROCESSES.value == 1


def generator_alone(c, run_dir: str, overrides: dict, out_path: str, cores) -> dict:
  """Runs `generator_alone_child` against cluster `c`, on `cores`."""
  child = {
      "run_dir": run_dir,
      "overrides": {**overrides, "cluster.address": c.address},
      "out": out_path,
      "log_dir": os.path.dirname(out_path),
      "reps": _ALONE_REPS.value,
      "two": elastic_run(),  # a second instance only where the run can add one
  }
  args = [sys.executable, os.path.abspath(__file__), "--child=" + json.dumps(child)]
  if cores:
    args = ["taskset", "-c", ",".join(map(str, cores))] + args
  res = subprocess.run(
      args,
      env={**os.environ, **c.env()},
      capture_output=True,
      text=True,
      timeout=900,
      cwd=ROOT,
  )
  if res.returncode != 0:
    raise RuntimeError(
        f"the generator-alone measurement failed:\n{(res.stdout + res.stderr)[-3000:]}"
    )
  with open(out_path) as f:
    return json.load(f)


def gen_model(profile: dict, cap: int):
  from streamrl.sim.calibrate import from_measured  # pylint: disable=g-import-not-at-top

  gen, _ = from_measured(
      profile, {"fwd_s_per_token": 0.0, "upd_s_per_token": 0.0}, max_num_seqs=cap
  )
  return gen


def replay(profile: dict, b: dict, cap: int, cores: int | None = None) -> float:
  """The simulator's time for generator-alone batch `b` (its lengths, round-robin
  over its instances as the service plans a FIFO round)."""
  from streamrl.sim.engine import simulate_generation  # pylint: disable=g-import-not-at-top

  n, m = len(b["output_lens"]), b["instances"]
  return simulate_generation(
      gen_model(profile, cap),
      m,
      b["prompt_lens"],
      b["output_lens"],
      queues=[list(range(i, n, m)) for i in range(m)],
      caps=[cap] * m,
      cores=cores,
  ).makespan


def with_request_cost(costs: dict, alone: dict, cap: int) -> tuple[dict, float, float]:
  """The PTL profile plus a per-request cost, as experiments/calibrate_sim.py
  derives it: the profile's two-length slope cancels whatever does not scale
  with decode steps (request set-up, the first step, output processing, the
  sample's trip through Ray to the trainer), so each one-instance
  generator-alone batch is replayed with the profile alone, and the median
  difference per request is that cost. The simulator charges it with the
  prefill, per prompt token (exact on average over the batch's prompts).
  A negative difference means the profile's short timings (well under a
  second here) caught a slow moment of this shared machine: the profile is
  then scaled down to the batches instead (PTL and prefill alike).
  Returns (profile, seconds per request, the scale: 1 unless scaled)."""
  one = alone["one"]
  profile = dict(costs["profile"])
  per_request = [(b["gen_s"] - replay(profile, b, cap)) / len(b["output_lens"]) for b in one]
  req, scale = statistics.median(per_request), 1.0
  if req >= 0:
    mean_prompt = statistics.fmean(p for b in one for p in b["prompt_lens"])
    profile["prefill_s_per_token"] += req / mean_prompt
  else:
    scale = statistics.median(b["gen_s"] / replay(profile, b, cap) for b in one)
    profile["ptl_s"] = [scale * x for x in profile["ptl_s"]]
    profile["prefill_s_per_token"] *= scale
  return profile, req, scale


def sharing_check(alone: dict, profile: dict, cap: int, gen_cores: int) -> dict:
  """The generator-alone batches on one and on two instances, measured and
  replayed with the run's cost model (two instances on `gen_cores` cores):
  how far the simulator's time-sharing model is from the node, with and
  without the added instance's first round (its engine is cold)."""
  one = alone["one"]
  # Batch k uses sampling seed k on either count: the same requests, the same lengths.
  cold, warm = alone["two"][0], alone["two"][1:]
  one_sim = [replay(profile, b, cap) for b in one]
  two_sim = [replay(profile, b, cap, gen_cores) for b in warm]
  # What time-sharing costs over the simulator's perfect sharing: the two
  # instances' error over the one instance's (the profile's own error cancels).
  share = statistics.median(b["gen_s"] / x for b, x in zip(warm, two_sim)) / statistics.median(
      b["gen_s"] / x for b, x in zip(one, one_sim)
  )
  return {
      "one_s": [b["gen_s"] for b in one],
      "one_sim_s": one_sim,
      "two_cold_s": cold["gen_s"],
      "two_s": [b["gen_s"] for b in warm],
      "two_sim_s": two_sim,
      "share_cost": max(1.0, share),
      "two_over_one": statistics.median(w["gen_s"] / o["gen_s"] for w, o in zip(warm, one)),
      "cold_over_two": cold["gen_s"] / statistics.median(b["gen_s"] for b in warm),
      # What the added instance's first round costs over the later ones
      # (SimConfig.added_round_s): a fresh engine is slow at first.
      "added_round_s": max(0.0, cold["gen_s"] - statistics.median(b["gen_s"] for b in warm)),
      "add_s": alone["add_s"],
      "placement": alone.get("placement", {}),
  }


def read_jsonl(path: str) -> list[dict]:
  if not os.path.isfile(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def read_histograms(run_dir: str, tags) -> dict[str, dict[int, object]]:
  """{tag: {step: HistogramValue}} from the run's TensorBoard event files."""
  from tensorboard.backend.event_processing import (  # pylint: disable=g-import-not-at-top
      event_accumulator as ea,
  )

  acc = ea.EventAccumulator(run_dir, size_guidance={ea.HISTOGRAMS: 0})
  acc.Reload()
  have = set(acc.Tags().get(ea.HISTOGRAMS, []))
  return {
      t: {e.step: e.histogram_value for e in acc.Histograms(t)} if t in have else {} for t in tags
  }


def _buckets(h):
  """(left, right, count) of a TensorBoard histogram (numpy's [left, right) bins)."""
  lefts = [-math.inf] + list(h.bucket_limit[:-1])
  return [(lo, hi, int(n)) for lo, hi, n in zip(lefts, h.bucket_limit, h.bucket) if n]


def count_outside(h, lo: int, hi: int) -> int:
  """Samples of an integer-valued histogram outside [lo, hi]."""
  if h.min >= lo and h.max <= hi:
    return 0
  bad = sum(n for left, right, n in _buckets(h) if left >= hi + 0.5 or right <= lo - 0.5)
  return max(bad, 1)  # min or max is outside: at least that one sample


def integer_values(h) -> list[int]:
  """The integers a histogram of integer values holds, rebuilt bucket by
  bucket (a bucket spanning several integers spreads its count over them)."""
  out = []
  for left, right, n in _buckets(h):
    first = math.ceil(max(left, h.min))
    last = min(math.ceil(right) - 1, math.floor(h.max))
    if last < first:  # an integer exactly on the top edge (numpy closes the last bin)
      first = last = int(round(right))
    span = last - first + 1
    out.extend(first + (k * span) // n for k in range(n))
  return out


# ----------------------------------------------------------------- analysis
def analyse_run(run_dir: str, s, warmup: int) -> dict:
  rows = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if "samples/count" in r]
  rows.sort(key=lambda r: r["step"])
  events = read_jsonl(os.path.join(run_dir, "elastic.jsonl"))
  hists = read_histograms(run_dir, ("response_length", "staleness"))
  expected = s.samples_per_iteration
  by_step = {r["step"]: r for r in rows}
  bound = (0, s.pipeline.max_staleness) if s.pipeline.mode == "async" else (0, 0)
  lost = duplicated = version_errors = from_summary = 0
  its = []
  for it in range(s.trainer.num_iterations):
    r = by_step.get(it + 1)
    if r is None:
      lost += expected
      continue
    n = int(r["samples/count"])
    lost += max(0, expected - n)
    duplicated += int(r["samples/duplicated"])
    h = hists["staleness"].get(it + 1)
    if h is not None:
      bad = count_outside(h, *bound)
    else:  # no histogram: the summary says whether any sample was outside
      bad = int(r["staleness/max"] > bound[1])
      from_summary += 1
    version_errors += bad
    lens = None
    hl = hists["response_length"].get(it + 1)
    if hl is not None:
      lens = [max(1, v) for v in integer_values(hl)]
    its.append(
        {
            "it": it,
            "samples": n,
            "instances": int(r["generators/instances"]),
            "gen_s": r["time/generation_s"],
            "train_s": r["time/training_s"],
            "push_s": r["time/weight_update_s"],
            "iter_s": r["time/iteration_s"],
            "wall_time": r["wall_time"],
            "mean_len": r["response_length/mean"],
            "output_lens": lens,
            "stale_outside": bad,
        }
    )
  for prev, cur in zip(its, its[1:]):
    # Wall time between two metrics rows beyond the later iteration's own time:
    # the policy's change (an added instance's start-up), the scalars, the checkpoint.
    cur["gap_s"] = cur["wall_time"] - prev["wall_time"] - cur["iter_s"]
  window = [x for x in its if x["it"] >= warmup]
  samples = sum(x["samples"] for x in window)
  out = {
      "iterations": its,
      "events": events,
      "lost": lost,
      "duplicated": duplicated,
      "version_errors": version_errors,
      "instances_start": its[0]["instances"] if its else 0,
      # The most at once: an iteration's count, or a change's (one made after
      # the last iteration shows only in elastic.jsonl).
      "instances_max": max(
          [x["instances"] for x in its] + [e["instances"] for e in events], default=0
      ),
      "instances_end": its[-1]["instances"] if its else 0,
      "window": [warmup, s.trainer.num_iterations],
      # Iterations whose version errors come from staleness/max (no histogram).
      "staleness_from_summary": from_summary,
  }
  if window:
    out["samples_per_s"] = samples / sum(x["iter_s"] for x in window)
    start = its[warmup - 1]["wall_time"] if warmup > 0 and len(its) >= warmup else None
    if start is not None and len(window) == len(its) - warmup:
      out["wall_samples_per_s"] = samples / (window[-1]["wall_time"] - start)
    out["push_s_median"] = statistics.median(x["push_s"] for x in window)
  return out


def policy_kwargs(s) -> dict:
  """ElasticPolicy's keywords from the run's settings, as ElasticPolicy.from_settings
  maps them (every constructor keyword that names an `elastic.*` field)."""
  import inspect  # pylint: disable=g-import-not-at-top
  from streamrl.elastic.policy import ElasticPolicy  # pylint: disable=g-import-not-at-top

  names = inspect.signature(ElasticPolicy.__init__).parameters
  out = {n: getattr(s.elastic, n) for n in names if hasattr(s.elastic, n)}
  return {"start_instances": s.engine.num_instances, **out}


def predict(
    measured: dict,
    costs: dict,
    profile: dict,
    s,
    gen_cores: int,
    warmup: int,
    share_cost: float,
    added_round_s: float = 0.0,
) -> dict:
  from streamrl.sim.calibrate import predict_elastic_throughput  # pylint: disable=g-import-not-at-top

  its = measured["iterations"]
  if len(its) != s.trainer.num_iterations or any(x["output_lens"] is None for x in its):
    raise RuntimeError("the run's per-iteration output lengths are incomplete; nothing to replay.")
  slots = _SLOTS.value
  return predict_elastic_throughput(
      profile,
      costs["trainer"],
      s.pipeline.mode,
      output_lens=None,
      output_lens_per_iteration=[x["output_lens"] for x in its],
      prompt_lens=max(1, round(costs["generation"]["mean_prompt_len"])),
      batch_size=s.samples_per_iteration,
      policy_kwargs=policy_kwargs(s),
      gen_cores=gen_cores,
      share_cost=share_cost,
      max_in_flight=s.engine.max_num_seqs,
      num_minibatches=s.samples_per_iteration // s.trainer.mini_batch_size,
      transfer_s=measured["push_s_median"],
      iterations=s.trainer.num_iterations,
      warmup=warmup,
      seed=s.seed,
      free_slots=lambda it, n: max(0, slots - n) if s.elastic.enabled else 0,
      scheduler=s.scheduler.kind if s.scheduler.kind in ("fifo", "skew") else "fifo",
      ranker_refresh_s=ranker_refresh_s(costs, s),
      added_round_s=added_round_s,
  )


def ranker_refresh_s(costs: dict, s) -> float:
  """The ranker's refresh on the generators' core after each round: measured by
  launch/measure.py when the run's skew scheduler refreshes it there."""
  if s.scheduler.kind != "skew" or s.scheduler.ranker_side != "generators":
    return 0.0
  return float(costs.get("ranker", {}).get("refresh_s", 0.0))


# ------------------------------------------------------------------- report
def print_table(measured: dict, pred: dict | None, warmup: int) -> None:
  head = (
      f"{'it':>3s} | {'inst':>4s} {'gen s':>6s} {'train s':>7s} {'push s':>6s} {'iter s':>6s} "
      f"{'gap s':>6s} {'len':>5s} {'other':>5s} | {'inst':>4s} {'gen s':>6s} {'train s':>7s} "
      f"{'iter s':>6s}"
  )
  log(f"\n{'':3s}   {'measured (the run)':<54s} | predicted (simulator)")
  log(head)
  log("-" * len(head))
  for x in measured["iterations"]:
    j = x["it"]
    p = ""
    if pred is not None and j < len(pred["instances"]):
      p = (
          f"{pred['instances'][j]:4d} {pred['gen_s'][j]:6.2f} {pred['train_s'][j]:7.2f} "
          f"{pred['iteration_s'][j]:6.2f}"
      )
    gap = f"{x['gap_s']:6.1f}" if "gap_s" in x else f"{'':6s}"
    other = f"{x['others']:5.2f}" if x.get("others") is not None else f"{'':5s}"
    log(
        f"{j:3d}{'*' if j < warmup else ' '}| {x['instances']:4d} {x['gen_s']:6.2f} "
        f"{x['train_s']:7.2f} {x['push_s']:6.2f} {x['iter_s']:6.2f} {gap} {x['mean_len']:5.1f} "
        f"{other} | {p}"
    )
  log(
      "  * warm-up, not measured. gen s / train s: time/generation_s (first request -> last\n"
      "  sample) and time/training_s (trainer busy); iter s: time/iteration_s (generation +\n"
      "  training + push; the simulator's: previous training end -> this one's, the push\n"
      "  first); gap s: wall time between iterations outside iter s (the policy, an added\n"
      "  instance's start-up and catch-up, checkpoint); len: mean output length (exact);\n"
      "  other: cores that other jobs on this machine kept busy during the iteration."
  )


def print_decisions(measured: dict, pred: dict | None) -> None:
  log("\ndecisions of the run (elastic.jsonl):")
  if not measured["events"]:
    log("  none")
  for e in measured["events"]:
    delta = {"added": +1, "removed": -1}.get(e["action"], 0)
    log(
        f"  after it {e['iteration']}: {delta:+d} ({e['action']}) -> {e['instances']}: {e['reason']}"
    )
  if pred is None:
    return
  log("decisions of the simulator (same ElasticPolicy, simulated stage times):")
  if not pred["decisions"]:
    log("  none")
  for d in pred["decisions"]:
    log(
        f"  after it {d['iteration']}: {d['delta']:+d} -> {d['instances']} (first round "
        f"{d['first_round']}): {d['reason']}"
    )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  absl_logging.set_verbosity(absl_logging.WARNING)
  if _CHILD.value:
    generator_alone_child(json.loads(_CHILD.value))
    return
  if not 0 <= _WARMUP.value < _ITERATIONS.value:
    raise app.UsageError("need 0 <= --warmup < --iterations.")
  t_all = now()
  overrides = workload_overrides()
  s = typed_settings(overrides)  # checks every value before anything starts
  earlier = earlier_costs(_COSTS_FROM.value, overrides) if _COSTS_FROM.value else None
  os.makedirs(_WORKDIR.value, exist_ok=True)
  os.makedirs(_OUT.value, exist_ok=True)
  base = tempfile.mkdtemp(prefix="bench_", dir=_WORKDIR.value)
  run_dir = os.path.join(base, "run")
  cores = node_cores(_PIN.value)
  log(
      f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; nodes: head, trainer "
      f"(dc0, {TRAIN_CPUS} CPU per trainer process, {_TRAINER_PROCESSES.value} "
      f"process(es), cores {cores.get('trainer', 'any')}), generator (dc1, "
      f"{GEN_CPUS} CPU, {_SLOTS.value} slots, cores {cores.get('generator', 'any')}); "
      f"run in {run_dir}"
  )
  monitor = CpuMonitor()
  monitor.start()
  nodes = local_cluster.default_nodes(
      generation_slots=_SLOTS.value,
      trainer_cpus=TRAIN_CPUS,
      generator_cpus=GEN_CPUS,
      training_slots=_TRAINER_PROCESSES.value,
  )
  c = PinnedCluster(nodes, workdir=os.path.join(base, "cluster"), cores=cores)
  t0 = now()
  rc, run_s, alone, phases, train_alone = None, 0.0, None, {}, None
  try:
    c.start()
    log(f"cluster up at {c.address} ({now() - t0:.0f} s); the elastic run starts")
    t1 = now()
    rc = run_elastic(c, run_dir, overrides, os.path.join(base, "run.log"))
    run_s = now() - t1
    log(f"run ended (exit {rc}) after {run_s:.0f} s; its output: {os.path.join(base, 'run.log')}")
    if rc == 0:
      log("the generator alone on the same cluster (one instance, then two) ...")
      t2 = time.time()
      alone = generator_alone(
          c, run_dir, overrides, os.path.join(base, "generator_alone.json"), cores.get("trainer")
      )
      phases["generator alone"] = (t2, time.time())
      if earlier is not None:
        train_alone = earlier["trainer_alone"]
      elif _TRAINER_PROCESSES.value > 1:
        log(f"the {_TRAINER_PROCESSES.value}-process trainer alone (a second, shorter run) ...")
        t2 = time.time()
        train_alone = trainer_alone(c, base, overrides, s)
        phases["trainer alone"] = (t2, time.time())
  finally:
    c.stop()
  if rc != 0:
    with open(os.path.join(base, "run.log"), errors="replace") as f:
      log(f.read()[-3000:])
  placement = {}
  if os.path.isfile(os.path.join(run_dir, "placement.json")):
    with open(os.path.join(run_dir, "placement.json")) as f:
      placement = json.load(f)
    where = {"trainer": placement["trainer"].get("cores")}
    where.update({f"generator {i}": g.get("cores") for i, g in placement["generators"].items()})
    log(f"cores of the trainer and the generators (placement.json): {where}")

  measured = analyse_run(run_dir, s, _WARMUP.value)
  pred = free = costs = costs_measured = profile = None
  req_s = scale = float("nan")
  # Instances time-share the generation node: its CPUs in units of one
  # instance's threads (the service gives each max(1, CPUs // slots)).
  gen_cores = max(1, GEN_CPUS // max(1, GEN_CPUS // _SLOTS.value))
  sharing = None
  if alone is not None and measured.get("samples_per_s"):
    if earlier is not None:
      costs = earlier["costs"]
      log(f"the cost models: measured by the run of {earlier['from']}")
    else:
      log("measuring the cost models (launch/measure.py) ...")
      t2 = time.time()
      costs = measure_costs(
          run_dir, overrides, os.path.join(_OUT.value, "costs.json"), cores.get("generator")
      )
      phases["measure.py"] = (t2, time.time())
    costs_measured = costs
    if train_alone is not None:
      costs = with_trainer_alone(costs, train_alone)
      log(
          f"  trainer alone, {_TRAINER_PROCESSES.value} processes: "
          f"{1e6 * train_alone['s_per_token']:.0f} us/token (iterations "
          + "/".join(f"{1e6 * x:.0f}" for x in train_alone["per_token"])
          + f"), {costs['trainer']['one_process_scale']:.2f}x launch/measure.py's one process"
      )
    cap = s.engine.max_num_seqs
    profile, req_s, scale = with_request_cost(costs, alone, cap)
    if alone.get("two"):
      sharing = sharing_check(alone, profile, cap, gen_cores)
    share_cost = sharing["share_cost"] if sharing else 1.0
    added = sharing["added_round_s"] if sharing else 0.0
    pred = predict(measured, costs, profile, s, gen_cores, _WARMUP.value, share_cost, added)
    free = predict(measured, costs, profile, s, gen_cores, _WARMUP.value, 1.0, added)
  monitor.stop()
  for x in measured["iterations"]:
    x["others"] = monitor.others(x["wall_time"] - x["iter_s"], x["wall_time"])
  phase_s = {k: v[1] - v[0] for k, v in phases.items()}
  phases = {k: monitor.others(*v) for k, v in phases.items()}

  print_table(measured, pred, _WARMUP.value)
  print_decisions(measured, pred)
  rebuilt = [
      abs(statistics.fmean(x["output_lens"]) / x["mean_len"] - 1)
      for x in measured["iterations"]
      if x["output_lens"]
  ]
  if rebuilt:
    log(f"\noutput lengths rebuilt from the histograms: mean off by at most {max(rebuilt):.1%}")
  if measured["staleness_from_summary"]:
    log(
        f"no staleness histogram for {measured['staleness_from_summary']} iterations: their "
        "version errors count 1 per iteration whose staleness/max is out of bounds"
    )
  meas = measured.get("samples_per_s", float("nan"))
  pr = pred["samples_per_s"] if pred else float("nan")
  err = abs(pr - meas) / meas if pred else float("nan")
  if costs is not None:
    ptl = lambda p: ", ".join(  # pylint: disable=unnecessary-lambda-assignment
        f"{b}:{1e3 * x:.2f}" for b, x in zip(p["batch_sizes"], p["ptl_s"])
    )
    p, t = costs["profile"], costs["trainer"]
    fix = (
        f"+ {1e3 * req_s:.1f} ms per request"
        if req_s >= 0
        else f"per-request cost {1e3 * req_s:.1f} ms < 0: profile scaled by {scale:.2f}"
    )
    log(
        f"cost models: launch/measure.py PTL(BS) ms {ptl(p)}, prefill "
        f"{1e6 * p['prefill_s_per_token']:.1f} us/token; with the generator alone ({fix}): "
        f"PTL(BS) ms {ptl(profile)}, prefill {1e6 * profile['prefill_s_per_token']:.1f} us/token;"
        f" trainer fwd {1e6 * t['fwd_s_per_token']:.0f} + upd {1e6 * t['upd_s_per_token']:.0f} "
        f"us/token; push {measured['push_s_median']:.3f} s (the run's median); gen_cores "
        f"{gen_cores}"
    )
  if sharing is not None:
    sh = sharing
    fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # pylint: disable=unnecessary-lambda-assignment
    log(
        f"generator alone (the run's first batch, same seeds): one instance {fmt(sh['one_s'])} s "
        f"(model {fmt(sh['one_sim_s'])}); two instances on the generation node "
        f"{fmt(sh['two_s'])} s (model {fmt(sh['two_sim_s'])}), {sh['two_over_one']:.2f}x one "
        f"instance (median); their first round after the addition {sh['two_cold_s']:.2f} s "
        f"({sh['cold_over_two']:.2f}x their later ones: added_round_s "
        f"{sh['added_round_s']:.2f}); adding it took {sh['add_s']:.1f} s; "
        f"instances (cores, datacenter): "
        + ", ".join(f"{i}: {p['cores']} {p['datacenter']}" for i, p in sh["placement"].items())
    )
  per_token = collections.defaultdict(list)  # instances -> generation s per token, in the run
  for x in measured["iterations"][_WARMUP.value :]:
    per_token[x["instances"]].append(x["gen_s"] / (x["samples"] * x["mean_len"]))
  if 1 in per_token and 2 in per_token:
    med = {m: statistics.median(v) for m, v in per_token.items()}
    log(
        f"in the run: generation {1e3 * med[1]:.2f} ms per token on one instance, "
        f"{1e3 * med[2]:.2f} on two ({med[2] / med[1]:.2f}x; medians over the measured iterations)"
    )
  if sharing is not None and pred is not None:
    log(
        f"time-sharing: the simulator's two instances on {gen_cores} core(s) cost "
        f"{sharing['share_cost']:.2f}x perfect sharing (share_cost, from the generator-alone "
        f"batches above); with perfect sharing it would predict {free['samples_per_s']:.2f} "
        f"samples/s (rel err {abs(free['samples_per_s'] - meas) / meas:.3f})"
    )
  others = [x["others"] for x in measured["iterations"] if x.get("others") is not None]
  window_others = [
      x["others"] for x in measured["iterations"][_WARMUP.value :] if x.get("others") is not None
  ]
  other_cores = statistics.fmean(window_others) if window_others else float("nan")
  if others:
    during = [f"{v:.2f} during {k}" for k, v in phases.items() if v is not None]
    log(
        f"cores other jobs kept busy: {min(others):.2f}-{max(others):.2f} during the run's "
        f"iterations{'; ' if during else ''}{', '.join(during)}"
    )
  if other_cores > 0.25:
    log(
        f"note: other jobs kept {other_cores:.2f} cores busy on average during the measured "
        "iterations; the cost models were measured apart from them, so calib_rel_err holds "
        "that interference too (compare the `other` column with gen s and train s)"
    )
  total = now() - t_all
  log(
      f"samples/s over iterations {_WARMUP.value}..{_ITERATIONS.value - 1}: measured {meas:.2f}"
      f" (wall clock, with what happens between iterations: "
      f"{measured.get('wall_samples_per_s', float('nan')):.2f}), predicted {pr:.2f}; "
      f"total {total:.0f} s, load {os.getloadavg()[0]:.1f}"
  )
  summary = {
      "overrides": overrides,
      "cores": cores,
      "placement": placement,
      "run_dir": run_dir,
      "exit_code": rc,
      "measured": measured,
      "predicted": pred,
      "costs": costs,
      "costs_measured": costs_measured,
      "costs_from": _COSTS_FROM.value or None,
      "profile_with_request_cost": profile,
      "per_request_s": req_s,
      "profile_scale": scale,
      "generator_alone": alone,
      "trainer_alone": train_alone,
      "sharing": sharing,
      "others_during_measurement": phases,
      "phase_s": {"run": run_s, **phase_s},
      "total_s": total,
  }
  with open(os.path.join(_OUT.value, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  log(
      f"RESULT instances_start={measured['instances_start']} "
      f"instances_max={measured['instances_max']} lost={measured['lost']} "
      f"duplicated={measured['duplicated']} version_errors={measured['version_errors']} "
      f"calib_rel_err={err:.3f} measured_samples_per_s={meas:.3f} "
      f"predicted_samples_per_s={pr:.3f} "
      f"two_instance_slowdown={sharing['two_over_one'] if sharing else float('nan'):.2f} "
      f"share_cost={sharing['share_cost'] if sharing else float('nan'):.2f} "
      f"other_cores={other_cores:.2f} "
      f"instances_end={measured['instances_end']} "
      f"wall_s={total:.0f}"
  )
  if rc != 0:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
