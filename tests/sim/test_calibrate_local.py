"""experiments/sim/calibrate_costs.py: cost models from generator-alone / trainer-alone timings.

Synthetic timings built from a known PTL profile, a known per-request cost
and known trainer seconds per token must give those values back, and the
median variant must ignore one stalled batch.
"""

import pytest

from streamrl.scheduling import LatencyProfile
from streamrl.sim.calibrate import from_measured
from streamrl.sim.generation import simulate_generation

pytestmark = [pytest.mark.unit]

PROFILE = LatencyProfile(
    batch_sizes=(1, 2, 4), ptl_s=(0.002, 0.0021, 0.0023), prefill_s_per_token=1e-5
)
CAP = 4


@pytest.fixture(scope="module")
def calib():
  # The calibration's cost models and arm names, without the script's flags.
  from experiments.sim import calibrate_costs  # pylint: disable=g-import-not-at-top

  return calibrate_costs


def batch(prompts, outputs, per_request_s, fwd_tok, upd_tok, stall=0.0):
  gen_model, _ = from_measured(
      PROFILE, {"fwd_s_per_token": 0.0, "upd_s_per_token": 0.0}, max_num_seqs=CAP
  )
  replay = simulate_generation(
      gen_model, 1, prompts, outputs, queues=[list(range(len(outputs)))], caps=[CAP]
  ).makespan
  tokens = sum(prompts) + sum(outputs)
  return {
      "gen_s": replay + per_request_s * len(outputs) + stall,
      "fwd_s": fwd_tok * tokens,
      "upd_s": upd_tok * tokens + stall,
      "tokens": tokens,
      "prompt_lens": list(prompts),
      "output_lens": list(outputs),
  }


BATCHES = [
    ([10, 12, 9, 11, 10, 13, 8, 10], [5, 9, 3, 12, 7, 4, 6, 8]),
    ([11, 9, 10, 10, 12, 10, 9, 11], [6, 2, 10, 5, 7, 9, 4, 3]),
    ([10, 10, 10, 10, 10, 10, 10, 10], [8, 8, 8, 8, 8, 8, 8, 8]),
]


@pytest.mark.parametrize("stat", ["mean", "median"])
def test_recovers_per_request_and_trainer_costs(calib, stat):
  per_batch = [batch(p, o, 0.003, 1e-4, 5e-4) for p, o in BATCHES]
  c = calib.cost_models("sync", PROFILE, per_batch, [0.02, 0.04], CAP, 10.0, stat)
  assert c["per_request_s_raw"] == pytest.approx(0.003, rel=1e-6)
  assert c["trainer"]["fwd_s_per_token"] == pytest.approx(1e-4, rel=1e-6)
  assert c["trainer"]["upd_s_per_token"] == pytest.approx(5e-4, rel=1e-6)
  # The per-request cost goes in per prompt token at the mean prompt length.
  assert c["profile"]["prefill_s_per_token"] == pytest.approx(1e-5 + 0.003 / 10.0)
  assert c["profile_ptl_only"]["prefill_s_per_token"] == pytest.approx(1e-5)
  assert c["transfer_s"] == pytest.approx(0.03)


def test_median_ignores_one_stalled_batch_and_mean_does_not(calib):
  per_batch = [
      batch(p, o, 0.003, 1e-4, 5e-4, stall=(2.0 if k == 1 else 0.0))
      for k, (p, o) in enumerate(BATCHES)
  ]
  med = calib.cost_models("sync", PROFILE, per_batch, [0.02, 0.02, 0.5], CAP, 10.0, "median")
  mean = calib.cost_models("sync", PROFILE, per_batch, [0.02, 0.02, 0.5], CAP, 10.0, "mean")
  assert med["per_request_s_raw"] == pytest.approx(0.003, rel=1e-6)
  assert med["trainer"]["upd_s_per_token"] == pytest.approx(5e-4, rel=1e-6)
  assert med["transfer_s"] == pytest.approx(0.02)
  assert mean["per_request_s_raw"] > 0.003 + 1.9 / 24
  assert mean["trainer"]["upd_s_per_token"] > 5e-4


def test_negative_overhead_is_floored_and_contended_timings_are_used(calib):
  per_batch = [batch(p, o, -0.0005, 1e-4, 5e-4) for p, o in BATCHES]
  for b in per_batch:
    b["contended"] = {**batch(b["prompt_lens"], b["output_lens"], 0.006, 2e-4, 5e-4)}
  iso = calib.cost_models("stream", PROFILE, per_batch, [0.02], CAP, 10.0, "mean", "isolated")
  con = calib.cost_models("stream", PROFILE, per_batch, [0.02], CAP, 10.0, "mean", "contended")
  assert iso["per_request_s_raw"] == pytest.approx(-0.0005, rel=1e-6)
  assert iso["profile"]["prefill_s_per_token"] == pytest.approx(1e-5)  # floored at 0
  assert con["per_request_s_raw"] == pytest.approx(0.006, rel=1e-6)
  assert con["trainer"]["fwd_s_per_token"] == pytest.approx(2e-4, rel=1e-6)


@pytest.mark.parametrize("pool", ["fixed", "shared"])
def test_two_instance_arms_replay_the_instances_and_their_pool(calib, pool):
  assert [calib.arm_mode(a) for a in ("sync_2gen", "sync_2gen_pool", "async_partial")] == [
      "sync",
      "sync",
      "async_partial",
  ]
  assert calib.arm_instances("sync_2gen_pool") == 2 and calib.arm_instances("sync") == 1
  assert calib.arm_pool("sync_2gen_pool") == "shared" and calib.arm_pool("sync_2gen") == "fixed"
  gen_model, _ = from_measured(
      PROFILE, {"fwd_s_per_token": 0.0, "upd_s_per_token": 0.0}, max_num_seqs=CAP
  )
  per_batch = []
  for p, o in BATCHES:
    b = batch(p, o, 0.0, 1e-4, 5e-4)
    # Generated on two instances time-sharing one core, dealt round-robin (through one
    # pool with migration for the pool arm), plus 2 ms per request.
    b["gen_s"] = simulate_generation(
        gen_model,
        2,
        p,
        o,
        queues=[list(range(k, len(o), 2)) for k in range(2)],
        caps=[CAP] * 2,
        cores=1,
        pool=pool,
        migrate=pool == "shared",
    ).makespan + 0.002 * len(o)
    per_batch.append(b)
  c = calib.cost_models(
      "sync", PROFILE, per_batch, [0.02], CAP, 10.0, "mean", instances=2, gen_cores=1, pool=pool
  )
  assert c["per_request_s_raw"] == pytest.approx(0.002, rel=1e-6)
  # Replayed as one instance, the same batches would hide a different cost.
  one = calib.cost_models("sync", PROFILE, per_batch, [0.02], CAP, 10.0, "mean")
  assert abs(one["per_request_s_raw"] - 0.002) > 1e-4
