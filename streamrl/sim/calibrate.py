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
returns the predicted samples/s per mode, to compare with the benchmark.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from streamrl.scheduling import LatencyProfile
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.engine import SimConfig, simulate
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


def predict_local_throughput(
    profile_json,
    trainer_json,
    mode: str,
    *,
    output_lens: Sequence[int],
    prompt_lens: Sequence[int] | int,
    batch_size: int,
    num_instances: int = 1,
    max_in_flight: int | None = None,
    num_minibatches: int = 1,
    transfer_s: float = 0.0,
    iterations: int = 3,
    scheduler: str = "fifo",
    ranker_sigma: float = 0.0,
    seed: int = 0,
) -> dict:
  """Predicted throughput of the local streaming benchmark in one mode.

  Args:
    profile_json, trainer_json: measurements (paths or dicts), see module doc.
    mode: "colocated" | "sync" | "stream" | "async".
    output_lens, prompt_lens: lengths observed in the measured run (resampled).
    batch_size: samples per iteration; num_instances: generator instances.
    max_in_flight: per-instance cap on running requests (engine max_num_seqs).
    transfer_s: measured weight-update time (trainer -> generators).
  Returns:
    {"samples_per_s", "iteration_s", "gen_s", "train_s"} (means after warm-up).
  """
  gen, train = from_measured(profile_json, trainer_json, max_num_seqs=max_in_flight or 256)
  lengths = from_lengths(output_lens, prompt_lens)
  cfg = SimConfig(
      mode=mode,
      gen=gen,
      num_instances=num_instances,
      train=train,
      num_train_gpus=1,
      lengths=lengths,
      batch_size=batch_size,
      num_minibatches=num_minibatches,
      iterations=iterations,
      warmup=1 if iterations > 1 else 0,
      scheduler=scheduler,
      ranker_sigma=ranker_sigma,
      transfer_s=transfer_s,
      seed=seed,
  )
  r = simulate(cfg)
  its = r.iterations[1:] if len(r.iterations) > 1 else r.iterations
  return {
      "samples_per_s": r.samples_per_s,
      "iteration_s": r.mean_iteration_s,
      "gen_s": float(np.mean([s.gen_time for s in its])),
      "train_s": float(np.mean([s.train_busy for s in its])),
  }
