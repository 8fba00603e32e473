"""Plans a StreamRL deployment (Algorithm 1) and predicts its throughput by simulation.

  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py [--config.objective=throughput_per_cost]
"""

import os
import sys

# Runnable as `python launch/plan.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from ml_collections import config_flags

from streamrl.planner.run import run_plan

_CONFIG = config_flags.DEFINE_config_file("config", "configs/plan/qwen7b_single_dc.py", "Plan config file.")


def main(argv):
  del argv
  try:
    report = run_plan(_CONFIG.value)
  except (ValueError, FileNotFoundError) as e:
    sys.exit(f"plan: {e}")
  print(report.text)
  print(f"RESULT mode={report.mode} gen_gpus={report.result.best.gen_gpus} "
        f"train_gpus={report.result.best.train_gpus} samples_per_s={report.predicted[report.mode]:.4f}")


if __name__ == "__main__":
  app.run(main)
