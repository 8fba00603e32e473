"""Elastic scale-up policy in simulation."""

import dataclasses

import numpy as np
import pytest

from streamrl.planner.elastic import ElasticController, run_elastic
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.config import SimConfig
from streamrl.sim.lengths import PaperLengths

pytestmark = [pytest.mark.unit]

# A throughput-bound generator (per-sequence cost dominates), so extra
# instances help, and a fixed-cost trainer.
GEN = GenCostModel(
    step_fixed_s=0.002,
    per_seq_s=0.001,
    per_ctx_token_s=0.0,
    prefill_s_per_token=0.0,
    kv_capacity_tokens=float("inf"),
)
TRAIN = TrainCostModel.from_measured(fwd_s_per_token=2e-5, upd_s_per_token=6e-5)


def _run(lengths, iters=12, start=2):
  cfg = SimConfig(
      mode="async",
      gen=GEN,
      num_instances=start,
      train=TRAIN,
      trainer_gpus=1,
      lengths=lengths,
      samples_per_iteration=64,
      num_iterations=iters,
      mini_batch_size=16,
      scheduler="fifo",
      seed=0,
  )
  ctl = ElasticController(GEN, start, 1, 12, scheduler="fifo")
  return run_elastic(cfg, ctl)


def test_adds_units_as_lengths_grow():
  iters = 16
  dists = tuple(
      PaperLengths(max_output=int(400 + 1600 * j / (iters - 1)), tail_weight=0.0)
      for j in range(iters)
  )
  run = _run(dists, iters)
  assert np.all(np.diff(run.instances) >= 0)
  assert len(run.additions) >= 2
  # Every decision follows the rule Delta > saving.
  for s in run.steps:
    assert s.added == (s.gap_s > s.saving_s > 0)
  # Additions are spread out as lengths grow, not all at the start.
  assert run.additions[-1].iteration > run.additions[0].iteration + 2


def test_no_scale_up_when_training_is_the_bottleneck():
  slow_train = dataclasses.replace(TRAIN, upd_s_per_token=5e-3)
  cfg = SimConfig(
      mode="async",
      gen=GEN,
      num_instances=2,
      train=slow_train,
      trainer_gpus=1,
      lengths=PaperLengths(max_output=400),
      samples_per_iteration=64,
      num_iterations=8,
      mini_batch_size=16,
      seed=0,
  )
  run = run_elastic(cfg, ElasticController(GEN, 2, 1, 12, scheduler="fifo"))
  assert not run.additions
  assert np.all(run.instances == 2)
  assert all(s.gap_s < 0 for s in run.steps)


def test_bad_controller_args():
  with pytest.raises(ValueError):
    ElasticController(GEN, 0, 1, 4)
