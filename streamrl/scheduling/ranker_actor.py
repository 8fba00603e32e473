"""The online length ranker's refresh in a process of its own on the generation side.

The ranker predicts before each round is dispatched and refreshes on the
round's lengths after it (`GenerationScheduler.plan` / `.observe`). In the
trainer's process the refresh (tens of optimizer steps of a small Flax model)
shares the trainer's cores and, in async mode, holds up the next iteration
until it finishes (experiments/RESULTS.md, "async trainer bubble"). `RankerActor`
runs it as a Ray actor beside the generators instead: on a generation node,
without an instance's pool slot or CPUs, pinned to the generator cores on a
local Ray (`StreamGenerationService.helper_placement`), at a lower CPU
priority (`NICE`), so a refresh (timed as `ranker/refresh_s`) fills the
generators' idle moments instead of slowing the round it overlaps. Refreshes
are submitted without waiting. Each returns its metrics and the refreshed
parameters as two objects; the scheduler reports the metrics after each round
and fetches the newest parameters only when it next predicts (a round whose
requests all start at once asks for no prediction), and predicts in its own
process with the newest refresh done by then: a prediction is a few
milliseconds of compute, while asking the actor for one is a Ray call to a
process that shares busy cores, which every round would wait for
(experiments/bench_pool_runs.py; times in experiments/RESULTS.md).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence

import ray


def build_ranker(sched, model_dir: str):
  """The scheduler's `RankerTrainer`: restored from `sched.ranker_checkpoint`,
  or new from `sched.ranker_config` (sched is a `settings.Scheduler`)."""
  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from streamrl.ranker import data as ranker_data  # pylint: disable=g-import-not-at-top
  from streamrl.ranker.train import RankerTrainer  # pylint: disable=g-import-not-at-top

  vocab, fp = ranker_data.fingerprint_tokenizer_dir(model_dir)
  if sched.ranker_checkpoint:
    return RankerTrainer.restore(
        sched.ranker_checkpoint, vocab_size=vocab, tokenizer_fingerprint=fp
    )
  rcfg = config_lib.load_config(sched.ranker_config)
  return RankerTrainer(rcfg, vocab_size=vocab, tokenizer_fingerprint=fp)


# How much lower than the generators' the actor's CPU priority is (os.nice).
NICE = 10


@ray.remote(max_restarts=0, max_task_retries=0)
class RankerActor:
  """`build_ranker` in its own process: predict, and refresh on new pairs
  (it keeps the recent history itself, as the scheduler would)."""

  def __init__(self, sched, model_dir: str, cores: Sequence[int] | None, history: int = 4096):
    os.nice(NICE)
    if cores:
      from streamrl import cluster  # pylint: disable=g-import-not-at-top

      # Before JAX starts: XLA sizes its thread pool from the affinity mask.
      cluster.bound_trainer_threads(cores)
    self.ranker = build_ranker(sched, model_dir)
    # Now, before the first round, rather than in the first refreshes: this
    # process shares the generators' cores.
    self.ranker.compile_all()
    self.pairs = collections.deque(maxlen=history)

  def predict(self, prompts):
    return self.ranker.predict(prompts)

  @ray.method(num_returns=2)
  def update(self, new_pairs) -> tuple[dict, list]:
    """-> (the refresh's metrics, the refreshed parameters' leaves): two
    objects, so the caller can read the metrics without fetching the leaves."""
    t0 = time.perf_counter()
    self.pairs.extend((list(p), int(n)) for p, n in new_pairs)
    metrics = self.ranker.update(list(self.pairs))
    # Seconds it held a generation core (`ranker/refresh_s`; the simulator's ranker_refresh_s).
    metrics["refresh_s"] = time.perf_counter() - t0
    return metrics, self.ranker.param_leaves()
