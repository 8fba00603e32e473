"""The multi-turn agent loop: trajectories of policy turns and tool calls on one engine.

`AgentLoop.run` takes requests and hands back one `Segment` per request
as it ends, each a trajectory (runner.py): policy turns decoded by the
engine, tool calls run by the environment's workers (`ToolRunner`),
observations appended as tokens.

The loop drives its engine only through `TurnEngine` below (admit a turn,
step, abort, the tokenizer): `streamrl.generator.vllm_engine.GeneratorInstance`
is one, and keeps every vLLM concern to itself. The generator package turns
segments into its Samples (streamrl/generator/agentic.py); nothing here
imports torch, vLLM or the generator's modules.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from streamrl.envs.config import Env
from streamrl.envs.runner import MAX_TURNS, Resume, ToolRunner, Trajectory
from streamrl.generator.config import Sampling


class TurnOutput(Protocol):
  """One request's output after an engine step."""

  key: str  # what `TurnEngine.add_request` returned
  finished: bool  # the request ended with this step

  @property
  def token_ids(self) -> Sequence[int]:
    """Its tokens so far."""

  @property
  def finish_reason(self) -> str:
    """Why it ended ("stop", "length", ...), once finished."""

  def logprobs(self) -> tuple[float, ...]:
    """The sampled logprob of each of `token_ids`."""


class TurnEngine(Protocol):
  """What the agent loop needs of an engine: one policy turn is one request."""

  max_model_len: int

  def add_request(
      self,
      prompt_id: int,
      token_ids: Sequence[int],
      sampling: Sampling,
      *,
      seed: int | None = None,
      max_tokens: int | None = None,
      stop_token_ids: tuple[int, ...] = (),
  ) -> str:
    """Admits a request continuing `token_ids` (seeded with seed + prompt_id); its key."""

  def step(self) -> Iterator[TurnOutput]:
    """One engine step: the output of each running request that made progress."""

  def abort(self, keys: Sequence[str] | None = None) -> None:
    """Stops `keys`; None: every running request, leaving the engine empty."""

  def tokenizer(self, chat_template: str = "auto", chat_template_kwargs: dict | None = None):
    """The model's `streamrl.data.tokenizer.Tokenizer`."""


@dataclasses.dataclass(frozen=True)
class Segment:
  """What the loop hands back for one request.

  Attributes:
    trajectory: its trajectory as it ended (this segment's tokens after
      `trajectory.prompt`); None for a request stopped before it started.
    finish_reason: why it ended ("stop", "length", `runner.MAX_TURNS`, ...);
      None: stopped early (a partial rollout), to go on from `resume`.
    resume: where a stopped trajectory goes on from.
    request: the request stopped before it started (with no trajectory).
  """

  trajectory: Trajectory | None
  finish_reason: str | None
  resume: Resume | None = None
  request: Any = None


