"""The environment's settings (`env.*`): multi-turn rollouts with tools.

`env.name` empty is a single-turn run (one prompt, one completion). Set, a
rollout is a trajectory: the policy writes a turn, a tool call in it (see
streamrl/envs/base.py) runs in a worker pool beside the engine, its
observation is appended as tokens, and the policy writes the next turn,
until it answers without a tool call or reaches a limit. The whole
trajectory's budget after the prompt (policy and observation tokens) is
`sampling.max_tokens`, as a single-turn response's is.
"""

from __future__ import annotations

import dataclasses

from streamrl.config.checks import positive
from streamrl.envs import sandbox as sandbox_lib


@dataclasses.dataclass(frozen=True)
class Env:
  """Which environment a trajectory runs in, and its limits.

  Attributes:
    name: "" (single-turn), a built-in environment (`envs.BUILTIN`: "calc"
      for the calculator, "python" for the Python sandbox, "tools" for
      both), or a user's class `package.module:Class` / `file.py:Class`.
    max_turns: policy turns per trajectory at most; a trajectory still
      calling tools after its last turn ends there (finish_reason
      "max_turns").
    max_tokens_per_turn: tokens one policy turn generates at most.
    tool_timeout_s: wall-clock limit of one tool call; past it the call is
      cut (its worker killed) and the observation says so.
    tool_workers: worker processes running tool calls beside the engine
      (each generator instance has its own).
    extra_tool_latency_s: seconds added to every tool call, standing in for
      a slow remote tool (a search API, a code runner elsewhere) in
      benchmarks: the answer is handed on that much later without holding a
      tool worker, so calls wait out their latency concurrently.
    sandbox: where model-written code runs (the `python` tool, and a user's
      environment through `streamrl.envs.sandbox`): "isolated", a sandbox
      of its own per call (new user, mount, PID and network namespaces:
      streamrl/envs/sandbox.py), and the tool workers refuse to start where
      the kernel cannot make one; "unsafe", a subprocess with resource limits
      only, whose code can read and write whatever the run's user can.
  """

  name: str = ""
  max_turns: int = 6
  max_tokens_per_turn: int = 48
  tool_timeout_s: float = 5.0
  tool_workers: int = 2
  extra_tool_latency_s: float = 0.0
  sandbox: str = "isolated"

  @property
  def enabled(self) -> bool:
    return bool(self.name)

  def check(self) -> None:
    positive("env.max_turns", self.max_turns)
    positive("env.max_tokens_per_turn", self.max_tokens_per_turn)
    positive("env.tool_timeout_s", self.tool_timeout_s)
    positive("env.tool_workers", self.tool_workers)
    positive("env.extra_tool_latency_s", self.extra_tool_latency_s, zero_ok=True)
    sandbox_lib.check_mode(self.sandbox)
    if self.name:
      from streamrl.envs import base  # pylint: disable=g-import-not-at-top

      base.check_env_name(self.name)
