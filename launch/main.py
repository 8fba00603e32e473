r"""Runs one RL experiment.

  python launch/main.py --config=configs/ppo.py --workdir=workdirs/ppo \
      --config.trainer.lr=3e-4

Running again with the same --workdir resumes from its last checkpoint.
"""

from absl import app, flags

from streamrl import config_utils

_CONFIG = config_utils.define_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "Logs and checkpoints go here.")


def main(argv):
  del argv
  from streamrl import metrics, train  # pylint: disable=g-import-not-at-top
  metrics.configure_logging()
  final = train.run(_CONFIG.value, _WORKDIR.value)
  print({k: round(v, 4) for k, v in final.items() if "eval" in k})


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main, flags_parser=config_utils.parse_flags_or_exit)
