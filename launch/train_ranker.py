"""Trains the output-length ranker offline.

  python launch/train_ranker.py --config=configs/ranker.py --workdir=/tmp/ranker
"""

import logging
import os
import sys

# Runnable as `python launch/train_ranker.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from streamrl.ranker.train import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", "configs/ranker.py", "Ranker config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and TensorBoard logs go here.", required=True)


def main(argv):
  del argv
  # Orbax logs every checkpoint step through absl at INFO; keep ours only.
  absl_logging.set_verbosity(absl_logging.WARNING)
  logging.getLogger("streamrl").setLevel(logging.INFO)
  metrics = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))


if __name__ == "__main__":
  app.run(main)
