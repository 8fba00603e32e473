r"""Agentic GRPO, StreamRL's way: multi-turn trajectories with a calculator tool.

  python launch/main.py --config=configs/agentic.py --workdir=workdirs/agentic
  python launch/main.py --config=configs/colocated.py:agentic --workdir=workdirs/agentic_colocated

The task (task.kind=calc, streamrl/data/calc.py): sums of 2 to 6 four-digit
numbers, long-tailed in the number of terms. The tiny policy cannot add them
itself; it can call `[calc a+b]` and read `(result)`, one call per term, then
answer `#total`. A trajectory alternates policy turns with tool calls that
run in worker processes beside the engine (streamrl/envs), so the engine
keeps decoding other trajectories while a tool runs; the observation's tokens
are appended as they are (never re-tokenized) and left out of the loss.
The warm-up teaches the call format on a quarter of its targets and the bare
answer on the rest, so the warm-started policy mostly answers without the
tool, and wrongly: RL has to find that calling it pays.

Same StreamRL machinery as configs/grpo.py (async generation one version
ahead, the ranker, the transfer service) except partial rollouts, which do
not resume trajectories yet (pipeline.partial=auto is off with an
environment). The colocated baseline
overlaps tool calls across trajectories too.
"""

import os

import ml_collections

from streamrl import config_utils


def get_config() -> ml_collections.ConfigDict:
  c = config_utils.load_config(os.path.join(os.path.dirname(__file__), "grpo.py"))
  c.task.kind = "calc"
  c.task.reward = "exact_match"
  c.task.num_eval = 256
  c.env.name = "calc"
  c.env.max_turns = 6
  c.env.max_tokens_per_turn = 24
  # The whole trajectory (turns and observations): 5 calls of ~22 tokens and the answer.
  c.sampling.max_tokens = 160
  c.engine.max_model_len = 256
  c.trainer.num_iterations = 60
  c.log.eval_every = 20
  return c
