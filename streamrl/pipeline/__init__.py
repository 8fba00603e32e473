"""Pipeline modes: how generation and training are arranged in time.

  colocated  engine in the trainer's process; generate, then train (sync.py)
  sync       engines on Ray actors; the trainer waits for the whole batch (sync.py)
  stream     samples trained on as they arrive, weights pushed per iteration (stream.py)
  async      generation of i+1 overlaps training of i (stream.py); with
             pipeline.partial=on, rounds stop early and resume the
             unfinished responses next round (partial.py)

Every mode can drop uninformative prompt groups and generate more
(`advantage.filter_groups`: dynamic_sampling.py).

A mode only decides order and overlap; `streamrl/train.py` runs the iteration.
`make_mode` builds the configured one with its generation scheduler, over
the rounds of `make_rounds`.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

if typing.TYPE_CHECKING:  # Only named here: the settings import this package (below).
  from streamrl.generator.rollout import Rollout, Sample
  from streamrl.pipeline import base, dynamic_sampling


def make_mode(
    s,
    rollout: Rollout,
    *,
    rounds: Callable[[int], base.Round],
    model_dir: str,
    workdir: str | None,
    on_sample: Callable[[list[Sample], dict], None] | None = None,
    group_rewards: dynamic_sampling.GroupRewards | None = None,
) -> base.Mode:
  """The mode of settings `s` over `rollout`, with its generation scheduler
  (which reads `model_dir` and keeps its files in `workdir`); `rounds(it)`
  gives iteration it's Round (`make_rounds`); `on_sample` and
  `group_rewards` as `base.Mode` takes them."""
  # Imported here: reading the settings imports this package (its config), in
  # the launcher's process too, which must not load the modes' JAX (the RL
  # math) nor the scheduler's Ray.
  from streamrl.pipeline import partial, stream, sync  # pylint: disable=g-import-not-at-top
  from streamrl.scheduling.scheduler import GenerationScheduler  # pylint: disable=g-import-not-at-top

  scheduler = GenerationScheduler(
      s.scheduler,
      model_dir=model_dir,
      workdir=workdir,
      num_instances=rollout.num_instances,
      max_batch_size=s.engine.max_num_seqs,
      helper=rollout.helper_placement(),
  )
  kw = dict(
      on_sample=on_sample,
      group_rewards=group_rewards,
      sampling=s.sampling,
      seed=s.seed,
      group_size=s.advantage.group_size,
      mini_batch_size=s.trainer.mini_batch_size,
      prompts_per_iteration=s.trainer.prompts_per_iteration,
      filter_rounds=s.advantage.filter_max_rounds if s.advantage.filter_groups else None,
  )
  mode = s.pipeline.mode
  if mode in ("colocated", "sync"):
    return sync.SyncMode(rollout, scheduler, rounds, **kw)
  if mode == "stream":
    return stream.StreamMode(rollout, scheduler, rounds, **kw)
  kw.update(max_staleness=s.pipeline.max_staleness, num_iterations=s.trainer.num_iterations)
  if s.partial_rollouts:
    buffer = partial.PartialBuffer.from_settings(s, s.advantage.group_size)
    return partial.PartialAsyncMode(rollout, scheduler, rounds, buffer=buffer, **kw)
  return stream.AsyncMode(rollout, scheduler, rounds, **kw)


def make_rounds(loader, tokenizer, group_size: int) -> Callable[[int], base.Round]:
  """`rounds(it)`: the next prompt batch of `loader` (a `data.loader.PromptLoader`)
  as iteration it's Round, `group_size` requests per prompt."""
  # Imported here, as in make_mode: the loader's module imports grain.
  from streamrl.data.loader import make_requests  # pylint: disable=g-import-not-at-top
  from streamrl.pipeline import base  # pylint: disable=g-import-not-at-top

  def rounds(it: int) -> base.Round:
    examples = next(loader)
    requests, by_id = make_requests(examples, tokenizer, group_size)
    return base.Round(it, requests, by_id, loader.get_state())

  return rounds
