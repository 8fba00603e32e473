r"""GRPO, StreamRL's way, on the long-tailed work-trace task of configs/ppo.py.

Group-relative advantages (4 samples per prompt, normalised within each
group), no critic; the KL to the reference goes into the loss (k3). The same
async generation with partial rollouts, ranker and transfer service as
configs/ppo.py.

  python launch/main.py --config=configs/grpo.py --workdir=workdirs/grpo
  python launch/main.py --config=configs/colocated.py:grpo --workdir=workdirs/grpo_colocated

DAPO's dynamic sampling and overlong shaping are settings of their own
(`--config.advantage.filter_groups=True`, `--config.loss.overlong_buffer=N`,
`--config.loss.mask_truncated=True`; docs/lora_and_dapo.md).

Expected on a 2-core CPU machine: about 7 minutes; held-out task accuracy
(sampled, temperature 1) rises by about 15 points over the warm-start policy.
The measured runs are in experiments/RESULTS.md ("Runs of the configs").
"""

import os

import ml_collections

from streamrl import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "ppo.py"))
  c.advantage.estimator = "grpo"
  # 32 prompts x 4 samples: at equal samples, 16 x 8 learned less (experiments/RESULTS.md).
  c.advantage.group_size = 4
  c.advantage.use_critic = False
  c.kl.in_reward = False
  c.kl.estimator = "k3"
  c.kl.coef = 0.01
  c.advantage.whiten = False
  c.trainer.prompts_per_iteration = 32  # 32 prompts x 4 samples = 128 samples
  c.trainer.mini_batch_size = 64
  c.optimizer.lr = 3e-4
  c.trainer.num_iterations = 180
  c.log.eval_every = 60
  return c


def get_sweep():
  return [{"advantage.group_size": g, "trainer.prompts_per_iteration": 128 // g} for g in (4, 8)]
