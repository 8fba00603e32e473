"""The environment interface, and the built-in tool environment.

An environment is a class with no constructor arguments:

  class MyEnv:
    stop = "]"                       # a policy turn ends where it writes this
    def reset(self, prompt: str): ... -> state
    def step(self, state, action: str) -> Step

`reset` makes one trajectory's state from its prompt's text; `step` takes
that state and the text of the policy's last turn and returns a `Step`: the
new state, the observation text to append (tokenized once, never
re-tokenized later), an optional per-turn reward, and whether the
trajectory is done. The state is plain data that pickles: it travels with
the trajectory, so the members of a GRPO group never share a tool's state,
and a tool worker holds none between calls. The trajectory's reward is its
final answer's, through the task's reward (`task.reward`) on the whole
trajectory's text, as for single-turn tasks; per-turn rewards are summed
into it when an environment gives them.

A turn that ends without `stop` (the policy ended its answer) ends the
trajectory without a call to `step`.

`ToolEnv` (`env.name="calc"`, `"python"` or `"tools"`) reads a tool call as
`[name args]` at the end of the turn and answers `(result)` or
`(error reason)`: `[calc 4821+3377]` -> `(8198)`. Its characters fit the
tiny tokenizer's (`0-9a-z :=+-,()[]./*|#`).

A user's environment is named like a user's reward, `package.module:Class`
or `file.py:Class`, and runs in the same worker processes with deadlines
(streamrl/usercode.py) as every user's function: `step_in_worker` below is
what those workers call. An environment that runs model-written code (a
command, a test suite) runs it through `streamrl.envs.sandbox.run` /
`sandbox.python`, in the sandbox the run's `env.sandbox` names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol

from streamrl import usercode
from streamrl.envs import sandbox
from streamrl.envs import tools as tools_lib
from streamrl.errors import UserError


@dataclasses.dataclass(frozen=True)
class Step:
  """What an environment returns for one policy turn."""

  state: Any
  observation: str
  reward: float | None = None
  done: bool = False
  # Counted in the run's metrics: the turn called a tool, and the call failed (raised, or
  # timed out: `timed_out`).
  tool_call: bool = True
  tool_error: bool = False
  timed_out: bool = False


class Environment(Protocol):
  stop: str

  def reset(self, prompt: str) -> Any:
    ...

  def step(self, state: Any, action: str) -> Step:
    ...


_CALL = re.compile(r"\[([a-z]+) ([^\[\]]*)\]\s*$")


def parse_call(text: str) -> tuple[str, str] | None:
  """The `(tool, args)` of the `[tool args]` a turn ends with, or None."""
  m = _CALL.search(text)
  return (m.group(1), m.group(2)) if m else None


def _clean(text: str) -> str:
  # Observations stay inside the tiny tokenizer's characters (lowercase, no quotes).
  return re.sub(r"[^0-9a-z :=+\-,.\/*|#]", " ", text.lower()).strip()


class ToolEnv:
  """Built-in tools behind `[name args]` calls (streamrl/envs/tools.py)."""

  stop = "]"
  tool_names: tuple[str, ...] = ("calc", "py")
  timeout_s = 5.0

  def reset(self, prompt: str) -> dict:
    del prompt
    return {"calls": 0}

  def step(self, state: dict, action: str) -> Step:
    state = {**state, "calls": state["calls"] + 1}
    call = parse_call(action)
    if call is None:
      return Step(state, "(error no tool call)", tool_error=True)
    name, args = call
    if name not in self.tool_names:
      return Step(state, f"(error unknown tool {_clean(name)[:20]})", tool_error=True)
    try:
      result = tools_lib.TOOLS[name](args, self.timeout_s)
    except tools_lib.ToolError as err:
      return Step(state, f"(error {_clean(str(err))[:60]})", tool_error=True)
    return Step(state, f"({_clean(result)})")


class CalcEnv(ToolEnv):
  tool_names = ("calc",)


class PythonEnv(ToolEnv):
  tool_names = ("py",)


BUILTIN = {"calc": CalcEnv, "python": PythonEnv, "tools": ToolEnv}


def check_env_name(name: str) -> None:
  """UserError unless `name` is a built-in environment or names a user's class."""
  if name in BUILTIN or usercode.is_spec(name):
    if usercode.is_spec(name):
      usercode.split_spec(name)
    return
  raise UserError(
      f"env.name={name!r} is unknown; use one of {sorted(BUILTIN)} or a class "
      "`package.module:Class` / `file.py:Class`."
  )


def make_env(name: str) -> Environment:
  """An instance of the environment `name` (a built-in, or a user's class)."""
  cls = BUILTIN.get(name) or usercode.load_function(name, what="environment")
  env = cls()
  if not isinstance(getattr(env, "stop", None), str) or not env.stop:
    raise UserError(f"The environment {name!r} has no `stop` string; give the class one.")
  return env


# ------------------------------------------------- in the tool workers
_ENVS: dict[str, Environment] = {}


def step_in_worker(
    name: str,
    state: Any,
    prompt: str,
    action: str,
    timeout_s: float,
    sandbox_mode: str = "isolated",
) -> Step:
  """One turn of environment `name` in a tool worker: `reset(prompt)` first
  when the trajectory has no state yet (`state` None). The worker process
  keeps one instance per environment; `sandbox_mode` (`env.sandbox`) is the
  mode of the sandboxed calls it makes."""
  sandbox.set_default_mode(sandbox_mode)
  env = _ENVS.get(name)
  if env is None:
    env = _ENVS[name] = make_env(name)
  if hasattr(env, "timeout_s"):
    env.timeout_s = timeout_s
  if state is None:
    state = env.reset(prompt)
  step = env.step(state, action)
  if not isinstance(step, Step):
    raise TypeError(f"{name}.step returned a {type(step).__name__}, not a streamrl.envs.Step")
  return step
