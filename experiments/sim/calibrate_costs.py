"""The calibration's arms and cost models (experiments/sim/calibrate_sim.py),
without flags: which mode, instances and pool an arm name means, the
simulator's inputs from the measured timings (`cost_models`), its prediction
for an in-process arm (`predict`), and a cluster arm's run in the same terms
(`cluster_result`).
"""

import dataclasses
import statistics

from streamrl.workload import with_mode

# Modes whose generation and training run at the same time.
OVERLAPPING = ("stream", "async", "async_partial")
# Modes whose iterations overlap (no gaps between them for the components).
ASYNC = ("async", "async_partial")


# The modes the simulator models (streamrl.sim.config.MODES, async_partial as
# async with SimConfig.partial_oversample). async_partial_sibling runs but is
# not predicted: the simulator does not model sibling length hints.
PREDICTED = ("colocated", "sync", "stream", "async", "async_partial")
# Arms beyond the modes: "<mode>_2gen" is the mode on two generator instances
# (engine.num_instances=2), which time-share the generator's core;
# "<mode>_2gen_pool" the same with a shared work pool and migration
# (scheduler.pool=shared, scheduler.migrate=True).
TWO_GEN, POOL = "_2gen", "_pool"
# Arms run as a user's job on a local Ray cluster of raylets pinned to the
# cores (experiments/bench/elastic_run.py: launch/main.py, then
# launch/measure.py and the generator alone for the costs), the Options of each:
# "elastic", elastic generation 1 -> 2 -> 1 (sync); "sync_2train", sync with
# two trainer processes (cluster.trainer_processes=2) sharing the training
# node's core (warm-up 2: its sharded programs also compile in iteration 1).
CLUSTER_ARMS = {"elastic": {}, "sync_2train": {"trainer_processes": 2, "warmup": 2}}
ARMS = PREDICTED + ("sync" + TWO_GEN, "sync" + TWO_GEN + POOL) + tuple(CLUSTER_ARMS)


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
  from streamrl.sim.generation import simulate_generation  # pylint: disable=g-import-not-at-top

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


def predict(
    res: dict,
    s,
    stat: str = "mean",
    profile_key: str = "profile",
    condition: str | None = None,
    sim_iterations: int = 40,
) -> dict:
  """The simulator's samples/s for in-process arm `res` from its cost models
  (`stat`, `condition`), over `sim_iterations` simulated iterations."""
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
      iterations=sim_iterations,
      seed=s.seed,
      **partial,
  )


def cluster_result(arm: str, summary: dict, wall_s: float) -> dict:
  """A cluster arm's run (elastic_run's summary) in this file's terms."""
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
      "result": " ".join(f"{k}={v}" for k, v in summary["result"].items()),
      "wall_s": wall_s,
  }
