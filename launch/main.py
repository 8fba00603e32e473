r"""Runs one RL experiment.

  python launch/main.py --config=configs/ppo.py --workdir=workdirs/ppo \
      --config.optimizer.lr=3e-4

Running again with the same --workdir resumes from its last checkpoint. Each
--config.<key>=<value> overrides one key of the config file; a two-iteration
smoke run:

  python launch/main.py --config=configs/ppo.py --config.trainer.num_iterations=2

  python launch/main.py --config=configs/ppo.py --plan=plan.json --workdir=W

runs a plan written by `launch/plan.py --emit=plan.json`: its overrides apply
first, the command line's --config.* ones after (they win), and the plan file
is copied to W/plan.json (streamrl/planner/emit.py).

The terminal shows the progress bar and StreamRL's own lines; what vLLM, Ray,
Orbax and the other libraries log goes to <workdir>/libraries.log. A mistake
in the input (a bad config value, a missing file, a workdir that is a file,
an unreachable cluster) prints one `error: ...` line and exits with status 2;
add --debug (or set STREAMRL_DEBUG=1) to see its traceback.
"""

import os
import sys

# Runnable as `python launch/main.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # pylint: disable=g-import-not-at-top,wrong-import-position
from ml_collections.config_flags import config_flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from streamrl import cli, errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

_CONFIG = cli.define_config_file(
    "config",
    None,
    "The experiment's config file, path.py or path.py:arg (a relative path missing here is "
    "looked up in the checkout); --config.<key>=<value> overrides one of its keys.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "Logs and checkpoints go here.")
_PLAN = flags.DEFINE_string(
    "plan", "", "A plan file from launch/plan.py --emit; --config.* overrides win over it."
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --name=value.")
  # Relative paths in the config resolve against its file's directory (then the checkout).
  config_file = config_lib.find_config_file(config_flags.get_config_filename(flags.FLAGS["config"]))
  config = config_lib.resolve_paths(_CONFIG.value, os.path.dirname(config_file.split(":")[0]))
  if _PLAN.value:
    from streamrl.planner import emit  # pylint: disable=g-import-not-at-top

    command_line = config_flags.get_override_values(flags.FLAGS["config"])
    config = emit.apply_plan(config, emit.load_plan(_PLAN.value), command_line, path=_PLAN.value)
  # Both checked before anything is written: a refused run leaves no workdir behind.
  workdir = errors.check_workdir(_WORKDIR.value)
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top

  s = settings.from_config(config)
  from streamrl import metrics  # pylint: disable=g-import-not-at-top

  metrics.configure_logging(workdir)  # Creates it; before vLLM and Ray log anything.
  from streamrl import experiment  # pylint: disable=g-import-not-at-top

  if _PLAN.value:
    s = experiment.record_plan(_PLAN.value, workdir, config)  # W/plan.json
  final = experiment.run(s, workdir)
  print({k: round(v, 4) for k, v in final.items() if "eval" in k})


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run_main(main)
