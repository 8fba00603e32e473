"""`stream` and `async`: generation and training overlap.

stream (on-policy, dynamic batches): samples are rewarded as they arrive and
collected by `LengthBatcher` into per-length buckets; as soon as a bucket
holds `mini_batch_size` samples (whole groups, for GRPO) they are scored
(old / reference logprobs, values) and an optimizer step runs on them while
generation goes on. Weights are pushed after the iteration, so every sample
of the next iteration is on-policy. What differs from `sync`: a mini-batch
holds samples of one length bucket in arrival order (sync sorts the whole
batch by length and cuts it), the mini-batches are trained in the order they
fill (short ones first, since they finish first) rather than shuffled, and
advantage whitening uses the mini-batch's statistics, not the whole batch's.
With `mini_batch_size` equal to the whole batch both give the same update
(tests/pipeline/test_modes.py checks it). Extra PPO epochs replay the
mini-batches after generation ends.

async (one-step off-policy, as in the paper, bounded by max_staleness):
a background thread generates iteration i+1 while the trainer trains on
iteration i; the new weights go out without waiting (`start_update`) and
each instance loads them between two streams. A batch for iteration i is
generated with weights of version v >= i - max_staleness (the thread waits
otherwise); the trainer's truncated importance weights correct for the
behaviour policy, and every sample records its staleness i - v.
"""

from __future__ import annotations

import collections
import queue
import threading

import jax
import numpy as np

from streamrl.pipeline import base
from streamrl.trainer import experience


class LengthBatcher:
  """Turns arriving groups into mini-batches of similar padded length.

  A group (the samples of one prompt: one for PPO, group_size for GRPO) goes
  to the bucket of its longest sample's padded length
  (`experience.bucket_length`, the shapes the jitted step sees); a bucket
  that holds `size` samples becomes a mini-batch at once. Taking mini-batches
  in plain arrival order would pad most of them to the longest sample that
  happened to arrive with them (on the tiny task: 64-96 tokens instead of 32).
  When the stream ends, `flush` sorts what is left by length and cuts it into
  mini-batches, so the number of optimizer steps equals sync's.
  `size` must be a multiple of the group size (train.validate checks it).
  """

  def __init__(self, size: int, group_size: int = 1):
    if size % group_size:
      raise ValueError(f"mini-batch size {size} is not a multiple of group size {group_size}.")
    self.size = size
    self.group_size = group_size
    self._buckets: dict[int, list] = collections.defaultdict(list)
    self._groups: dict[int, list] = collections.defaultdict(list)  # incomplete ones

  @staticmethod
  def length(item) -> int:
    sample = item[0]
    return len(sample.prompt_token_ids) + len(sample.token_ids)

  def add(self, group: list) -> list[list]:
    """Adds one whole group of (sample, score) items; returns full mini-batches."""
    key = experience.bucket_length(max(self.length(x) for x in group))
    bucket = self._buckets[key]
    bucket.extend(group)
    out = []
    while len(bucket) >= self.size:
      out.append(bucket[:self.size])
      del bucket[:self.size]
    return out

  def add_sample(self, item) -> list[list]:
    """Adds one (sample, score) item; its group joins a bucket once complete
    (GRPO needs whole groups), its samples in request-id order."""
    gid = item[0].prompt_id // self.group_size
    g = self._groups[gid]
    g.append(item)
    if len(g) < self.group_size:
      return []
    return self.add(sorted(self._groups.pop(gid), key=lambda x: x[0].prompt_id))

  def pending(self) -> int:
    return sum(len(b) for b in self._buckets.values())

  def flush(self) -> list[list]:
    """What the buckets still hold, as length-sorted mini-batches."""
    if self._groups:
      raise RuntimeError(f"The stream ended with {len(self._groups)} incomplete groups; "
                         "a generator returned fewer samples than requested.")
    left = [x for key in sorted(self._buckets) for x in self._buckets[key]]
    self._buckets.clear()
    if len(left) % self.size:
      raise RuntimeError(f"{len(left)} samples are left outside a full mini-batch of "
                         f"{self.size}; prompts_per_iteration * group_size must be a multiple "
                         "of mini_batch_size.")
    return [left[i:i + self.size] for i in range(0, len(left), self.size)]