class AgentLoop:
  """Multi-turn rollouts of `env` on `engine`, with the tool workers beside it.

  Args:
    engine: a `TurnEngine` (the loop runs on it; it is not closed here).
    env: the run's `env.*`, with an environment named.
    chat_template: the task's `task.chat_template` mode (how observations
      are rendered).
    chat_template_kwargs: the template's extra variables (`task.chat_template_kwargs`).
  """

  def __init__(
      self,
      engine: TurnEngine,
      env: Env,
      *,
      chat_template: str = "auto",
      chat_template_kwargs: dict | None = None,
  ):
    self.engine = engine
    self.tools = ToolRunner(env, engine.tokenizer(chat_template, chat_template_kwargs))
    self.tool_wait_s = 0.0  # seconds the engine had nothing to decode, waiting on tools

  def close(self) -> None:
    """Stops the tool workers."""
    self.tools.close()

  def run(
      self,
      pending,
      sampling: Sampling,
      *,
      seed: int | None,
      cap: int,
      stop: Callable[[], bool] | None = None,
      feed=None,
  ) -> Iterator[Segment]:
    """Yields one `Segment` per request as its trajectory ends.

    `pending` holds the requests not started yet, in admission order (a
    deque-like queue: `popleft`, `clear`, iteration); `feed`, when given,
    is a shared pool's `scheduling.pool.Feed` that `pending` is: more
    requests may come while it is `open` (trajectories never move). At most
    `cap` turns run at once (`TurnEngine.admission_cap`); `sampling` and
    `seed` as in the engine's `generate`: a turn of trajectory p samples
    with its own seed, derived from `seed` and p.

    A trajectory's turns all run on this engine (its prefix is cached), each
    turn a request that continues from the trajectory's tokens so far. A turn
    that ends on the environment's stop token goes to the tool workers; the
    engine decodes the other trajectories meanwhile, and the next turn is
    admitted (before new prompts) once the observation is appended. A
    trajectory ends when a turn ends otherwise (EOS, or its turn budget),
    at `env.max_turns`, or when `sampling.max_tokens` (policy and
    observation tokens, every segment's) is used up.

    `stop` ends the stream with a stopped segment of each trajectory carrying a
    `runner.Resume`: one cut mid-turn keeps the tokens its turn has so far (the
    newest unfinished output), one waiting on a tool gives up the call (it
    runs again on resume), one ready for its next turn is as it was. A request
    with a `trajectory` resumes it from its prompt (the original prompt and
    every token so far): a cut turn goes on with what is left of its
    `env.max_tokens_per_turn`, counted as the same turn and sampled with its
    seed; a pending tool call runs first; then on as usual.
    """
    engine, tools = self.engine, self.tools
    env = tools.config
    ready: collections.deque = collections.deque()  # observation in, next turn to start
    running: dict[str, Trajectory] = {}
    latest: dict[str, TurnOutput] = {}  # request -> its newest (unfinished) output
    waiting: dict = {}  # Future of a Step -> its trajectory

    def budget(traj) -> int:
      left = min(sampling.max_tokens - traj.generated, engine.max_model_len - len(traj.context))
      return min(env.max_tokens_per_turn - traj.turn_tokens, left)

    try:
      while pending or running or waiting or ready or (feed is not None and feed.open):
        if stop is not None and stop():
          for rid, traj in running.items():
            cut = latest.get(rid)
            if cut is not None and cut.token_ids:
              traj.add_turn(cut.token_ids, cut.logprobs(), cut=True)
          for traj in [*running.values(), *ready]:
            yield Segment(traj, None, traj.resume())
          for traj in waiting.values():
            yield Segment(traj, None, traj.resume(tool_pending=True))
          for req in pending:
            yield Segment(None, None, req.trajectory, request=req)
          pending.clear()
          return
        for future in [f for f in waiting if f.done()]:
          traj = waiting.pop(future)
          obs = tools.apply(traj, future.result())
          room = sampling.max_tokens - traj.generated
          traj.add_observation(obs[:room])
          if len(obs) >= room or budget(traj) <= 0:
            yield Segment(traj, "length")
          elif traj.turns >= env.max_turns:
            yield Segment(traj, MAX_TURNS)
          else:
            ready.append(traj)
        while (ready or pending) and len(running) < cap:
          if ready:
            traj = ready.popleft()
          else:
            req = pending.popleft()
            if req.trajectory is not None:  # stopped earlier: on from where it was
              traj = Trajectory.resumed(req.id, req.prompt, req.trajectory)
              if req.trajectory.tool_pending:
                waiting[tools.submit(traj)] = traj
                continue
            else:
              traj = Trajectory(req.id, req.prompt)
              if budget(traj) <= 0:
                raise ValueError(
                    f"Prompt {req.id} has {len(req.prompt)} tokens, which leaves no room to "
                    f"generate within max_model_len={engine.max_model_len}; raise it or "
                    "shorten the prompt."
                )
          # A seed per turn (a cut turn's rest keeps its turn's): the same trajectory samples
          # the same tokens whatever else runs.
          rid = engine.add_request(
              traj.prompt_id,
              traj.context,
              sampling,
              seed=None if seed is None else seed + 7919 * (traj.turns - traj.turn_cut),
              max_tokens=budget(traj),
              stop_token_ids=(tools.stop_token_id,),
          )
          running[rid] = traj
        if not running and not waiting and feed is not None:  # a pool's feed, open and empty
          feed.wait(0.05)
          continue
        if not running:
          started = time.perf_counter()
          concurrent.futures.wait(
              list(waiting), timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED
          )
          idle = time.perf_counter() - started
          self.tool_wait_s += idle
          for traj in waiting.values():
            traj.idle_s += idle / len(waiting)
          continue
        for out in engine.step():
          if not out.finished:
            if stop is not None:
              latest[out.key] = out
            continue
          traj = running.pop(out.key)
          latest.pop(out.key, None)
          traj.add_turn(out.token_ids, out.logprobs())
          if tools.wants_tool(traj, out.token_ids):
            waiting[tools.submit(traj)] = traj
          else:
            yield Segment(traj, out.finish_reason)
    finally:
      engine.abort()
