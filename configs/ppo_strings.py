r"""PPO on the synthetic string tasks (cpy / rev / dbl): short answers whose
length the prompt fixes. The default before the work traces; training-bound,
so it runs fastest colocated:

  python launch/main.py --config=configs/colocated.py:ppo_strings --workdir=workdirs/strings
  python launch/main.py --config=configs/ppo_strings.py --workdir=workdirs/strings_async

Expected on a 2-core CPU laptop (colocated): about 5 minutes; held-out
accuracy rises by about 18 points over the warm-start policy.
"""

import os

import ml_collections

from streamrl import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "ppo.py"))
  c.task.kind = "synthetic"
  c.task.trace_token_fraction = 1.0
  c.task.num_eval = 256
  c.sampling.max_tokens = 56
  c.engine.max_model_len = 128
  c.trainer.micro_batch_size = 32
  return c
