"""Qwen2.5-7B on one 32 x H800 pool (the paper's 7B setup), paper-shaped 10K outputs.

Run:
  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py
  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py --config.lengths.max_output=20480
  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py --emit=plan.json [--emit_target=cpu]
  python launch/main.py --config=configs/ppo.py --plan=plan.json --workdir=W

With costs measured on a machine (launch/measure.py --config=configs/ppo.py
--out=costs.json), --config.calibration.measured=costs.json plans with them
instead of the paper's calibration.

Expected: Algorithm 1 picks 16 generation + 16 training GPUs, mode async,
about 10.4 samples/s predicted (the paper measured 10.7 for 7B/10K async).
Takes a few seconds.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.model = "qwen2.5-7b"  # one of streamrl.sim.hardware.MODELS
  c.batch_size = 1024  # samples per RL iteration
  c.seed = 0
  c.lengths = ml_collections.ConfigDict(dict(kind="paper", max_output=10240))
  c.cluster = ml_collections.ConfigDict()
  c.cluster.pools = (dict(name="main", gpu="H800", num_gpus=32, datacenter="main"),)
  # GPUs the plan may use per pool (defaults to the whole pool).
  c.request = ml_collections.ConfigDict(dict(main=32))
  c.objective = "throughput"  # or "throughput_per_cost"
  c.unit = 8  # allocation granularity in GPUs (one machine)
  c.allow_async = True  # one-step off-policy allowed
  c.simulate_iterations = 3
  # The generators' work pool in the predicted runs (scheduler.pool, scheduler.migrate):
  # "fixed" lists per instance, or "shared" (one pool; migrate=True moves stragglers).
  c.pool = "fixed"
  c.migrate = False
  c.top_k = 5
  # Fitted by experiments/sim/reproduce_paper.py on the paper's 7B cells (MFU) and
  # Table 4 (ranker recall); see its report.
  c.calibration = ml_collections.ConfigDict(
      dict(
          mfu=0.45,
          ranker_recall=0.87,
          num_minibatches=4,
          dispatch_objective="makespan",
          # launch/measure.py's costs JSON: generator and trainer costs measured
          # on a real machine instead of the paper's calibration ("": paper).
          measured="",
      )
  )
  return c
