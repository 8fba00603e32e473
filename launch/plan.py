"""Plans a StreamRL deployment (Algorithm 1) and predicts its throughput by simulation.

  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py [--config.objective=throughput_per_cost]
  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py --emit=plan.json \
      [--emit_target=cpu --max_instances=2]
  python launch/main.py --config=configs/ppo.py --plan=plan.json --workdir=W

--emit writes the chosen plan as a plan file: a readable description and
the StreamRL config overrides that run it (streamrl/planner/emit.py has the
format and the mapping); launch/main.py --plan applies them. --emit_target=cpu
writes a CPU stand-in of the same plan (CPU engines and trainer, at most
--max_instances generators) to try it on a laptop.
--config.calibration.measured=costs.json plans with the costs
launch/measure.py measured instead of the paper's calibration.

A mistake in the plan config prints one `error: ...` line and exits with
status 2 (--debug shows the traceback).
"""

import os
import sys

# Runnable as `python launch/plan.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=wrong-import-position
from ml_collections.config_flags import config_flags  # pylint: disable=wrong-import-position

from streamrl import cli, errors  # pylint: disable=wrong-import-position
from streamrl.planner import emit  # pylint: disable=wrong-import-position
from streamrl.planner.run import run_plan  # pylint: disable=wrong-import-position

_CONFIG = cli.define_config_file("config", "configs/plan/qwen7b_single_dc.py", "Plan config file.")
_EMIT = flags.DEFINE_string(
    "emit", "", "Write the plan file (JSON) here; see launch/main.py --plan."
)
_TARGET = flags.DEFINE_enum(
    "emit_target", "gpu", emit.TARGETS, "gpu: the plan as planned; cpu: a CPU stand-in of it."
)
_MAX_INSTANCES = flags.DEFINE_integer(
    "max_instances", 2, "--emit_target=cpu: at most this many generator instances."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --name=value.")
  try:
    report = run_plan(_CONFIG.value)
  except (ValueError, FileNotFoundError) as e:
    # The planner checks its config with these; report them as input errors.
    raise errors.UserError(f"plan: {e}") from e
  print(report.text)
  if _EMIT.value:
    source = config_flags.get_config_filename(flags.FLAGS["config"])
    plan = emit.build_plan(
        report, target=_TARGET.value, max_instances=_MAX_INSTANCES.value, source=source
    )
    emit.write_plan(plan, _EMIT.value)
    print(emit.summary(plan))
    print(
        f"wrote {_EMIT.value}; run it with: python launch/main.py --config=configs/ppo.py "
        f"--plan={_EMIT.value} --workdir=<dir>"
    )
  print(
      f"RESULT mode={report.mode} gen_gpus={report.result.best.gen_gpus} "
      f"train_gpus={report.result.best.train_gpus} samples_per_s={report.predicted[report.mode]:.4f}"
  )


if __name__ == "__main__":
  cli.run_main(main)
