r"""What planning one generation round costs the skew scheduler, per round of 128 requests.

  python experiments/bench/bench_plan_overhead.py [--reps=100] [--quick] [--baseline=<git rev>]

The round is configs/grpo.py's (--config): trainer.prompts_per_iteration
work-trace prompts x advantage.group_size samples = 128 requests, planned by
that config's scheduler (`scheduler.*`: the ranker, the "simulate" latency
model) with a full rank history, so that every part of Algorithm 2 runs:
the ranker's prediction, the rank draws, the replays of every candidate
split. The instances hold engine.max_num_seqs each; the round is not
stoppable (a stoppable round that fits the slots asks for no plan at all).
Arms, each `GenerationScheduler.plan` on fresh rounds:

  default    the config's round on 2 instances (the arm the RESULT leads with);
  siblings   the same with scheduler.sibling_lengths=on (groups kept together);
  unique     128 distinct prompts (group size 1): the ranker scores 128 prompts;
  instances8 the config's round on 8 instances (8 candidate splits x 8 instances).

Per arm: the median wall time of a plan over --reps rounds (after warm-up
rounds that compile the ranker), its median CPU time (all threads of this
process: what it costs a loaded machine) and the ranker's share of it.

--baseline=<rev> also measures the streamrl of that commit (`git archive`
of streamrl/ and configs/ into the workdir, measured by this script in a
subprocess with --src), reported as before_<key>. The machine's other load
shows in the wall times; compare the arms of one run.

Ends with `RESULT plan_overhead_ms=<default's median wall ms> requests=128
plan_cpu_ms=... predict_ms=... <arm>_ms=... [before_plan_overhead_ms=...]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from absl import app, flags

from experiments import harness

_BASELINE = flags.DEFINE_string("baseline", "", "A git revision to measure as well (before_*).")
_SRC = flags.DEFINE_string("src", "", "Import streamrl from this checkout (a baseline's run).")
_ARMS_FILE = flags.DEFINE_string("arms_file", "", "The arms as JSON (a baseline's run).")

REQUESTS = 128


def arms(config: str) -> dict[str, dict]:
  """Arm name -> what it plans: the config's scheduler settings and round shape."""
  s = harness.settings(config)
  sched = dataclasses.asdict(s.scheduler)
  group = s.advantage.group_size
  if s.trainer.prompts_per_iteration * group != REQUESTS:
    raise app.UsageError(f"{config}'s round is not {REQUESTS} requests; pass --config.")
  base = dict(scheduler=sched, group_size=group, instances=2, max_batch_size=s.engine.max_num_seqs)
  return {
      "default": base,
      "siblings": {**base, "scheduler": {**sched, "sibling_lengths": "on"}},
      "unique": {**base, "group_size": 1},
      "instances8": {**base, "instances": 8},
  }


