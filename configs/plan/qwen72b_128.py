"""Qwen2.5-72B on 128 x H800, paper-shaped 20K outputs (the paper's Fig. 10 case).

Run:
  python launch/plan.py --config=configs/plan/qwen72b_128.py

Expected: 80 generation + 48 training GPUs (the paper's choice), async,
about 2.5 samples/s predicted (paper: 2.25). Takes ~10 s.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.model = "qwen2.5-72b"
  c.batch_size = 1024
  c.seed = 0
  c.lengths = ml_collections.ConfigDict(dict(kind="paper", max_output=20480))
  c.cluster = ml_collections.ConfigDict()
  c.cluster.pools = (dict(name="main", gpu="H800", num_gpus=128, datacenter="main"),)
  c.request = ml_collections.ConfigDict(dict(main=128))
  c.objective = "throughput"
  c.unit = 8
  c.allow_async = True
  c.simulate_iterations = 3
  c.top_k = 5
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
