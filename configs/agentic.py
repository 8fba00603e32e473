r"""Agentic GRPO, StreamRL's way: multi-turn trajectories with a calculator tool.

  python launch/main.py --config=configs/agentic.py --workdir=workdirs/agentic
  python launch/main.py --config=configs/colocated.py:agentic --workdir=workdirs/agentic_colocated

The task (task.kind=calc, streamrl/data/calc.py): sums of 2 to 6 four-digit
numbers, long-tailed in the number of terms. The tiny policy cannot add them
itself; it can call the calculator on what is left, `[calc 4821+3377+1234]`,
which adds the first two numbers and answers with the rest, `(8198+1234)`,
one call per addition, then answer `#9432`. A trajectory alternates policy turns with tool calls that
run in worker processes beside the engine (streamrl/envs), so the engine
keeps decoding other trajectories while a tool runs; the observation's tokens
are appended as they are (never re-tokenized) and left out of the loss.
The warm-up teaches the calls on a quarter of its targets (the calculator's
answers masked out of the loss) and the bare answer on the rest, so the
warm-started policy mostly answers without the tool, and wrongly: RL has to
find that calling it pays.

Expected on a 2-core CPU machine: under 10 minutes with the warm-up; held-out
accuracy (sampled, temperature 1) rises by more than 20 points. The measured
runs are in experiments/RESULTS.md ("Runs of the configs").

Same StreamRL machinery as configs/grpo.py: async generation one version
ahead with partial rollouts (a trajectory cut mid-turn or waiting on a tool
resumes in the next round under new weights), the ranker (on trajectory
length), the transfer service. The colocated baseline overlaps tool calls
across trajectories too.
"""

import os

import ml_collections

from streamrl import config as config_lib


def get_config() -> ml_collections.ConfigDict:
  c = config_lib.load_config(os.path.join(os.path.dirname(__file__), "grpo.py"))
  c.task.kind = "calc"
  c.task.reward = "exact_match"
  c.task.num_eval = 256
  c.env.name = "calc"
  c.env.max_turns = 6
  # A call copies what is left: 36 tokens for six four-digit terms.
  c.env.max_tokens_per_turn = 40
  # The whole trajectory (turns and observations): 226 tokens for six terms.
  c.sampling.max_tokens = 240
  c.engine.max_model_len = 320
  # The warm-up: 500 steps of tool trajectories alone (observations masked), where the
  # policy learns to copy what is left into a call, then 250 of a mixture with 15 % of
  # them and bare answers, after which it mostly answers without the tool.
  c.task.calc_tool_steps = 500
  c.task.calc_tool_fraction = 0.15
  c.warmstart.steps = 750
  c.trainer.num_iterations = 100
  c.log.eval_every = 20
  return c
