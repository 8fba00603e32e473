r"""Runs one RL experiment.

  python launch/main.py --config=configs/ppo.py --workdir=workdirs/ppo \
      --config.trainer.lr=3e-4

Running again with the same --workdir resumes from its last checkpoint.

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

from streamrl import config_utils, errors  # pylint: disable=g-import-not-at-top,wrong-import-position

_CONFIG = config_utils.define_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "Logs and checkpoints go here.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --name=value.")
  # Checked before the heavy imports, so a wrong path fails at once.
  workdir = errors.check_workdir(_WORKDIR.value)
  from streamrl import metrics  # pylint: disable=g-import-not-at-top

  metrics.configure_logging(
      workdir
  )  # Before the heavy imports, so JAX's and vLLM's lines go to the file.
  from streamrl import experiment  # pylint: disable=g-import-not-at-top

  final = experiment.run(_CONFIG.value, workdir)
  print({k: round(v, 4) for k, v in final.items() if "eval" in k})


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  config_utils.run_main(main)
