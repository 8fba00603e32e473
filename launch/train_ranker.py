"""Trains the output-length ranker offline.

  python launch/train_ranker.py --config=configs/ranker.py --workdir=/tmp/ranker

The terminal shows StreamRL's own lines; Orbax's and the other libraries' go
to <workdir>/libraries.log. A mistake in the input prints one `error: ...`
line and exits with status 2 (--debug shows the traceback).
"""

import os
import sys

# Runnable as `python launch/train_ranker.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=wrong-import-position

from streamrl import cli, errors, metrics  # pylint: disable=wrong-import-position

_CONFIG = cli.define_config_file("config", "configs/ranker.py", "Ranker config file.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Checkpoints and TensorBoard logs go here.", required=True
)


def main(argv):
  del argv
  workdir = errors.check_workdir(_WORKDIR.value)
  metrics.configure_logging(workdir)
  from streamrl.ranker.train import train_and_evaluate  # pylint: disable=g-import-not-at-top

  results = train_and_evaluate(_CONFIG.value, workdir)
  print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in results.items()))


if __name__ == "__main__":
  cli.run_main(main)
