"""Calibrating the simulator against measurements on this machine.

Inputs the lead produces from real runs:
  * a LatencyProfile JSON of one generator instance (streamrl.scheduling:
    batch_sizes, ptl_s, prefill_s_per_token), measured with the tiny model;
  * a trainer JSON with the measured trainer costs, keys
      fwd_s_per_token     seconds per token of all forward-only work of a
                          sample (reference/old logprobs, values),
      upd_s_per_token     seconds per token of one mini-batch update
                          (forward + backward + optimizer), per token,
      fwd_overhead_s      fixed seconds per forward call (optional, default 0),
      update_overhead_s   fixed seconds per update step (optional, default 0),
    all for the whole trainer as it ran (the simulator gives it one "GPU");
  * the output (and prompt) lengths of the measured run.
`predict_local_throughput` then simulates the measured run's shape and
returns the predicted samples/s per mode, to compare with the benchmark;
`predict_elastic_throughput` does the same for a run whose generator count
changes under streamrl.planner.elastic.ElasticPolicy.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from streamrl.scheduling import LatencyProfile
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.config import SimConfig
from streamrl.sim.engine import simulate
from streamrl.sim.lengths import from_lengths

_TRAINER_KEYS = ("fwd_s_per_token", "upd_s_per_token")


def _load(obj: str | os.PathLike | Mapping[str, Any], what: str) -> dict:
  if isinstance(obj, Mapping):
    return dict(obj)
  path = os.fspath(obj)
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"{what} {path} does not exist; measure it first (see streamrl/sim/calibrate.py)."
    )
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{what} {path} is not valid JSON ({e}).") from None


def from_measured(
    profile: str | os.PathLike | Mapping[str, Any] | LatencyProfile,
    trainer: str | os.PathLike | Mapping[str, Any],
    *,
    kv_capacity_tokens: float = math.inf,
    max_num_seqs: int = 256,
) -> tuple[GenCostModel, TrainCostModel]:
  """Cost models from a measured LatencyProfile and trainer JSON (paths or dicts)."""
  if not isinstance(profile, LatencyProfile):
    profile = LatencyProfile.from_dict(_load(profile, "latency profile"))
  t = _load(trainer, "trainer profile")
  missing = [k for k in _TRAINER_KEYS if k not in t]
  if missing:
    raise ValueError(
        f"trainer profile is missing {missing}; expected keys {_TRAINER_KEYS} "
        "(and optionally fwd_overhead_s, update_overhead_s)."
    )
  gen = GenCostModel.from_profile(
      profile, kv_capacity_tokens=kv_capacity_tokens, max_num_seqs=max_num_seqs
  )
  train = TrainCostModel.from_measured(
      fwd_s_per_token=float(t["fwd_s_per_token"]),
      upd_s_per_token=float(t["upd_s_per_token"]),
      fwd_overhead_s=float(t.get("fwd_overhead_s", 0.0)),
      update_overhead_s=float(t.get("update_overhead_s", 0.0)),
      name=str(t.get("name", "measured")),
  )
  return gen, train


def rescale_trainer(trainer_json: Mapping[str, Any], s_per_token: float) -> dict:
  """A trainer cost model (launch/measure.py's "trainer" entry) whose forward
  and update seconds per token, in their measured proportion, add up to
  `s_per_token`: the same trainer measured another way (e.g. over several
  processes, which launch/measure.py cannot time); `one_process_scale`
  records the factor."""
  t = dict(trainer_json)
  total = float(t["fwd_s_per_token"]) + float(t["upd_s_per_token"])
  if not (total > 0 and math.isfinite(s_per_token) and s_per_token > 0):
    raise ValueError(
        f"cannot rescale a trainer of {total} s per token to {s_per_token}; both must be > 0."
    )
  scale = s_per_token / total
  t["fwd_s_per_token"] = float(t["fwd_s_per_token"]) * scale
  t["upd_s_per_token"] = float(t["upd_s_per_token"]) * scale
  t["one_process_scale"] = scale
  return t


def predict_local_throughput(
    profile_json,
    trainer_json,
    mode: str,
    *,
    output_lens: Sequence[int],
    prompt_lens: Sequence[int] | int,
    batch_size: int,
    num_instances: int = 1,
    gen_cores: int | None = None,
    pool: str = "fixed",
    max_in_flight: int | None = None,
    num_minibatches: int = 1,
    ppo_epochs: int = 1,
    transfer_s: float = 0.0,
    iterations: int = 3,
    scheduler: str = "fifo",
    ranker_sigma: float = 0.0,
    objective: str = "sum",
    seed: int = 0,
    partial_oversample: float = 0.0,
    group_size: int = 1,
    max_token_version_gap: int = 2,
) -> dict:
  """Predicted throughput of the local streaming benchmark in one mode.

  Args:
    profile_json, trainer_json: measurements (paths or dicts), see module doc.
    mode: "colocated" | "sync" | "stream" | "async".
    output_lens, prompt_lens: lengths observed in the measured run (resampled).
    batch_size: samples per iteration; num_instances: generator instances.
    gen_cores: cores the instances share (SimConfig.gen_cores); None: each its own.
    pool: "fixed" or "shared" (SimConfig.pool; a shared pool migrates too,
      SimConfig.migrate, as scheduler.migrate does).
    max_in_flight: per-instance cap on running requests (engine max_num_seqs).
    num_minibatches: PPO mini-batches per iteration (SimConfig.mini_batch_size
      is batch_size / num_minibatches, rounded up).
    scheduler, ranker_sigma, objective: SimConfig's; objective only counts
      for scheduler="skew" ("sum", the paper's Algorithm 2, by default).
    transfer_s: measured weight-update time (trainer -> generators).
    ppo_epochs: passes over the batch (SimConfig.ppo_epochs: where stream's
      later epochs run).
    partial_oversample, group_size, max_token_version_gap: partial rollouts
      (async; SimConfig), as pipeline.partial_oversample, advantage.group_size
      and pipeline.max_token_version_gap; 0 = off.
  Returns:
    {"samples_per_s", "iteration_s", "gen_s", "train_s"} (means after warm-up).
  """
  gen, train = from_measured(profile_json, trainer_json, max_num_seqs=max_in_flight or 256)
  lengths = from_lengths(output_lens, prompt_lens)
  cfg = SimConfig(
      mode=mode,
      gen=gen,
      num_instances=num_instances,
      gen_cores=gen_cores,
      train=train,
      trainer_gpus=1,
      lengths=lengths,
      samples_per_iteration=batch_size,
      num_iterations=iterations,
      mini_batch_size=-(-batch_size // num_minibatches),
      ppo_epochs=ppo_epochs,
      warmup=1 if iterations > 1 else 0,
      scheduler=scheduler,
      ranker_sigma=ranker_sigma,
      objective=objective,
      transfer_s=transfer_s,
      seed=seed,
      pool=pool,
      migrate=pool == "shared",
      partial_oversample=partial_oversample,
      group_size=group_size,
      max_token_version_gap=max_token_version_gap,
  )
  r = simulate(cfg)
  its = r.iterations[1:] if len(r.iterations) > 1 else r.iterations
  return {
      "samples_per_s": r.samples_per_s,
      "iteration_s": r.mean_iteration_s,
      "gen_s": float(np.mean([s.gen_time for s in its])),
      "train_s": float(np.mean([s.train_busy for s in its])),
  }


def predict_elastic_throughput(
    profile_json,
    trainer_json,
    mode: str,
    *,
    output_lens: Sequence[int] | None,
    prompt_lens: Sequence[int] | Sequence[Sequence[int]] | int,
    batch_size: int,
    policy_kwargs: Mapping[str, Any] | None = None,
    gen_cores: int | None = None,
    share_cost: float = 1.0,
    max_in_flight: int | None = None,
    num_minibatches: int = 1,
    transfer_s: float = 0.0,
    iterations: int = 12,
    warmup: int = 1,
    seed: int = 0,
    output_lens_per_iteration: Sequence[Sequence[int]] | None = None,
    free_slots: int | Callable[[int, int], int] = 1 << 30,
    scheduler: str = "fifo",
    ranker_sigma: float = 0.0,
    objective: str = "sum",
    ranker_refresh_s: float = 0.0,
    added_round_s: float = 0.0,
) -> dict:
  """Predicted throughput of a local run whose generators scale elastically.

  The measured run's shape as in `predict_local_throughput`, with an
  ElasticPolicy(**policy_kwargs) deciding after every iteration on the
  simulated stage times (streamrl.planner.elastic.PolicyController: same rule,
  same inputs and timing as streamrl/train.py).

  Args:
    profile_json, trainer_json, mode, batch_size, max_in_flight,
      num_minibatches, transfer_s, scheduler, ranker_sigma, objective, seed:
      as in predict_local_throughput.
    ranker_refresh_s: the ranker's refresh after each round, on the
      generators' core (`SimConfig.ranker_refresh_s`; measured by
      launch/measure.py's "ranker" entry).
    added_round_s: SimConfig.added_round_s, what an added instance's first
      round costs over a warm one (measured on the generator alone).
    output_lens: lengths observed in the measured run, resampled every
      iteration; or None with `output_lens_per_iteration`: iteration j
      resamples output_lens_per_iteration[j] (one list per iteration, at
      least `iterations` of them).
    prompt_lens: an int (every prompt), one list paired with the output
      lengths, or with output_lens_per_iteration one list per iteration.
    policy_kwargs: ElasticPolicy keywords (start_instances, min_instances,
      max_instances, observe_iterations, min_gain, cooldown_iterations,
      schedule); start_instances defaults to 1.
    gen_cores: cores the generator instances share (SimConfig.gen_cores);
      None = each instance has its own.
    share_cost: SimConfig.share_cost, the measured cost of time-sharing.
    iterations: simulated iterations; warmup: the first `warmup` of them are
      not measured (0 <= warmup < iterations).
    free_slots: what the policy is told about the pool, an int or
      free_slots(iteration, instances) -> int.
  Returns:
    samples_per_s: batch_size * (iterations - warmup) / the summed iteration
      times of iterations warmup .. iterations - 1, where an iteration's time
      runs from the previous iteration's training end (the run's start for
      iteration 0) to its own training end -- total samples over summed
      iteration time of the measured iterations, as the real bench counts.
    measured_iterations: [warmup, iterations).
    iteration_s, gen_s, train_s, instances: per iteration (all of them,
      warm-up included): iteration time as above, generation (round start ->
      last sample), trainer busy time, generator instances of the round.
    mean_instances: mean of `instances` over the measured iterations.
    decisions: the policy's changes, dicts {iteration, delta, instances,
      reason, first_round} (first_round: the first generation round that ran
      on the new count; None if none started after the decision).
  """
  from streamrl.elastic.policy import ElasticPolicy  # pylint: disable=g-import-not-at-top
  from streamrl.sim.elastic import policy_controller  # pylint: disable=g-import-not-at-top

  if not 0 <= warmup < iterations:
    raise ValueError(
        f"need 0 <= warmup < iterations, got warmup={warmup}, iterations={iterations}."
    )
  gen, train = from_measured(profile_json, trainer_json, max_num_seqs=max_in_flight or 256)
  if output_lens_per_iteration is not None:
    if len(output_lens_per_iteration) < iterations:
      raise ValueError(
          f"got {len(output_lens_per_iteration)} output-length lists for {iterations} "
          "iterations; give one per iteration."
      )
    per_it_prompts = not np.isscalar(prompt_lens) and np.ndim(prompt_lens[0]) > 0
    lengths = tuple(
        from_lengths(o, prompt_lens[j] if per_it_prompts else prompt_lens)
        for j, o in enumerate(output_lens_per_iteration[:iterations])
    )
  elif output_lens is None:
    raise ValueError("give output_lens or output_lens_per_iteration.")
  else:
    lengths = from_lengths(output_lens, prompt_lens)
  kwargs = {"start_instances": 1, **dict(policy_kwargs or {})}
  policy = ElasticPolicy(**kwargs)
  ctl = policy_controller(policy, free_slots)
  cfg = SimConfig(
      mode=mode,
      gen=gen,
      num_instances=policy.instances,
      train=train,
      trainer_gpus=1,
      lengths=lengths,
      samples_per_iteration=batch_size,
      num_iterations=iterations,
      mini_batch_size=-(-batch_size // num_minibatches),
      warmup=warmup,
      scheduler=scheduler,
      ranker_sigma=ranker_sigma,
      objective=objective,
      transfer_s=transfer_s,
      seed=seed,
      gen_cores=gen_cores,
      share_cost=share_cost,
      ranker_refresh_s=ranker_refresh_s,
      added_round_s=added_round_s,
  )
  r = simulate(cfg, controller=ctl)
  ends = np.asarray([s.train_end for s in r.iterations])
  span = ends[-1] - (ends[warmup - 1] if warmup > 0 else 0.0)
  inst = list(r.instances)
  return {
      "samples_per_s": float(batch_size * (iterations - warmup) / span),
      "measured_iterations": [warmup, iterations],
      "iteration_s": np.diff(np.concatenate([[0.0], ends])).tolist(),
      "gen_s": [float(s.gen_time) for s in r.iterations],
      "train_s": [float(s.train_busy) for s in r.iterations],
      "instances": inst,
      "mean_instances": float(np.mean(inst[warmup:])),
      "decisions": [
          {
              "iteration": d.iteration,
              "delta": d.delta,
              "instances": d.instances,
              "reason": d.reason,
              "first_round": ctl.applied.get(d.iteration),
          }
          for d in r.decisions
      ],
  }
