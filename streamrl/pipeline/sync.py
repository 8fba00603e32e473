"""`colocated` and `sync`: generate the whole batch, then train, then push.

`colocated` runs the engine in the trainer's process (the two take turns on
the same cores); `sync` runs it on Ray actors with their own cores, but the
trainer still waits for the whole batch (verl-like). Both are on-policy.
"""

from __future__ import annotations

from streamrl.pipeline import base


class SyncPipeline(base.Pipeline):

  def iteration(self, it: int, loader, tokenizer, rewarder) -> dict:
    cfg = self.config
    examples, loader_state = base.take_examples(loader)
    requests, by_id = self.make_requests(examples, tokenizer, cfg.algo.group_size)
    t0 = base.now()
    samples = sorted(self.generate_round(requests, by_id, it), key=lambda s: s.prompt_id)
    t1 = base.now()
    self.observe(samples)
    scores, correct, prep, train_metrics = self.train_batch(it, samples, by_id, rewarder)
    t2 = base.now()
    self.push_weights(self.trainer.hf_tensors(), it + 1)
    t3 = base.now()
    times = {"generation_s": t1 - t0, "training_s": t2 - t1, "weight_update_s": t3 - t2}
    scalars = self.scalars(it, t0, t3, samples, scores, correct, prep, train_metrics, times)
    return {"scalars": scalars, "lengths": [len(s.token_ids) for s in samples],
            "samples": samples, "loader_state": loader_state}
