"""The calibration's runs (experiments/sim/calibrate_sim.py): an in-process
arm's real loop with its components measured between iterations (`run_arm`:
generator alone, trainer alone, contended, the weight push, the PTL profile)
and a cluster arm through experiments/bench/elastic_run.py
(`run_cluster_arm`).
"""

import dataclasses
import gc
import json
import os
import statistics

from experiments import harness
from experiments.bench import elastic_run
from experiments.bench.elastic_setup import Options
from experiments.sim.calibrate_costs import (
    ASYNC,
    CLUSTER_ARMS,
    OVERLAPPING,
    arm_instances,
    arm_mode,
    arm_pool,
    arm_settings,
    cluster_result,
    cost_models,
)
from streamrl.workload import Workload, generator_cores, now, train_alone


def load() -> float:
  return os.getloadavg()[0]


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
    from streamrl.sim.generation import simulate_generation  # pylint: disable=g-import-not-at-top

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


def measure_generator(work: Workload, prompt_len: int, path: str, reps: int):
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
      reps=reps,
      name="tiny/vllm-cpu/1thread",
      path=path,
  )


def run_arm(
    work: Workload, mode: str, warm: int, iters: int, out_dir: str, profile_reps: int
) -> dict:
  """The mode's loop with generator-alone / trainer-alone runs in between; transfer
  and the PTL profile (`profile_reps` repetitions per timing) after."""
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
      work, int(round(mean_prompt)), os.path.join(out_dir, f"profile_{mode}.json"), profile_reps
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


def run_cluster_arm(arm: str, repeat: int, out_dir: str, workdir: str) -> dict:
  """One run of a cluster arm (`CLUSTER_ARMS`): `elastic_run.run` in this
  process (the cluster, the run and the measurements are its subprocesses),
  in this file's terms. The arm's first repeat measures the costs, its later
  ones predict with them (Options.costs_from)."""
  out = os.path.join(out_dir, f"{arm}_{repeat}")
  costs_from = os.path.join(out_dir, f"{arm}_0", "summary.json") if repeat > 0 else ""
  o = Options(workdir=workdir, out=out, costs_from=costs_from, **CLUSTER_ARMS[arm])
  t0 = now()
  # The in-process arms pinned this process; the cluster pins its nodes to
  # cores of its own and must see every core of the machine.
  harness.pin(harness.all_cores())
  summary = elastic_run.run(o)
  if summary["exit_code"] != 0:
    raise RuntimeError(f"arm {arm}: the elastic run failed (exit {summary['exit_code']}).")
  return cluster_result(arm, summary, now() - t0)
