"""Plans a StreamRL deployment (Algorithm 1) and predicts its throughput by simulation.

  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py [--config.objective=throughput_per_cost]

A mistake in the plan config prints one `error: ...` line and exits with
status 2 (--debug shows the traceback).
"""

import os
import sys

# Runnable as `python launch/plan.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streamrl import config_utils, errors  # pylint: disable=wrong-import-position
from streamrl.planner.run import run_plan  # pylint: disable=wrong-import-position

_CONFIG = config_utils.define_config_file(
    "config", "configs/plan/qwen7b_single_dc.py", "Plan config file."
)


def main(argv):
  del argv
  try:
    report = run_plan(_CONFIG.value)
  except (ValueError, FileNotFoundError) as e:
    # The planner checks its config with these; report them as input errors.
    raise errors.UserError(f"plan: {e}") from e
  print(report.text)
  print(
      f"RESULT mode={report.mode} gen_gpus={report.result.best.gen_gpus} "
      f"train_gpus={report.result.best.train_gpus} samples_per_s={report.predicted[report.mode]:.4f}"
  )


if __name__ == "__main__":
  config_utils.run_main(main)
