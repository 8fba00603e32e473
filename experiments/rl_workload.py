"""The RL trainer's cost per iteration on a job a run recorded.

`rl_arm` makes the spec, `trainer_workload.run_isolated` runs `measure_rl` in a
fresh process (pinned to the cores the spec names, optionally importing a
baseline StreamRL tree), `recorded_samples` rebuilds the run's batches from its
length_pairs.jsonl. Used by `experiments/bench/bench_trainer.py --rl_job`.
Nothing of StreamRL is imported at module level, so a baseline tree can be
put first on the path before it is.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rl_arm(
    name: str,
    *,
    model_dir: str,
    lengths: str,
    iterations: int,
    config: str = "configs/grpo.py",
    src: str = "",
    cores: tuple[int, ...] = (1,),
    seed: int = 0,
) -> dict:
  """The spec of `measure_rl`: `config`'s RL trainer on the warm-started policy
  in `model_dir`, fed samples of the lengths a run recorded (`lengths`, its
  workdir's length_pairs.jsonl), `iterations` of them timed; `src` a StreamRL
  source tree to import instead of this one (a baseline), `cores` the CPUs
  the process is pinned to (a run's trainer has one)."""
  return dict(
      kind="rl",
      name=name,
      model_dir=model_dir,
      lengths=lengths,
      iterations=iterations,
      config=config,
      src=src,
      cores=list(cores),
      seed=seed,
  )


def recorded_samples(lengths_path: str, batch: int, iterations: int, seed: int = 0) -> list:
  """`iterations` batches of `batch` Samples with a run's prompts and response
  lengths (length_pairs.jsonl, in its order), random response tokens and
  logprobs, and token versions as partial rollouts give them (one or two
  versions per response)."""
  from streamrl.generator.rollout import Sample  # pylint: disable=g-import-not-at-top

  with open(lengths_path) as f:
    pairs = [json.loads(line) for line in f if line.strip()]
  rng = np.random.default_rng(seed)
  out = []
  for it in range(iterations):
    rows = [pairs[(it * batch + i) % len(pairs)] for i in range(batch)]
    samples = []
    for i, p in enumerate(rows):
      r = max(int(p["length"]), 1)
      versions = [it + 1] * r if i % 3 else [it] * (r // 2) + [it + 1] * (r - r // 2)
      samples.append(
          Sample(
              prompt_id=i,
              prompt_token_ids=tuple(p["prompt_ids"]),
              token_ids=tuple(int(x) for x in rng.integers(3, 60, r)),
              logprobs=tuple(float(x) for x in -rng.random(r)),
              finish_reason="stop",
              weight_version=it,
              instance_id=0,
              token_versions=tuple(versions),
          )
      )
    out.append(samples)
  return out


def measure_rl(spec: dict) -> dict:
  """One RL trainer's cost per iteration on a recorded job (`rl_arm`), as a
  run's loop spends it: `snapshot`, `prepare` (old and reference logprobs,
  advantages, metrics), the updates of every PPO epoch, then the fetch of
  their metrics. Every batch is run once untimed (each padded length
  compiles then), then timed: wall and CPU seconds (this process, all its
  threads) per phase, host-side dispatch seconds of the updates (the calls'
  return before the device finishes), and the programs compiled while timed."""
  if spec["src"]:
    sys.path.insert(0, spec["src"])
  os.sched_setaffinity(0, set(spec["cores"]))
  import jax  # pylint: disable=g-import-not-at-top

  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import compiles, setup  # pylint: disable=g-import-not-at-top
  from streamrl.trainer.rl_trainer import RLTrainer  # pylint: disable=g-import-not-at-top

  compiles.install()
  s = settings.from_config(config_lib.load_config(os.path.join(_ROOT, spec["config"])))
  trainer = RLTrainer.from_settings(setup.load_policy(s, spec["model_dir"]), s)
  batches = recorded_samples(
      spec["lengths"], s.samples_per_iteration, spec["iterations"], spec["seed"]
  )
  rng = np.random.default_rng(spec["seed"])
  rewards = [rng.integers(0, 2, len(b)).astype(np.float32) for b in batches]
  phases = ("snapshot", "prepare", "update", "fetch")

  def iteration(samples, r, totals):
    clock = lambda: (time.perf_counter(), time.process_time())
    marks = [clock()]
    old = trainer.snapshot()
    jax.block_until_ready(old.actor)
    marks.append(clock())
    minis, _ = trainer.prepare(samples, r, old)
    marks.append(clock())
    updates, dispatch = [], 0.0
    for _ in range(s.trainer.ppo_epochs):
      for j in rng.permutation(len(minis)):
        t0 = time.perf_counter()
        updates.append(trainer.update(minis[j]))
        dispatch += time.perf_counter() - t0
    jax.block_until_ready(updates)
    marks.append(clock())
    jax.device_get(updates)
    marks.append(clock())
    for k, (a, b) in zip(phases, zip(marks, marks[1:])):
      totals[f"{k}_wall_s"] = totals.get(f"{k}_wall_s", 0.0) + b[0] - a[0]
      totals[f"{k}_cpu_s"] = totals.get(f"{k}_cpu_s", 0.0) + b[1] - a[1]
    totals["update_dispatch_s"] = totals.get("update_dispatch_s", 0.0) + dispatch

  for b, r in zip(batches, rewards):  # untimed: every padded length compiles here
    iteration(b, r, {})
  before = compiles.totals()
  totals = {}
  for b, r in zip(batches, rewards):
    iteration(b, r, totals)
  after = compiles.totals()
  n = len(batches)
  out = {k: 1000 * v / n for k, v in totals.items()}  # ms per iteration
  out = {k.replace("_s", "_ms"): v for k, v in out.items()}
  out["total_wall_ms"] = sum(out[f"{k}_wall_ms"] for k in phases)
  out["total_cpu_ms"] = sum(out[f"{k}_cpu_ms"] for k in phases)
  out.update(
      name=spec["name"],
      iterations=n,
      samples_per_iteration=s.samples_per_iteration,
      programs=before["compile/programs"],
      timed_compiles=after["compile/programs"] - before["compile/programs"],
      compile_s=before["compile/seconds"],
  )
  return out
