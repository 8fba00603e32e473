"""A real, checkpointed run workdir for the export tests (test_export*.py).

`train.run` itself, with the engine replaced by `FakeRollout` (the export
is what is tested, not generation): the warm-start directory, config.json
and the Orbax checkpoints of two iterations of PPO with a critic, so the
checkpoints hold optimizer and critic state the export must leave alone.
"""

import glob
import json
import os

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = json.loads(open(os.path.join(TESTS, "tiny_run.json")).read())
# Cheaper than the tiny run, still two checkpoints: no supervised warm-up
# steps (a random-init tiny policy, still cached as the warm-start directory)
# and one micro-batch per step. The fake answers earn no reward, so no
# advantage either: an entropy bonus is what moves the actor off its init.
EXPORT_RUN = {
    **TINY,
    "warmstart.steps": 0,
    "trainer.micro_batch_size": 8,
    "loss.entropy_coef": 0.05,
}


@pytest.fixture(scope="session")
def export_run(tmp_path_factory):
  """(workdir, settings, trainer) of a finished two-iteration run with
  checkpoints 1 and 2; the trainer, taken from the run, holds step 2's state."""
  from streamrl import train
  from streamrl import config as config_lib
  from streamrl.config import settings
  from streamrl.generator.fake import FakeRollout

  class Recorded(train.RLTrainer):
    made = []

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      Recorded.made.append(self)

  config = config_lib.apply_overrides(config_lib.load_config("configs/ppo.py"), EXPORT_RUN)
  s = settings.from_config(config)
  workdir = str(tmp_path_factory.mktemp("export_run") / "run")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train, "make_rollout", lambda *args, **kwargs: FakeRollout())
    mp.setattr(train, "RLTrainer", Recorded)
    train.run(s, workdir)
  (trainer,) = Recorded.made
  return workdir, s, trainer


@pytest.fixture(scope="session")
def trained_policy(export_run):
  """(model_dir, Flax policy): the run's policy directory and its actor as
  the trainer held it when it saved the last checkpoint (step 2)."""
  workdir, _, trainer = export_run
  (model_dir,) = glob.glob(os.path.join(workdir, "warmstart-*"))
  return model_dir, trainer.policy()
