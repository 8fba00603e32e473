"""Algorithm 1 against brute force on small clusters, and bad input."""

import itertools

import numpy as np
import pytest

from streamrl.planner.allocation import Pool, StageEstimator, Workload, plan, shrink_faster, single_dc
from streamrl.sim import costs, hardware
from streamrl.sim.generation import simulate_generation
from streamrl.sim.lengths import paper_lengths
from streamrl.sim.systems import SystemCalibration

pytestmark = [pytest.mark.unit]

CAL = SystemCalibration(gen=costs.paper_calibration(), mfu=0.45)


def _workload(batch=64, max_out=4096):
  return Workload(
      model=hardware.MODELS["qwen2.5-7b"],
      lengths=paper_lengths(max_out),
      calib=CAL,
      batch_size=batch,
      num_draws=1,
      scheduler="fifo",
  )


def _brute_gen(w, gpu, x):
  """T_gen from the simulator directly (same draws as the estimator)."""
  rng = np.random.default_rng([w.seed, 7])
  p, o = w.lengths.sample(rng, w.batch_size)
  gen = costs.GenCostModel.for_deployment(w.model, hardware.GPUS[gpu], CAL.gen)
  return simulate_generation(gen, x // gen.gpus, p, o, scheduler="fifo", seed=w.seed).makespan


def _brute_train(w, gpu, y):
  rng = np.random.default_rng([w.seed, 7])
  p, o = w.lengths.sample(rng, w.batch_size)
  t = costs.TrainCostModel.for_gpu(w.model, hardware.GPUS[gpu], CAL.mfu)
  return t.iteration_seconds((p + o).astype(float), y, CAL.num_minibatches)


@pytest.mark.parametrize("n", [16, 24, 32])
def test_single_dc_matches_brute_force(n):
  w = _workload()
  best = plan([Pool("main", "H800", n)], w).best
  splits = [(x, y) for x, y in itertools.product(range(8, n, 8), repeat=2) if x + y <= n]
  brute = min(
      splits,
      key=lambda s: (
          max(_brute_gen(w, "H800", s[0]), _brute_train(w, "H800", s[1])),
          s[0] + s[1],
          -s[0],
      ),
  )
  assert (best.gen_gpus, best.train_gpus) == brute
  assert best.t_gen == pytest.approx(_brute_gen(w, "H800", brute[0]))
  assert best.t_train == pytest.approx(_brute_train(w, "H800", brute[1]))


def test_cost_objective_prefers_cheaper_equal_throughput():
  w = _workload()
  est = StageEstimator(w)
  opts = single_dc(Pool("main", "H800", 32), est, objective="throughput_per_cost")
  best = opts[0]
  for a in opts:
    assert best.samples_per_s / best.cost >= a.samples_per_s / a.cost - 1e-12


def test_cross_dc_shrinks_the_faster_stage_like_brute_force():
  w = _workload()
  gen_pool, train_pool = Pool("cloud", "H20", 32, "cloud"), Pool("main", "H800", 32, "main")
  est = StageEstimator(w)
  chosen = shrink_faster(gen_pool, train_pool, est)[0]
  tg, tt = _brute_gen(w, "H20", 32), _brute_train(w, "H800", 32)
  if tg <= tt:  # shrink generation
    ks = [k for k in range(8, 33, 8) if _brute_gen(w, "H20", k) <= tt]
    k = min(ks, key=lambda k: (abs(_brute_gen(w, "H20", k) - tt), k))
    assert (chosen.gen_gpus, chosen.train_gpus) == (k, 32)
  else:
    ks = [k for k in range(8, 33, 8) if _brute_train(w, "H800", k) <= tg]
    k = min(ks, key=lambda k: (abs(_brute_train(w, "H800", k) - tg), k))
    assert (chosen.gen_gpus, chosen.train_gpus) == (32, k)
  assert chosen.cross_dc
  # Shrinking never lowers the stage-model throughput of the full allocation.
  full = est.allocation(gen_pool, 32, train_pool, 32)
  assert chosen.samples_per_s == pytest.approx(full.samples_per_s)
  assert chosen.cost <= full.cost


def test_bad_input_is_one_sentence():
  w = _workload()
  with pytest.raises(ValueError, match="only 16 exist"):
    plan([Pool("main", "H800", 16)], w, budgets={"main": 64})
  with pytest.raises(ValueError, match="no cost model"):
    plan([Pool("main", "A100", 16)], w)
  with pytest.raises(ValueError, match="no GPU pools"):
    plan([], w)
  with pytest.raises(ValueError, match="at least"):
    Pool("main", "H800", 0)
