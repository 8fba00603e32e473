"""Cost models: Fig. 7 fit, scaling rules, FLOPs, transfer, bad input."""

import numpy as np
import pytest

from streamrl.scheduling import LatencyProfile
from streamrl.sim import costs, hardware
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.hardware import GPUS, MODELS

pytestmark = [pytest.mark.unit]


def test_model_shapes_match_public_parameter_counts():
  assert MODELS["qwen2.5-7b"].num_params == pytest.approx(7.62e9, rel=0.01)
  assert MODELS["qwen2.5-32b"].num_params == pytest.approx(32.8e9, rel=0.01)
  assert MODELS["qwen2.5-72b"].num_params == pytest.approx(72.7e9, rel=0.01)
  assert MODELS["qwen2.5-7b"].kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_calibration_reproduces_fig7_within_5_percent():
  prof = LatencyProfile.from_paper()
  cal = costs.paper_calibration()
  gen = GenCostModel.for_deployment(MODELS["qwen2.5-7b"], GPUS["H800"], cal, tp=1)
  for b, ptl in zip(prof.batch_sizes, prof.ptl_s):
    assert gen.step_time(b, b * 1024) == pytest.approx(ptl, rel=0.05)
  assert 0 < cal.decode_compute_eff < 1
  assert cal.layer_overhead_s > 0


def test_decode_scaling_is_physical():
  cal = costs.paper_calibration()
  m7, m72 = MODELS["qwen2.5-7b"], MODELS["qwen2.5-72b"]
  h800, h20 = GPUS["H800"], GPUS["H20"]
  g800 = GenCostModel.for_deployment(m7, h800, cal, tp=1)
  g20 = GenCostModel.for_deployment(m7, h20, cal, tp=1)
  # H20: more HBM bandwidth (faster weight reads), far fewer FLOPs (slower per sequence).
  assert g20.step_fixed_s < g800.step_fixed_s
  assert g20.per_seq_s > 5 * g800.per_seq_s
  # More TP: faster steps, more KV room.
  g72_4 = GenCostModel.for_deployment(m72, h800, cal, tp=4)
  g72_8 = GenCostModel.for_deployment(m72, h800, cal, tp=8)
  assert g72_8.step_time(32, 32 * 4096) < g72_4.step_time(32, 32 * 4096)
  assert g72_8.kv_capacity_tokens > 2 * g72_4.kv_capacity_tokens
  assert [hardware.default_tp(MODELS[m], h800) for m in MODELS] == [1, 4, 8]


def test_decode_time_closed_form_matches_step_sum():
  g = GenCostModel(
      step_fixed_s=0.01,
      per_seq_s=0.001,
      per_ctx_token_s=1e-6,
      prefill_s_per_token=0,
      kv_capacity_tokens=1e9,
  )
  brute = sum(g.step_time(7, 700 + 7 * k) for k in range(50))
  assert g.decode_time(7, 700, 50) == pytest.approx(brute)


def test_training_flops_are_6n_for_updates_and_2n_for_forwards():
  m = MODELS["qwen2.5-7b"]
  t = TrainCostModel.for_gpu(m, GPUS["H800"], mfu=0.5)
  tokens = np.array([1.0])  # attention term negligible at T = 1
  per_token = GPUS["H800"].flops * 0.5
  assert t.forward_seconds(tokens)[0] * per_token == pytest.approx(
      3 * 2 * m.compute_params, rel=1e-4
  )
  assert t.update_seconds(tokens)[0] * per_token == pytest.approx(
      2 * 6 * m.compute_params, rel=1e-4
  )
  # Time halves with twice the GPUs.
  toks = np.full(16, 4096.0)
  assert t.iteration_seconds(toks, 16) == pytest.approx(t.iteration_seconds(toks, 8) / 2)


def test_weight_transfer_in_dc_vs_cross_dc():
  m = MODELS["qwen2.5-72b"]
  local = costs.weight_transfer_seconds(m, 80)
  remote = costs.weight_transfer_seconds(m, 80, inter_dc_link=hardware.INTER_DC_LINK)
  assert local == pytest.approx(
      m.weight_bytes / 200e9, rel=0.05
  )  # one 200 GB/s node link, pipelined
  assert remote > m.weight_bytes / 10e9  # 80 Gbps single relay dominates
  assert costs.broadcast_seconds(1e9, 0, hardware.MAIN_NODE_LINK) == 0.0


def test_unknown_gpu_and_bad_values():
  with pytest.raises(ValueError, match="no cost model"):
    hardware.get_gpu("A100")
  with pytest.raises(ValueError, match="MFU"):
    TrainCostModel.for_gpu(MODELS["qwen2.5-7b"], GPUS["H800"], mfu=1.5)
  with pytest.raises(ValueError, match="KV cache"):
    # 72B weights do not fit one H800.
    GenCostModel.for_deployment(
        MODELS["qwen2.5-72b"], GPUS["H800"], costs.paper_calibration(), tp=1
    )
