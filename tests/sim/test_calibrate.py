"""Measured-cost path: from_measured and predict_local_throughput."""

import json

import pytest

from streamrl.scheduling import LatencyProfile
from streamrl.sim.calibrate import from_measured, predict_local_throughput

pytestmark = [pytest.mark.unit]

PROFILE = {"batch_sizes": [1, 4, 16], "ptl_s": [0.010, 0.011, 0.015], "prefill_s_per_token": 1e-4}
TRAINER = {"fwd_s_per_token": 1e-4, "upd_s_per_token": 3e-4, "update_overhead_s": 0.05}


def test_from_measured_fits_profile(tmp_path):
  LatencyProfile.from_dict(PROFILE).to_json(tmp_path / "p.json")
  (tmp_path / "t.json").write_text(json.dumps(TRAINER))
  gen, train = from_measured(tmp_path / "p.json", tmp_path / "t.json")
  for b, ptl in zip(PROFILE["batch_sizes"], PROFILE["ptl_s"]):
    assert gen.step_time(b, 0) == pytest.approx(ptl, rel=0.05)
  assert train.update_seconds([10.0])[0] == pytest.approx(3e-3)


def test_predict_orders_modes_and_matches_closed_form():
  kw = dict(output_lens=[50], prompt_lens=10, batch_size=8, num_instances=2, num_minibatches=1)
  res = {
      m: predict_local_throughput(PROFILE, TRAINER, m, **kw) for m in ("sync", "stream", "async")
  }
  g, _ = from_measured(PROFILE, TRAINER)
  gen = 4 * 10 * 1e-4 + 50 * g.step_time(4, 0)  # prefill of 4 prompts + 50 steps at BS 4
  train = 8 * 60 * (1e-4 + 3e-4) + 0.05  # one mini-batch update
  assert res["sync"]["iteration_s"] == pytest.approx(gen + train, rel=1e-6)
  assert res["stream"]["iteration_s"] == pytest.approx(gen + train, rel=1e-6)  # all finish together
  assert res["async"]["iteration_s"] == pytest.approx(max(gen, train), rel=1e-6)


def test_missing_inputs_are_clear(tmp_path):
  with pytest.raises(FileNotFoundError, match="measure it first"):
    from_measured(tmp_path / "nope.json", TRAINER)
  with pytest.raises(ValueError, match="missing"):
    from_measured(PROFILE, {"fwd_s_per_token": 1.0})


def test_rescale_trainer_keeps_the_split_and_records_the_factor():
  from streamrl.sim.calibrate import rescale_trainer

  t = {"fwd_s_per_token": 1e-4, "upd_s_per_token": 3e-4, "name": "cpu"}
  out = rescale_trainer(t, 1e-3)
  assert out["fwd_s_per_token"] == pytest.approx(2.5e-4)
  assert out["upd_s_per_token"] == pytest.approx(7.5e-4)
  assert out["one_process_scale"] == pytest.approx(2.5) and out["name"] == "cpu"
  assert t["fwd_s_per_token"] == 1e-4  # the measured model is left as it was
  with pytest.raises(ValueError, match="both must be > 0"):
    rescale_trainer(t, 0.0)
