"""Trainer process k > 0 of a multi-process trainer (streamrl/trainer/multihost.py).

Process 0 runs the RL loop (`streamrl.train.run`) and sends each trainer
operation to the other processes; `follow` is what each of them runs
instead: it replays those operations on its own shards of the mesh.
"""

from __future__ import annotations

from streamrl.config import settings as settings_lib
from streamrl.trainer import memory_plan, protocol, setup
from streamrl.trainer.rl_trainer import RLTrainer


def follow(s: settings_lib.Settings, workdir: str, commands, reply) -> None:
  """Replays every trainer operation process 0's `run` sends through
  `commands` (streamrl/trainer/protocol.py), answering on `reply`, until
  told to stop."""
  ckpt = setup.open_checkpoints(s, workdir)  # Orbax, like `run`: every process takes part.
  try:
    make = lambda policy: RLTrainer.from_settings(policy, memory_plan.resolve_remat(s, policy.cfg))
    protocol.follow(protocol.Follower(make, ckpt, reply), commands)
  finally:
    ckpt.close()
