"""The elastic run end to end (`run(Options)`): the pinned local cluster, the
run through launch/main.py, the generator alone and the trainer alone on the
same cluster, the cost models, the simulator's replay, the tables. The script
is experiments/bench/bench_elastic.py (its docstring says what each step
does); experiments/sim/calibrate_sim.py calls `run` for its cluster arms.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import tempfile
import time

from absl import app

from experiments.bench.elastic_analysis import (
    analyse_run,
    predict,
    print_decisions,
    print_table,
    sharing_check,
    with_request_cost,
)
from experiments.bench.elastic_costs import (
    earlier_costs,
    generator_alone,
    measure_costs,
    trainer_alone,
    with_trainer_alone,
)
from experiments.bench.elastic_setup import (
    GEN_CPUS,
    TRAIN_CPUS,
    CpuMonitor,
    Options,
    PinnedCluster,
    log,
    node_cores,
    now,
    run_elastic,
    typed_settings,
    workload_overrides,
)
from streamrl.cluster import local as local_cluster


def run(o: Options) -> dict:
  """The elastic run, its cost measurements and the simulator's replay of it,
  as the module docstring of bench_elastic.py says; prints the tables, writes
  summary.json under `o.out` and returns it: its "result" the RESULT line's
  values, its "exit_code" the run's."""
  if not 0 <= o.warmup < o.iterations:
    raise app.UsageError("need 0 <= --warmup < --iterations.")
  t_all = now()
  overrides = workload_overrides(o)
  s = typed_settings(overrides)  # checks every value before anything starts
  earlier = earlier_costs(o.costs_from, overrides, o.trainer_processes) if o.costs_from else None
  os.makedirs(o.workdir, exist_ok=True)
  os.makedirs(o.out, exist_ok=True)
  base = tempfile.mkdtemp(prefix="bench_", dir=o.workdir)
  run_dir = os.path.join(base, "run")
  cores = node_cores(o.pin_nodes)
  log(
      f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; nodes: head, trainer "
      f"(dc0, {TRAIN_CPUS} CPU per trainer process, {o.trainer_processes} "
      f"process(es), cores {cores.get('trainer', 'any')}), generator (dc1, "
      f"{GEN_CPUS} CPU, {o.slots} slots, cores {cores.get('generator', 'any')}); "
      f"run in {run_dir}"
  )
  monitor = CpuMonitor()
  monitor.start()
  nodes = local_cluster.default_nodes(
      generation_slots=o.slots,
      trainer_cpus=TRAIN_CPUS,
      generator_cpus=GEN_CPUS,
      training_slots=o.trainer_processes,
  )
  c = PinnedCluster(nodes, workdir=os.path.join(base, "cluster"), cores=cores)
  t0 = now()
  rc, run_s, alone, phases, train_alone = None, 0.0, None, {}, None
  try:
    c.start()
    log(f"cluster up at {c.address} ({now() - t0:.0f} s); the elastic run starts")
    t1 = now()
    rc = run_elastic(c, run_dir, overrides, os.path.join(base, "run.log"), o.timeout_s)
    run_s = now() - t1
    log(f"run ended (exit {rc}) after {run_s:.0f} s; its output: {os.path.join(base, 'run.log')}")
    if rc == 0:
      log("the generator alone on the same cluster (one instance, then two) ...")
      t2 = time.time()
      alone = generator_alone(
          o, c, run_dir, overrides, os.path.join(base, "generator_alone.json"), cores.get("trainer")
      )
      phases["generator alone"] = (t2, time.time())
      if earlier is not None:
        train_alone = earlier["trainer_alone"]
      elif o.trainer_processes > 1:
        log(f"the {o.trainer_processes}-process trainer alone (a second, shorter run) ...")
        t2 = time.time()
        train_alone = trainer_alone(o, c, base, overrides, s)
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

  measured = analyse_run(run_dir, s, o.warmup)
  pred = free = costs = costs_measured = profile = None
  req_s = scale = float("nan")
  # Instances time-share the generation node: its CPUs in units of one
  # instance's threads (the service gives each max(1, CPUs // slots)).
  gen_cores = max(1, GEN_CPUS // max(1, GEN_CPUS // o.slots))
  sharing = None
  if alone is not None and measured.get("samples_per_s"):
    if earlier is not None:
      costs = earlier["costs"]
      log(f"the cost models: measured by the run of {earlier['from']}")
    else:
      log("measuring the cost models (launch/measure.py) ...")
      t2 = time.time()
      costs = measure_costs(
          o, run_dir, overrides, os.path.join(o.out, "costs.json"), cores.get("generator")
      )
      phases["measure.py"] = (t2, time.time())
    costs_measured = costs
    if train_alone is not None:
      costs = with_trainer_alone(costs, train_alone)
      log(
          f"  trainer alone, {o.trainer_processes} processes: "
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
    pred = predict(o.slots, measured, costs, profile, s, gen_cores, o.warmup, share_cost, added)
    free = predict(o.slots, measured, costs, profile, s, gen_cores, o.warmup, 1.0, added)
  monitor.stop()
  for x in measured["iterations"]:
    x["others"] = monitor.others(x["wall_time"] - x["iter_s"], x["wall_time"])
  phase_s = {k: v[1] - v[0] for k, v in phases.items()}
  phases = {k: monitor.others(*v) for k, v in phases.items()}

  print_table(measured, pred, o.warmup)
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
  for x in measured["iterations"][o.warmup :]:
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
      x["others"] for x in measured["iterations"][o.warmup :] if x.get("others") is not None
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
      f"samples/s over iterations {o.warmup}..{o.iterations - 1}: measured {meas:.2f}"
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
      "costs_from": o.costs_from or None,
      "options": dataclasses.asdict(o),
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
  summary["result"] = {
      "instances_start": measured["instances_start"],
      "instances_max": measured["instances_max"],
      "lost": measured["lost"],
      "duplicated": measured["duplicated"],
      "version_errors": measured["version_errors"],
      "calib_rel_err": f"{err:.3f}",
      "measured_samples_per_s": f"{meas:.3f}",
      "predicted_samples_per_s": f"{pr:.3f}",
      "two_instance_slowdown": f"{sharing['two_over_one'] if sharing else float('nan'):.2f}",
      "share_cost": f"{sharing['share_cost'] if sharing else float('nan'):.2f}",
      "other_cores": f"{other_cores:.2f}",
      "instances_end": measured["instances_end"],
      "wall_s": f"{total:.0f}",
  }
  # What a later run's costs_from reads.
  with open(os.path.join(o.out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=str)
  return summary