def scheduler(arm: dict, model_dir: str):
  """A `GenerationScheduler` of the arm's settings, with the recent lengths
  and the full rank history a run would have recorded by now."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from streamrl.scheduling.config import Scheduler  # pylint: disable=g-import-not-at-top
  from streamrl.scheduling.scheduler import GenerationScheduler  # pylint: disable=g-import-not-at-top

  fields = {f.name for f in dataclasses.fields(Scheduler)}
  sched = Scheduler(**{k: v for k, v in arm["scheduler"].items() if k in fields})
  gs = GenerationScheduler(
      sched,
      model_dir=model_dir,
      workdir=None,
      num_instances=arm["instances"],
      max_batch_size=arm["max_batch_size"],
  )
  rng = np.random.default_rng(0)
  lengths = rng.geometric(1 / 60, size=gs.rank_history.maxlen).tolist()
  gs.recent.extend(lengths)
  gs.rank_history.extend(zip(rng.random(len(lengths)).tolist(), lengths))
  return gs


def measure(gs, arm: dict, reps: int, warmup: int = 5) -> dict[str, float]:
  """Median wall / CPU milliseconds of `gs.plan` and the ranker's CPU
  milliseconds in it, over `reps` rounds of the arm's shape."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from streamrl.data import tasks, tokenizer  # pylint: disable=g-import-not-at-top
  from streamrl.scheduling.request import Request  # pylint: disable=g-import-not-at-top

  group = arm["group_size"]

  def round_(k):
    examples = tasks.make_examples(REQUESTS // group, seed=1000 + k)
    return [
        Request(j * group + i, tokenizer.encode(ex.prompt))
        for j, ex in enumerate(examples)
        for i in range(group)
    ]

  rounds = [round_(k) for k in range(warmup + reps)]
  predict, predict_s = gs.ranker.predict, []

  def timed_predict(prompts):
    t0 = time.process_time()
    try:
      return predict(prompts)
    finally:
      predict_s.append(time.process_time() - t0)

  gs.ranker.predict = timed_predict
  wall, cpu = [], []
  try:
    for k, requests in enumerate(rounds):
      w0, c0 = time.perf_counter(), time.process_time()
      gs.plan(requests, {}, seed=k, num_instances=arm["instances"])
      wall.append(time.perf_counter() - w0)
      cpu.append(time.process_time() - c0)
  finally:
    gs.ranker.predict = predict
  ms = lambda xs: 1000 * float(np.median(xs[warmup:]))
  return {"wall_ms": ms(wall), "cpu_ms": ms(cpu), "predict_ms": ms(predict_s)}


def baseline(rev: str, arms_: dict, workdir: str) -> dict:
  """`measure` of every arm on the streamrl of `rev`, in a subprocess."""
  src = os.path.join(workdir, f"src_{rev}")
  if not os.path.isdir(src):
    os.makedirs(src)
    tar = subprocess.run(
        ["git", "-C", harness.ROOT, "archive", rev, "streamrl", "configs"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", src], input=tar, check=True)
  arms_file = os.path.join(src, "arms.json")
  with open(arms_file, "w") as f:
    json.dump(arms_, f)
  out = os.path.join(src, "out")
  cmd = [sys.executable, os.path.abspath(__file__), f"--src={src}", f"--arms_file={arms_file}"]
  cmd += [f"--out={out}", f"--workdir={workdir}", f"--reps={harness.reps(100)}"]
  subprocess.run(cmd, check=True, cwd=harness.ROOT)
  with open(os.path.join(out, "summary.json")) as f:
    return json.load(f)["arms"]


def main(argv):
  del argv
  if _SRC.value:  # streamrl of another checkout, before anything imports it
    sys.path.insert(0, os.path.abspath(_SRC.value))
  reps = harness.reps(20 if harness.QUICK.value else 100)
  workdir = harness.workdir()
  if _ARMS_FILE.value:
    with open(_ARMS_FILE.value) as f:
      arms_ = json.load(f)
  else:
    arms_ = arms("configs/grpo.py")
  from streamrl.data import tokenizer  # pylint: disable=g-import-not-at-top

  model_dir = os.path.join(workdir, "tokenizer")
  tokenizer.save_hf_tokenizer(model_dir)
  results, schedulers = {}, {}  # one scheduler (and ranker) per scheduler settings
  for name, arm in arms_.items():
    key = json.dumps([arm["scheduler"], arm["max_batch_size"]], sort_keys=True)
    if key not in schedulers:
      schedulers[key] = scheduler(arm, model_dir)
    results[name] = measure(schedulers[key], arm, reps)
    print(name, " ".join(f"{k}={v:.3f}" for k, v in results[name].items()), flush=True)
  if _SRC.value:
    harness.report(summary={"arms": results, "src": _SRC.value}, requests=REQUESTS)
    return
  d = results["default"]
  kv = dict(
      plan_overhead_ms=d["wall_ms"],
      requests=REQUESTS,
      plan_cpu_ms=d["cpu_ms"],
      predict_ms=d["predict_ms"],
      **{f"{name}_ms": r["wall_ms"] for name, r in results.items() if name != "default"},
  )
  summary = {"arms": results, "arm_settings": arms_, "reps": reps}
  if _BASELINE.value:
    before = baseline(_BASELINE.value, arms_, workdir)
    summary["before"] = {"rev": _BASELINE.value, "arms": before}
    kv["before_plan_overhead_ms"] = before["default"]["wall_ms"]
    kv["before_plan_cpu_ms"] = before["default"]["cpu_ms"]
    kv.update({f"before_{n}_ms": r["wall_ms"] for n, r in before.items() if n != "default"})
  harness.report(summary=summary, **kv)


if __name__ == "__main__":
  app.run(main)
