"""Trajectories and the tool workers beside an engine.

A `Trajectory` is kept as token ids, token-in token-out: each policy turn's
tokens are the engine's, each observation is tokenized once and appended,
and nothing is ever re-tokenized, so the tokens the trainer scores are the
tokens the engine sampled (the drift behind verl #6501 / TRL #5242 cannot
happen). `mask` is 1 on policy tokens and 0 on observation tokens (the loss
and the KL leave those out); observation tokens carry logprob 0.

A trajectory the engine's `stop()` ends early (partial rollouts) comes back
PARTIAL with a `Resume`: whether it was cut mid-turn, waits on a tool call
or is ready for its next turn, with the environment's state and the counts.
A request carrying it continues the trajectory where it stopped, under
whatever weights the engine has then; each segment's tokens are that
segment's policy's.

`ToolRunner` runs environment steps in `env.tool_workers` worker processes
(streamrl/usercode.py: a call past its deadline kills its worker; a crash
or an exception is a `Failure`), so the engine keeps decoding other
trajectories while a tool runs. A failed call becomes an error observation,
never an exception into the generation loop. An environment that may run
model-written code (any but the calculator) checks first that its sandbox
(`env.sandbox`, streamrl/envs/sandbox.py) can be made here, and refuses to
start otherwise.

Observations are rendered as the model expects: with a chat template, as a
`tool` turn (the template's text that turn adds after the assistant's
tokens, the assistant's end-of-turn included: `Observer`); without one, as
the observation's text itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any

import numpy as np

from streamrl import usercode
from streamrl.envs import base, sandbox
from streamrl.envs.config import Env
from streamrl.errors import UserError

# Finish reasons of a trajectory beyond the engine's ("stop", "length").
MAX_TURNS = "max_turns"
# Built-in environments that run no model-written code (no sandbox to check).
CODE_FREE = ("calc",)


@dataclasses.dataclass(frozen=True)
class Resume:
  """Where a trajectory stopped by the engine's `stop()` goes on from.

  Carried by its PARTIAL `Sample` and by the `Request` that resumes it (their
  `trajectory` field), so it is plain data that pickles; the partial-rollout
  buffer checkpoints it as JSON, the environment's `state` included. The
  request's prompt is the original prompt and every token so far, as a
  single-turn resume's is; `prompt_len` says where the original prompt ends.
  The counts are the whole trajectory's so far.
  """

  prompt_len: int
  state: Any = None  # the environment's
  turns: int = 0
  turn_start: int = 0  # where the last turn began, in the original prompt + tokens
  turn_cut: bool = False  # the last turn was cut mid-way: the next request continues it
  tool_pending: bool = False  # the last turn's tool call has not run yet
  tool_calls: int = 0
  tool_errors: int = 0
  tool_timeouts: int = 0
  tool_s: float = 0.0
  idle_s: float = 0.0
  reward: float = 0.0


# What a Trajectory hands on in a Resume (all of it but `tool_pending`, which the engine
# knows from where the trajectory waits).
_CARRIED = tuple(f.name for f in dataclasses.fields(Resume) if f.name != "tool_pending")


@dataclasses.dataclass
class Trajectory:
  """One multi-turn rollout in progress (see the module docstring).

  `prompt` is what this segment continues from: the original prompt, and for a
  resumed trajectory (`Trajectory.resumed`) the tokens of its earlier segments too;
  `tokens`, `logprobs` and `mask` are this segment's.
  """

  prompt_id: int
  prompt: tuple[int, ...]
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  mask: list[int] = dataclasses.field(default_factory=list)
  prompt_len: int | None = None  # the original prompt's length in `prompt` (None: all of it)
  state: Any = None
  turns: int = 0
  turn_start: int = 0  # index in `context` where the running turn began
  turn_cut: bool = False  # the last turn was cut by stop(); the next request continues it
  tool_calls: int = 0
  tool_errors: int = 0
  tool_timeouts: int = 0
  tool_s: float = 0.0
  # Its share of the seconds its engine had nothing to decode while tool calls ran
  # (split evenly among the trajectories waiting then).
  idle_s: float = 0.0
  reward: float = 0.0  # sum of the environment's per-turn rewards

  def __post_init__(self):
    if self.prompt_len is None:
      self.prompt_len = len(self.prompt)

  @classmethod
  def resumed(cls, prompt_id: int, prompt, resume: Resume) -> Trajectory:
    """The trajectory `resume` describes; `prompt` holds the original prompt and its tokens."""
    carried = {name: getattr(resume, name) for name in _CARRIED}
    return cls(prompt_id, tuple(int(t) for t in prompt), **carried)

  def resume(self, *, tool_pending: bool = False) -> Resume:
    """What the next segment needs (`tool_pending`: the last turn's tool call has not run)."""
    return Resume(tool_pending=tool_pending, **{name: getattr(self, name) for name in _CARRIED})

  @property
  def context(self) -> tuple[int, ...]:
    """What the engine continues from: the prompt and every token so far."""
    return self.prompt + tuple(self.tokens)

  @property
  def generated(self) -> int:
    """The trajectory's tokens after the original prompt, every segment's."""
    return len(self.prompt) + len(self.tokens) - self.prompt_len

  @property
  def turn_tokens(self) -> int:
    """Tokens the running turn has so far (0 unless it was cut)."""
    return len(self.prompt) + len(self.tokens) - self.turn_start if self.turn_cut else 0

  def add_turn(self, token_ids, logprobs, *, cut: bool = False) -> None:
    """Appends a policy turn's tokens, continuing the last turn if that was cut; `cut`: this
    one is still unfinished (stopped mid-turn)."""
    if not self.turn_cut:
      self.turn_start = len(self.prompt) + len(self.tokens)
      self.turns += 1
    self.tokens.extend(int(t) for t in token_ids)
    self.logprobs.extend(float(x) for x in logprobs)
    self.mask.extend([1] * len(token_ids))
    self.turn_cut = cut

  def add_observation(self, ids) -> None:
    self.tokens.extend(int(t) for t in ids)
    self.logprobs.extend([0.0] * len(ids))
    self.mask.extend([0] * len(ids))

  def stats(self) -> dict:
    return {
        "turns": self.turns,
        "tool_calls": self.tool_calls,
        "tool_errors": self.tool_errors,
        "tool_timeouts": self.tool_timeouts,
        "tool_s": self.tool_s,
        "idle_s": self.idle_s,
        "env_reward": self.reward,
    }


class Observer:
  """Observation text -> the token ids appended after a policy turn."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._suffix: tuple[str, str] | None = None
    if tokenizer.chat:
      # The template's text between an assistant's content and a tool turn's content, and
      # after it, from a stand-in conversation (templates render each turn alike).
      gen = tokenizer.render([{"role": "user", "content": "u"}], add_generation_prompt=True)
      marker = "\x00obs\x00"
      after = tokenizer.render(
          [
              {"role": "user", "content": "u"},
              {"role": "assistant", "content": "a"},
              {"role": "tool", "content": marker},
          ],
          add_generation_prompt=True,
      )
      if not after.startswith(gen + "a") or marker not in after:
        raise UserError(
            "The chat template renders a tool turn in a way a trajectory cannot append to "
            "(it rewrites the assistant's turn); use a template with a `tool` role or "
            "task.chat_template=off."
        )
      rest = after[len(gen) + 1 :]
      self._suffix = tuple(rest.split(marker, 1))

  def ids(self, observation: str) -> list[int]:
    if self._suffix is None:
      return self.tokenizer.encode_text(observation)
    head, tail = self._suffix
    return self.tokenizer.encode_text(head + observation + tail)


class ToolRunner:
  """The environment of `env` in worker processes beside one engine."""

  def __init__(self, env: Env, tokenizer):
    self.config = env
    self.env_name = env.name
    self.stop = base.make_env(env.name).stop  # refused here, before the run, if it cannot load
    stop_ids = tokenizer.encode_text(self.stop)
    if len(stop_ids) != 1:
      raise UserError(
          f"The environment's stop string {self.stop!r} is {len(stop_ids)} tokens for this "
          "tokenizer; a turn can end only on one token: pick a stop string that is one token."
      )
    self.stop_token_id = stop_ids[0]
    if env.name not in CODE_FREE:
      sandbox.check(env.sandbox)  # refused here, before the run, where none can be made
    self.tokenizer = tokenizer
    self.observer = Observer(tokenizer)
    self.timeout_s = env.tool_timeout_s
    self._pool = usercode.WorkerPool(
        "streamrl.envs.base:step_in_worker",
        workers=env.tool_workers,
        timeout_s=self.timeout_s + 2.0,  # the tool's own limit first, then the worker's
    )

  def wants_tool(self, traj: Trajectory, token_ids) -> bool:
    """Whether the turn just added ends on the environment's stop token (a tool call)."""
    return bool(token_ids) and int(token_ids[-1]) == self.stop_token_id

  def submit(self, traj: Trajectory) -> concurrent.futures.Future:
    """The environment's step on `traj`'s last turn: a Future of a `base.Step`."""
    action = self.tokenizer.decode(traj.context[traj.turn_start :])
    prompt = self.tokenizer.decode(traj.prompt[: traj.prompt_len]) if traj.state is None else ""
    started = time.perf_counter()
    inner = self._pool.submit(
        self.env_name,
        traj.state,
        prompt,
        action,
        self.config.tool_timeout_s,
        self.config.sandbox,
    )
    out: concurrent.futures.Future = concurrent.futures.Future()

    def finish(result):
      traj.tool_s += time.perf_counter() - started
      out.set_result(result)

    def done(f):
      result = f.result()
      if isinstance(result, usercode.Failure):
        timed_out = result.kind == "Timeout"
        why = "timeout" if timed_out else "tool failed"
        result = base.Step(traj.state, f"(error {why})", tool_error=True, timed_out=timed_out)
      latency = self.config.extra_tool_latency_s
      if latency > 0:
        # A remote tool's latency (a search API, a code runner elsewhere) holds no local
        # worker: the answer is handed on that much later, whatever else runs meanwhile.
        timer = threading.Timer(latency, finish, (result,))
        timer.daemon = True
        timer.start()
      else:
        finish(result)

    inner.add_done_callback(done)
    return out

  def apply(self, traj: Trajectory, step: base.Step) -> list[int]:
    """Records `step` on `traj`; the observation's token ids to append."""
    traj.state = step.state
    traj.tool_calls += int(step.tool_call)
    traj.tool_errors += int(step.tool_error)
    traj.tool_timeouts += int(step.timed_out)
    if step.reward is not None:
      traj.reward += float(step.reward)
    return self.observer.ids(step.observation)

  def close(self) -> None:
    self._pool.close()


def trajectory_metrics(samples) -> dict[str, float]:
  """Per-iteration scalars of multi-turn samples (`env/*`); {} for single-turn ones."""
  stats = [s.turns for s in samples if getattr(s, "turns", None) is not None]
  if not stats:
    return {}
  turns = np.array([t.turns for t in stats], np.float64)
  policy = sum(sum(s.mask) for s in samples if s.mask is not None)
  observed = sum(len(s.mask) - sum(s.mask) for s in samples if s.mask is not None)
  return {
      "env/turns_mean": float(turns.mean()),
      "env/turns_p99": float(np.percentile(turns, 99)),
      "env/tool_calls": float(sum(t.tool_calls for t in stats)),
      "env/tool_errors": float(sum(t.tool_errors for t in stats)),
      "env/tool_timeouts": float(sum(t.tool_timeouts for t in stats)),
      "env/tool_s": float(sum(t.tool_s for t in stats)),
      # Seconds the engines sat idle waiting on these trajectories' tools.
      "env/engine_idle_s": float(sum(t.idle_s for t in stats)),
      "env/tokens_per_turn": float(policy / max(turns.sum(), 1.0)),
      "env/observation_tokens": float(observed),
  }
