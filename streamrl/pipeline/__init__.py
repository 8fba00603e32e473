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
"""

from __future__ import annotations

from streamrl.pipeline import base, partial, stream, sync


def make_mode(s, rollout, scheduler, rounds) -> base.Mode:
  """The mode of settings `s` over `rollout`; `rounds(it)` gives iteration it's Round."""
  kw = dict(
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
