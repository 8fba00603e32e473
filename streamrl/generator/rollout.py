"""The `Rollout` protocol: what the trainer side sees of generation.

Two implementations, both in this package:

  local.LocalRollout            one engine in the trainer's process (colocated)
  service.StreamGenerationService  N engines on Ray actors (sync, stream, async)

Both stream finished `Sample`s as they finish, take new weights through
`update` (which returns an `UpdateHandle` at once), and report their live and
dead instances. The service's instances may change between rounds (elastic
generation: `add_instance` / `remove_instance`, streamrl/elastic/controller.py);
ids are never reused, and `assignments` name instances by id. Nothing here
imports torch or vLLM.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Protocol

import numpy as np

from streamrl.generator.config import Sampling
from streamrl.scheduling.request import Request, as_requests  # noqa: F401  (re-exported)

if typing.TYPE_CHECKING:  # Only named in annotations (a Sample carries a Resume, never builds one).
  from streamrl.envs.runner import Resume
  from streamrl.scheduling.pool import WorkPool
  from streamrl.transfer import Publisher

# The finish_reason of a response stopped before it finished
# (`Rollout.stop_generation`): its tokens so far, to be resumed later.
PARTIAL = "partial"
# The finish_reason of a response an instance gave up mid-round so that an idle
# one resumes it (a shared pool's migration, streamrl/scheduling/pool.py); the
# service joins it to its rest and never yields it.
MOVED = "moved"


@dataclasses.dataclass(frozen=True)
class TurnStats:
  """A multi-turn trajectory's counts (streamrl/envs): policy turns, tool calls,
  failed and timed-out calls, seconds its tool calls took, its share of the
  seconds its engine sat idle waiting on tools, and the sum of the
  environment's per-turn rewards."""

  turns: int
  tool_calls: int = 0
  tool_errors: int = 0
  tool_timeouts: int = 0
  tool_s: float = 0.0
  idle_s: float = 0.0
  env_reward: float = 0.0


@dataclasses.dataclass(frozen=True)
class Sample:
  """One finished generation.

  `logprobs[i]` is the log-probability of `token_ids[i]` under the
  distribution it was sampled from (after temperature), as the importance
  ratios of the trainer need.
  """

  prompt_id: int
  prompt_token_ids: tuple[int, ...]
  token_ids: tuple[int, ...]
  logprobs: tuple[float, ...]
  finish_reason: str
  weight_version: int
  instance_id: int
  # Per token, the weight version that sampled it, when the response spans
  # several (a partial rollout resumed under newer weights); None: every
  # token is `weight_version`'s.
  token_versions: tuple[int, ...] | None = None
  # A multi-turn trajectory (streamrl/envs): per token, 1 where the policy
  # sampled it and 0 for an observation's (logprob 0, left out of the loss);
  # None: every token is the policy's. `turns`: the trajectory's counts.
  mask: tuple[int, ...] | None = None
  turns: TurnStats | None = None
  # A trajectory stopped early (finish_reason PARTIAL): what resuming it needs, for the
  # Request that continues it from prompt_token_ids + token_ids.
  trajectory: Resume | None = None


@dataclasses.dataclass(frozen=True)
class DeadInstance:
  instance_id: int
  reason: str
  requeued: int  # Undelivered requests handed to the survivors.
  at: float  # time.perf_counter() when the death was seen.


class UpdateHandle:
  """A weight version on its way to the generator instances.

  `delivered()` returns once every live instance holds the version, ready to
  load before its next stream (a stream started afterwards carries it in
  every sample); `wait()` returns {instance_id: version} once every live
  instance has loaded it. Both take an optional timeout in seconds.
  """

  def __init__(
      self,
      version: int,
      *,
      delivered: Callable[[float | None], None] | None = None,
      loaded: Callable[[float | None], Mapping[int, int]] | None = None,
      versions: Mapping[int, int] | None = None,
  ):
    self.version = int(version)
    self._delivered_fn = delivered
    self._loaded_fn = loaded
    self._delivered = delivered is None
    self._result = dict(versions) if versions is not None else None

  @classmethod
  def done(cls, version: int, versions: Mapping[int, int]) -> "UpdateHandle":
    """An update that has already been loaded everywhere."""
    return cls(version, versions=versions)

  def delivered(self, timeout_s: float | None = None) -> None:
    if not self._delivered:
      self._delivered_fn(timeout_s)
      self._delivered = True

  def wait(self, timeout_s: float | None = None) -> dict[int, int]:
    if self._result is None:
      self.delivered(timeout_s)
      self._result = dict(self._loaded_fn(timeout_s))
    return dict(self._result)


class Rollout(Protocol):
  """Streamed generation on one or more generator instances.

  Every member below is what the run (streamrl/train.py, streamrl/pipeline)
  uses; each implementation has them all.
  """

  # Instances ever started; ids 0..num_instances-1.
  num_instances: int
  # {instance_id: {"pid", "cores", ...}}: where each instance runs.
  placement: dict
  # (instance_id, start, end, num_samples) per stream segment, perf_counter s.
  busy_intervals: list
  # (instance_id, reason, perf_counter s) of each instance removed on purpose
  # (elastic generation); empty where instances never change.
  retired: list
  # Whether `generate` takes a shared work pool (`pool=`, streamrl/scheduling/pool.py).
  pooled: bool

  @property
  def publisher(self) -> Publisher | None:
    """The transfer service's publisher (its `stats` are logged); None where
    weights do not go through the transfer service."""

  def helper_placement(self) -> tuple[dict, tuple[int, ...] | None] | None:
    """Ray options and cores for a helper process on the generation side
    (the ranker, streamrl/scheduling/ranker_actor.py); None: no such side."""

  def generate(
      self,
      requests: Sequence[Request] | None,
      sampling: Sampling,
      *,
      seed: int | None = None,
      assignments: Sequence[Sequence[Request]] | None = None,
      caps: Sequence[int | None] | None = None,
      stoppable: bool = False,
      pool: WorkPool | None = None,
      migrate: bool = False,
      straggler_tokens: int = 0,
  ) -> Generator[Sample, None, None]:
    """Yields one Sample per request as soon as an instance finishes it;
    closing the generator early ends the call.

    A request is a `Request` or an (id, prompt token ids) tuple.
    `sampling` is the run's `sampling.*` (streamrl/generator/config.py).
    With a `seed`, a request of prompt id p samples with seed + p: the same
    prompt id gives the same tokens whatever else is in the batch (None:
    unseeded). `assignments` (one list per instance, run in order) replaces
    the round-robin split of `requests`; `caps` bounds each instance's
    requests in flight; `stoppable` lets `stop_generation` end this call
    early. `pool`, `migrate` and `straggler_tokens`: a shared work pool
    instead of `requests` (only where `pooled`).
    """

  def stop_generation(self) -> None:
    """Stops the running `generate(..., stoppable=True)` call early: every
    request still unfinished comes back as a Sample with finish_reason
    PARTIAL and the tokens it had (none for one never started), then the
    stream ends. Only `StreamGenerationService(stoppable=True)` has it."""

  def update(self, tensors: Mapping[str, np.ndarray], version: int) -> UpdateHandle:
    """Sends HF-named weights to every live instance; returns at once."""

  @property
  def live_instances(self) -> list[int]:
    """Ids of the instances that can take work."""

  @property
  def dead_instances(self) -> list[DeadInstance]:
    """Instances that died, with why and how much of their work was re-run."""

  def close(self) -> None:
    """Stops every instance and frees its engine."""
