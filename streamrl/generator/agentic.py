"""Multi-turn rollouts on one engine, as the engine's kind of sample stream.

`AgentStream.generate` has the engine's `generate` signature: it admits the
call's requests (admission.py), runs them through the agent loop of
streamrl/envs/agent_loop.py on the engine's turn API, and turns each
trajectory segment the loop hands back into a `Sample` (mask, turn counts,
and a `Resume` when stopped early).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from streamrl.envs.agent_loop import AgentLoop, Segment
from streamrl.envs.config import Env
from streamrl.generator import admission
from streamrl.generator.config import Sampling
from streamrl.generator.rollout import PARTIAL, Sample, TurnStats
from streamrl.scheduling.pool import Feed


class AgentStream:
  """Multi-turn rollouts of `env` on `engine` (a `vllm_engine.GeneratorInstance`),
  with the tool workers beside it; `chat_template` and `chat_template_kwargs` as in `task.*`."""

  def __init__(
      self,
      engine,
      env: Env,
      *,
      chat_template: str = "auto",
      chat_template_kwargs: dict | None = None,
  ):
    self.engine = engine
    self.loop = AgentLoop(
        engine, env, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs
    )

  @property
  def tool_wait_s(self) -> float:
    """Seconds the engine had nothing to decode, waiting on tools."""
    return self.loop.tool_wait_s

  def close(self) -> None:
    """Stops the tool workers (the engine is closed by its owner)."""
    self.loop.close()

  def _sample(self, seg: Segment) -> Sample:
    engine = self.engine
    if seg.trajectory is None:  # stopped before it started
      req = seg.request
      return Sample(
          prompt_id=req.id,
          prompt_token_ids=req.prompt,
          token_ids=(),
          logprobs=(),
          finish_reason=PARTIAL,
          weight_version=engine.weight_version,
          instance_id=engine.instance_id,
          trajectory=seg.resume,
      )
    traj = seg.trajectory
    return Sample(
        prompt_id=traj.prompt_id,
        prompt_token_ids=traj.prompt,
        token_ids=tuple(traj.tokens),
        logprobs=tuple(traj.logprobs),
        finish_reason=PARTIAL if seg.finish_reason is None else seg.finish_reason,
        weight_version=engine.weight_version,
        instance_id=engine.instance_id,
        mask=tuple(traj.mask),
        turns=TurnStats(**traj.stats()),
        trajectory=seg.resume,
    )

  def generate(
      self,
      prompts,
      sampling: Sampling,
      *,
      seed: int | None = None,
      max_in_flight: int | None = None,
      stop: Callable[[], bool] | None = None,
  ) -> Iterator[Sample]:
    """Streams one trajectory's Sample per request as each ends.

    Arguments as `GeneratorInstance.generate`: requests (or a shared pool's
    `Feed`; trajectories never move), the run's `sampling.*`, a seed, at
    most `max_in_flight` turns at once, and `stop`, after which every
    unfinished trajectory comes back PARTIAL with its `runner.Resume` (see
    `AgentLoop.run`).
    """
    cap = self.engine.admission_cap(max_in_flight)
    pending, _ = admission.pending_queue(prompts)
    feed = pending if isinstance(pending, Feed) else None  # a shared pool's
    segments = self.loop.run(pending, sampling, seed=seed, cap=cap, stop=stop, feed=feed)
    try:
      for seg in segments:
        yield self._sample(seg)
    finally:
      segments.close()  # Aborts what the engine still runs.
