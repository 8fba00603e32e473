"""The elastic run's cost measurements, apart from the run they predict:
launch/measure.py's PTL profile and trainer seconds per token, the
multi-process trainer alone (a second, shorter run), and the generator alone
on the run's cluster (`generator_alone_child`, a subprocess:
`python -m experiments.bench.elastic_costs '<json>'`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from absl import app

from experiments import harness
from experiments.bench.elastic_setup import (
    CONFIG,
    ROOT,
    Options,
    as_flags,
    log,
    now,
    read_jsonl,
    run_elastic,
    typed_settings,
)


def measure_costs(o: Options, run_dir: str, overrides: dict, out_path: str, cores) -> dict:
  """launch/measure.py (the run's config and cached initial policy) on `cores`;
  the trainer's costs are those of one process (what a multi-process trainer
  adds is not in them)."""
  args = [sys.executable, os.path.join(ROOT, "launch", "measure.py")]
  args += [f"--config={CONFIG}", f"--out={out_path}"]
  args += [f"--workdir={run_dir}", f"--reps={o.measure_reps}"]
  args += as_flags({**overrides, "cluster.trainer_processes": 1})
  args = harness.taskset(args, cores)
  res = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT)
  if res.returncode != 0:
    raise RuntimeError(f"launch/measure.py failed:\n{(res.stdout + res.stderr)[-3000:]}")
  for line in res.stdout.splitlines():
    if line.startswith(("generated", "wrote")):
      log(f"  measure: {line}")
  with open(out_path) as f:
    return json.load(f)


def trainer_alone(o: Options, c, base: str, overrides: dict, s) -> dict:
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
      "trainer.num_iterations": o.trainer_alone_iterations,
  }
  log_path = os.path.join(base, "trainer_alone.log")
  rc = run_elastic(c, run_dir, extra, log_path, o.timeout_s)
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


def earlier_costs(path: str, overrides: dict, trainer_processes: int) -> dict:
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
  if trainer_processes > 1 and (not isinstance(alone, dict) or not alone.get("iterations")):
    raise app.UsageError(
        f"--costs_from={path} holds no trainer-alone measurement; pass the summary.json of an "
        f"earlier --trainer_processes={trainer_processes} run."
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


def generator_alone(o: Options, c, run_dir: str, overrides: dict, out_path: str, cores) -> dict:
  """Runs `generator_alone_child` against cluster `c`, on `cores`."""
  child = {
      "run_dir": run_dir,
      "overrides": {**overrides, "cluster.address": c.address},
      "out": out_path,
      "log_dir": os.path.dirname(out_path),
      "reps": o.alone_reps,
      "two": o.elastic,  # a second instance only where the run can add one
  }
  args = [sys.executable, "-m", "experiments.bench.elastic_costs", json.dumps(child)]
  args = harness.taskset(args, cores)
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


if __name__ == "__main__":
  generator_alone_child(json.loads(sys.argv[1]))
