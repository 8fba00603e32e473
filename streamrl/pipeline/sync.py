"""`colocated` and `sync`: generate the whole batch, then train, then push.

`colocated` runs the engine in the trainer's process (the two take turns on
the same cores); `sync` runs it on Ray actors with their own cores, but the
trainer still waits for the whole batch (verl-like). Both are on-policy: the
whole batch is one chunk, scored before the first update.
"""

from __future__ import annotations

from streamrl.pipeline import base


class SyncMode(base.Mode):

  def chunks(self, it: int):
    rnd = self.round = self.rounds(it)
    t0 = base.now()
    if self.filter_rounds is None:
      samples = sorted(self.generate_round(rnd), key=lambda s: s.prompt_id)
      metrics = self.scheduler.observe(samples)
    else:  # dynamic sampling: extra rounds until enough groups are kept
      samples, metrics = self.filtered_round(rnd)
    generation_s = base.now() - t0
    self.generated = base.Generated(rnd, generation_s=generation_s, scheduler_metrics=metrics)
    yield samples
