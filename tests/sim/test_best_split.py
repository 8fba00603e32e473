"""best_split_makespan: Algorithm 2's split chosen in hindsight (Fig. 9 diagnostic)."""

import math

import numpy as np
import pytest

from streamrl.sim import costs, hardware
from streamrl.sim.best_split import best_split_makespan
from streamrl.sim.costs import GenCostModel
from streamrl.sim.generation import simulate_generation
from streamrl.sim.lengths import paper_lengths
from streamrl.sim.systems import SystemCalibration, gen_cost

pytestmark = [pytest.mark.unit]


def _flat_gen():
  # step = 1 + 0.1 * B seconds, no context cost, no prefill, unbounded KV.
  return GenCostModel(
      step_fixed_s=1.0,
      per_seq_s=0.1,
      per_ctx_token_s=0.0,
      prefill_s_per_token=0.0,
      kv_capacity_tokens=math.inf,
  )


def test_closed_form_two_instances():
  # 4 equal prompts, alpha 1/4: one long prompt alone (100 steps at B=1: 110 s), three regular
  # ones at the wave-optimal cap 3 (100 steps at B=3: 130 s). Only one split exists.
  t, n_l, allr = best_split_makespan(_flat_gen(), 2, [1] * 4, [100] * 4, [100] * 4, alpha=0.25)
  assert n_l == 1 and allr == [(1, pytest.approx(130.0))]
  assert t == pytest.approx(130.0)


def test_closed_form_three_instances_picks_the_faster_split():
  # N_l = 1: regular 3 prompts on 2 instances (2 + 1): 100 steps at B=2 = 120 s; long 110 s.
  # N_l = 2: regular 3 prompts on 1 instance: 130 s.
  t, n_l, allr = best_split_makespan(_flat_gen(), 3, [1] * 4, [100] * 4, [100] * 4, alpha=0.25)
  assert dict(allr) == {1: pytest.approx(120.0), 2: pytest.approx(130.0)}
  assert (t, n_l) == (pytest.approx(120.0), 1)


def test_is_a_lower_bound_on_the_oracle_dispatch_and_deterministic():
  cal = SystemCalibration(gen=costs.paper_calibration(), reserve_max_output=True)
  dist = paper_lengths(20480)
  gen = gen_cost(hardware.MODELS["qwen2.5-7b"], hardware.GPUS["H800"], cal, dist)
  rng = np.random.default_rng(3)
  p, o = dist.sample(rng, 256)
  recent = dist.sample(rng, 256)[1]
  a = best_split_makespan(gen, 4, p, o, recent)
  b = best_split_makespan(gen, 4, p, o, recent)
  assert a == b
  assert [n for n, _ in a[2]] == [1, 2, 3]
  oracle = simulate_generation(
      gen,
      4,
      p,
      o,
      scheduler="skew",
      ranker_sigma=0.0,
      recent_lengths=recent,
      objective="makespan",
      latency_model="paper",
  ).makespan
  assert a[0] <= oracle + 1e-9
  # The floor (longest sample alone) is below every split.
  i = int(np.argmax(o))
  assert gen.decode_time(1, float(p[i]), int(o[i])) <= a[0]


def test_needs_two_instances():
  with pytest.raises(ValueError, match="two instances"):
    best_split_makespan(_flat_gen(), 1, [1, 1], [5, 5], [5, 5])