class StreamPipeline(base.Pipeline):

  def iteration(self, it: int, loader, tokenizer, rewarder) -> dict:
    cfg = self.config
    group = cfg.algo.group_size
    mb = self.trainer.mini_batch_size
    examples, loader_state = base.take_examples(loader)
    requests, by_id = self.make_requests(examples, tokenizer, group)
    t0 = base.now()
    self.trainer.begin_iteration(snapshot=True)
    batcher = LengthBatcher(mb, group)
    minis, prep_all, train_all, samples, scores_all, correct_all = [], [], [], [], [], []
    train_s = 0.0

    def train_on(batch):
      nonlocal train_s
      start = base.now()
      with self.timeline.busy(base.TRAINER, f"train {it}"):
        sc = np.array([x[1] for x in batch], np.float32)
        part, prep = self.trainer.prepare([x[0] for x in batch], sc)
        for m in part:
          # Wait for the device: the busy interval must cover the compute, not the dispatch.
          train_all.append(jax.block_until_ready(self.trainer.train_minibatch(m)))
        minis.extend(part)
        prep_all.append(prep)
      train_s += base.now() - start

    t_last = t0  # when the last sample was taken from the stream
    for s in self.generate_round(requests, by_id, it):
      t_last = base.now()
      with self.timeline.busy(base.TRAINER, "reward"):
        score, correct = rewarder([s], by_id)
      samples.append(s)
      scores_all.append(float(score[0]))
      correct_all.append(float(correct[0]))
      for batch in batcher.add_sample((s, float(score[0]))):
        train_on(batch)
    self.observe(samples)
    for batch in batcher.flush():
      train_on(batch)
    t1 = base.now()
    rng = np.random.default_rng([cfg.seed, it])
    for _ in range(self.trainer.ppo_epochs - 1):
      with self.timeline.busy(base.TRAINER, f"epoch {it}"):
        for j in rng.permutation(len(minis)):
          train_all.append(self.trainer.train_minibatch(minis[j]))
        # Training time must cover the compute, not only its dispatch (else
        # the weight export below would wait for it and be billed for it).
        jax.block_until_ready(train_all[-1])
    self.trainer.begin_iteration(snapshot=False)
    t2 = base.now()
    self.push_weights(self.trainer.hf_tensors(), it + 1)
    t3 = base.now()
    prep = {k: float(np.mean([p[k] for p in prep_all])) for k in prep_all[0]}
    train_metrics = {k: float(np.mean([float(m[k]) for m in train_all])) for k in train_all[0]}
    times = {"generation_s": t_last - t0, "training_s": train_s + (t2 - t1),
             "weight_update_s": t3 - t2}
    order = np.argsort([s.prompt_id for s in samples])
    samples = [samples[i] for i in order]
    scalars = self.scalars(it, t0, t3, samples, np.array(scores_all)[order],
                           np.array(correct_all)[order], prep, train_metrics, times)
    return {"scalars": scalars, "lengths": [len(s.token_ids) for s in samples],
            "samples": samples, "loader_state": loader_state}


