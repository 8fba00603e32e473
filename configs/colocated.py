r"""The colocated, FIFO baseline of another config: the verl-like setup the
paper argues against, on the same workload and algorithm.

  python launch/main.py --config=configs/colocated.py:ppo --workdir=workdirs/ppo_colocated
  python launch/main.py --config=configs/colocated.py:grpo --workdir=workdirs/grpo_colocated

Generation and training take turns on the same devices (pipeline.mode=
colocated), prompts go to the engine in order (no ranker), and new weights
load in process (no transfer service). Everything else is the named config's.
"""

import os

import ml_collections

from streamrl import config as config_lib


def get_config(arg: str = "ppo") -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), f"{arg}.py"))
  c.pipeline.mode = "colocated"
  c.scheduler.kind = "fifo"
  c.transfer.enabled = False
  c.elastic.enabled = False
  return c
