"""Multi-turn rollouts with tools: environments, tools, and the trajectory
bookkeeping beside each engine.

  config.py   `Env`, the run's `env.*` settings
  base.py     the environment interface (`reset` / `step` -> `Step`), the
              built-in tool environment (`[calc 1+2]` -> `(3)`), and what the
              tool workers call
  tools.py    the calculator and the Python tool
  sandbox.py  where model-written code runs: `run` / `python` in a sandbox
              of its own per call (jail.py sets up its namespaces)
  runner.py   `Trajectory` (token-in, token-out), `ToolRunner` (the tool
              workers beside an engine), `trajectory_metrics`
  agent_loop.py  `AgentLoop`: the multi-turn loop (turns, tool calls
              overlapping decoding) over an engine's narrow turn API
              (`TurnEngine`; streamrl/generator/vllm_engine.py is one);
              streamrl/generator/agentic.py turns its segments into Samples
"""

from streamrl.envs.base import BUILTIN, Environment, Step, ToolEnv, parse_call
from streamrl.envs.config import Env

__all__ = ["BUILTIN", "Env", "Environment", "Step", "ToolEnv", "parse_call"]