class AsyncPipeline(base.Pipeline):
  """Generation of iteration i+1 overlaps training of iteration i."""

  def __init__(self, config, model_dir: str, trainer, backend=None, workdir=None, cluster=None):
    super().__init__(config, model_dir, trainer, backend, workdir, cluster)
    self.max_staleness = max(1, int(config.pipeline.max_staleness))
    self._pushed = 0          # newest weight version sent to the generators
    self._cond = threading.Condition()
    self._results: queue.Queue = queue.Queue()
    self._thread: threading.Thread | None = None
    self._next_it: int | None = None
    self._pending_update = None
    self._tokenizer = None

  # --------------------------------------------------------- generation side
  def _generate(self, it: int, examples, tokenizer) -> None:
    try:
      with self._cond:
        # Bounded staleness: batch `it` needs weights of version >= it - k.
        self._cond.wait_for(lambda: self._pushed >= it - self.max_staleness)
        pending = self._pending_update
      if pending is not None:
        # Through the transfer service a version may still be on its way;
        # the stream must not start before every instance has it staged.
        pending.delivered()
      requests, by_id = self.make_requests(examples, tokenizer, self.config.algo.group_size)
      t0 = base.now()
      samples = list(self.generate_round(requests, by_id, it))
      t1 = base.now()
      self.observe(samples)
      self._results.put((it, samples, by_id, t0, t1))
    except BaseException as e:  # pylint: disable=broad-except
      self._results.put((it, e, None, None, None))

  def _start(self, it: int, loader, tokenizer):
    examples, loader_state = base.take_examples(loader)
    self._thread = threading.Thread(target=self._generate, args=(it, examples, tokenizer),
                                    name=f"generate-{it}", daemon=True)
    self._thread.start()
    self._next_it = it
    return loader_state

  def _collect(self, it: int):
    got_it, samples, by_id, t0, t1 = self._results.get()
    self._thread.join()
    self._thread = None
    if isinstance(samples, BaseException):
      raise samples
    assert got_it == it, (got_it, it)
    return samples, by_id, t0, t1

  def push_weights(self, tensors, version: int) -> None:
    if self._pending_update is not None:
      self._pending_update.wait()
    pending = self.backend.start_update(tensors, version)
    with self._cond:
      self._pending_update = pending
      self._pushed = version
      self._cond.notify_all()

  def generate(self, requests, sampling):
    """For evaluation: waits until no stream or update is in flight."""
    self.quiesce()
    return self.backend.generate(requests, sampling)

  def quiesce(self) -> None:
    if self._pending_update is not None:
      self._pending_update.wait()
      self._pending_update = None

  # ------------------------------------------------------------ trainer side
  def iteration(self, it: int, loader, tokenizer, rewarder) -> dict:
    cfg = self.config
    if self._next_it is None:  # first iteration of this process
      self._pushed = it       # the generators hold version `it` (0, or the resumed one)
      self._loader_state = self._start(it, loader, tokenizer)
    loader_state = self._loader_state
    t_wait = base.now()
    samples, by_id, g0, g1 = self._collect(it)
    samples.sort(key=lambda s: s.prompt_id)
    stale = [it - s.weight_version for s in samples]
    if max(stale) > self.max_staleness:
      raise RuntimeError(f"A sample of iteration {it} is {max(stale)} versions old, beyond "
                         f"max_staleness={self.max_staleness}; this is a bug.")
    # Next batch starts now, generated while this one trains.
    if it + 1 < cfg.trainer.num_iterations:
      self._loader_state = self._start(it + 1, loader, tokenizer)
    t1 = base.now()
    scores, correct, prep, train_metrics = self.train_batch(it, samples, by_id, rewarder)
    t2 = base.now()
    self.push_weights(self.trainer.hf_tensors(), it + 1)
    t3 = base.now()
    times = {"generation_s": g1 - g0, "generation_wait_s": t1 - t_wait,
             "training_s": t2 - t1, "weight_update_s": t3 - t2}
    scalars = self.scalars(it, t_wait, t3, samples, scores, correct, prep, train_metrics, times)
    return {"scalars": scalars, "lengths": [len(s.token_ids) for s in samples],
            "samples": samples, "loader_state": loader_state, "staleness": stale}

  def close(self) -> None:
    if self._thread is not None:
      self._results.get()
      self._thread.join()
    self.quiesce()
    super().close()
