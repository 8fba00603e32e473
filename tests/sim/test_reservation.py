"""Reserving admission (KV for the maximum output held per sequence): closed forms, no preemption."""

import dataclasses
import math

import numpy as np
import pytest

from streamrl.sim import costs, hardware
from streamrl.sim.config import SimConfig
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.engine import simulate
from streamrl.sim.generation import simulate_generation
from streamrl.sim.lengths import PaperLengths
from streamrl.sim.systems import SystemCalibration, gen_cost

pytestmark = [pytest.mark.unit]

A, B = 0.01, 0.001  # PTL(BS) = A + B * BS


def _gen(kv, reserve=0.0, c=0.0):
  return GenCostModel(
      step_fixed_s=A,
      per_seq_s=B,
      per_ctx_token_s=c,
      prefill_s_per_token=0.0,
      kv_capacity_tokens=kv,
      reserve_output_tokens=reserve,
  )


def test_max_concurrent_is_capacity_over_prompt_plus_reservation():
  assert _gen(1000.0).max_concurrent(100) == 256  # no reservation: the engine cap
  assert _gen(1000.0, reserve=99).max_concurrent(100) == 5  # 1000 // (100 + 1 + 99)
  assert _gen(100.0, reserve=1000).max_concurrent(100) == 1  # never below one


def test_reservation_runs_in_waves_closed_form():
  # 10 samples, prompt 100, output 50; each reserves 100 + 1 + 99 = 200 of 1000
  # tokens: 5 at once, two waves of 50 steps at batch 5.
  r = simulate_generation(
      _gen(1000.0, reserve=99), 1, [100] * 10, [50] * 10, queues=[list(range(10))], caps=[256]
  )
  assert r.makespan == pytest.approx(2 * 50 * (A + 5 * B))
  assert r.preemptions == 0
  # Without reservation all ten fit (1,500 tokens at the end of 10,000): one wave.
  r = simulate_generation(
      _gen(10000.0), 1, [100] * 10, [50] * 10, queues=[list(range(10))], caps=[256]
  )
  assert r.makespan == pytest.approx(50 * (A + 10 * B))


def test_reservation_never_preempts_where_vllm_admission_does():
  p, o = [10] * 8, [400] * 8  # 8 x 410 tokens at the end, 2,000 in the cache
  free = simulate_generation(_gen(2000.0), 1, p, o, queues=[list(range(8))], caps=[8])
  held = simulate_generation(_gen(2000.0, reserve=400), 1, p, o, queues=[list(range(8))], caps=[8])
  assert free.preemptions > 0
  assert held.preemptions == 0
  # 2000 // 411 = 4 at once: two waves of 400 steps at batch 4.
  assert held.makespan == pytest.approx(2 * 400 * (A + 4 * B))


def test_reservation_deterministic_and_late_admission_of_long_sample():
  # FIFO with reservation: a long sample queued behind a full wave starts late
  # (the skewness bubble that LPT removes).
  gen = _gen(1000.0, reserve=99)  # 5 at once for prompt 100
  out = [10] * 5 + [200]
  fifo = simulate_generation(gen, 1, [100] * 6, out, queues=[[0, 1, 2, 3, 4, 5]], caps=[256])
  lpt = simulate_generation(gen, 1, [100] * 6, out, queues=[[5, 0, 1, 2, 3, 4]], caps=[256])
  assert fifo.makespan == pytest.approx(10 * (A + 5 * B) + 200 * (A + B))
  # LPT: long + 4 short for 10 steps, long + the last short for 10, long alone for 180.
  assert lpt.makespan == pytest.approx(10 * (A + 5 * B) + 10 * (A + 2 * B) + 180 * (A + B))
  assert lpt.makespan < fifo.makespan
  again = simulate_generation(gen, 1, [100] * 6, out, queues=[[0, 1, 2, 3, 4, 5]], caps=[256])
  assert again.makespan == fifo.makespan


def test_gen_cost_reserves_the_distribution_maximum():
  cal = SystemCalibration(gen=costs.paper_calibration(), reserve_max_output=True)
  model, gpu = hardware.MODELS["qwen2.5-7b"], hardware.GPUS["H800"]
  g = gen_cost(model, gpu, cal, PaperLengths(20480))
  assert g.reserve_output_tokens == 20480
  assert g.max_concurrent(400) == int(g.kv_capacity_tokens // (400 + 1 + 20480))
  # Per-iteration distributions: the largest maximum.
  g = gen_cost(model, gpu, cal, (PaperLengths(10240), PaperLengths(20480)))
  assert g.reserve_output_tokens == 20480
  assert (
      gen_cost(
          model, gpu, dataclasses.replace(cal, reserve_max_output=False), PaperLengths(20480)
      ).reserve_output_tokens
      == 0
  )


def test_bad_reservation_is_rejected():
  with pytest.raises(ValueError, match="reserve_output_tokens"):
    _gen(1000.0, reserve=-1)
  with pytest.raises(ValueError, match="reserve_output_tokens"):
    _gen(1000.0, reserve=math.inf)


def test_full_simulation_with_reservation_is_deterministic():
  gen = dataclasses.replace(
      GenCostModel.for_deployment(
          hardware.MODELS["qwen2.5-7b"], hardware.GPUS["H800"], costs.paper_calibration()
      ),
      reserve_output_tokens=5120.0,
  )
  train = TrainCostModel.for_gpu(hardware.MODELS["qwen2.5-7b"], hardware.GPUS["H800"], 0.4)
  cfg = SimConfig(
      mode="async",
      gen=gen,
      num_instances=4,
      train=train,
      trainer_gpus=4,
      lengths=PaperLengths(5120),
      samples_per_iteration=256,
      num_iterations=3,
      mini_batch_size=64,
      objective="sum",
      scheduler="skew",
      seed=3,
  )
  a, b = simulate(cfg), simulate(cfg)
  assert a.samples_per_s == b.samples_per_s
  assert a.preemptions == 0
  assert np.isfinite(a.samples_per_s) and a.samples_per_s > 0
