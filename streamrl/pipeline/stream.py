"""`stream` and `async`: generation and training overlap.

stream (on-policy, dynamic batches): arriving samples are collected by
`LengthBatcher` into per-length buckets; as soon as a bucket holds
`mini_batch_size` samples (whole groups, for GRPO) they go to the trainer as
one chunk, which rewards and scores them (old / reference logprobs, values)
against the iteration's old policy and runs an optimizer step on them while
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
iteration i; the new weights go out without waiting (`Rollout.update`
returns at once) and each instance loads them between two streams. A batch for iteration i is
generated with weights of version v >= i - max_staleness (the thread waits
otherwise); the trainer's truncated importance weights correct for the
behaviour policy, and every sample records its staleness i - v.
"""

from __future__ import annotations

import collections
import queue
import threading

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
  `size` must be a multiple of the group size (streamrl.config.settings checks it).
  """

  def __init__(self, size: int, group_size: int = 1):
    if size % group_size:
      raise ValueError(f"mini-batch size {size} is not a multiple of group size {group_size}.")
    self.size = size
    self.group_size = group_size
    self._buckets: dict[int, list] = collections.defaultdict(list)
    self._groups: dict[int, list] = collections.defaultdict(list)  # incomplete ones

  @staticmethod
  def length(sample) -> int:
    return len(sample.prompt_token_ids) + len(sample.token_ids)

  def add(self, group: list) -> list[list]:
    """Adds one whole group of samples; returns full mini-batches."""
    key = experience.bucket_length(max(self.length(x) for x in group))
    bucket = self._buckets[key]
    bucket.extend(group)
    out = []
    while len(bucket) >= self.size:
      out.append(bucket[: self.size])
      del bucket[: self.size]
    return out

  def add_sample(self, sample) -> list[list]:
    """Adds one sample; its group joins a bucket once complete (GRPO needs
    whole groups), its samples in request-id order."""
    gid = sample.prompt_id // self.group_size
    g = self._groups[gid]
    g.append(sample)
    if len(g) < self.group_size:
      return []
    return self.add(sorted(self._groups.pop(gid), key=lambda x: x.prompt_id))

  def pending(self) -> int:
    return sum(len(b) for b in self._buckets.values())

  def flush(self, *, drop_rest: bool = False) -> list[list]:
    """What the buckets still hold, as length-sorted mini-batches;
    `drop_rest`: the longest samples beyond whole mini-batches are left out
    (whole groups: a bucket holds whole groups and `size` is a multiple of
    the group size)."""
    if self._groups:
      raise RuntimeError(
          f"The stream ended with {len(self._groups)} incomplete groups; "
          "a generator returned fewer samples than requested."
      )
    left = [x for key in sorted(self._buckets) for x in self._buckets[key]]
    self._buckets.clear()
    if drop_rest:
      del left[len(left) - len(left) % self.size :]
    if len(left) % self.size:
      raise RuntimeError(
          f"{len(left)} samples are left outside a full mini-batch of "
          f"{self.size}; prompts_per_iteration * group_size must be a multiple "
          "of mini_batch_size."
      )
    return [left[i : i + self.size] for i in range(0, len(left), self.size)]


class StreamMode(base.Mode):
  """Trains each full length bucket while generation goes on."""

  scores_up_front = False  # scored as chunks arrive, some after updates

  def chunks(self, it: int):
    rnd = self.round = self.rounds(it)
    batcher = LengthBatcher(self.mini_batch_size, self.group_size)
    if self.filter_rounds is not None:
      yield from self._filtered_chunks(rnd, batcher)
      return
    samples = []
    t0 = t_last = base.now()
    for s in self.generate_round(rnd):
      t_last = base.now()
      samples.append(s)
      yield from batcher.add_sample(s)
    self.generated = base.Generated(
        rnd, generation_s=t_last - t0, scheduler_metrics=self.scheduler.observe(samples)
    )
    yield from batcher.flush()

  def _filtered_chunks(self, rnd: base.Round, batcher: LengthBatcher):
    """Dynamic sampling: only kept groups reach the buckets; short of the
    wanted groups when the bound is hit, the rest is cut to whole
    mini-batches (or padded with dropped groups to one)."""
    f = self.new_filter()
    t0 = base.now()
    for group in self.filtered_groups(rnd, f):
      yield from batcher.add(group)
    generation_s = base.now() - t0
    _, pad = f.batch()
    for group in pad:
      yield from batcher.add(group)
    self.generated = base.Generated(
        rnd, generation_s=generation_s, scheduler_metrics={**f.scheduler_metrics, **f.metrics()}
    )
    yield from batcher.flush(drop_rest=not f.full)


class AsyncMode(base.Mode):
  """Generation of iteration i+1 overlaps training of iteration i."""

  def __init__(self, *args, max_staleness: int, num_iterations: int, **kwargs):
    super().__init__(*args, **kwargs)
    self.max_staleness = max(1, int(max_staleness))
    self.num_iterations = num_iterations
    self._pushed: int | None = None  # newest weight version sent to the generators
    self._cond = threading.Condition()
    self._results: queue.Queue = queue.Queue()
    self._thread: threading.Thread | None = None
    self._pending = None  # the last UpdateHandle
    self._started = False  # the first round's generation has begun

  # --------------------------------------------------------- generation side
  def _generate(self, rnd: base.Round) -> None:
    try:
      with self._cond:
        # Bounded staleness: batch `it` needs weights of version >= it - k.
        self._cond.wait_for(lambda: self._pushed >= rnd.it - self.max_staleness)
        pending = self._pending
      if pending is not None:
        # Through the transfer service a version may still be on its way;
        # the stream must not start before every instance has it staged.
        pending.delivered()
      t0 = base.now()
      rnd, samples, metrics = self._produce(rnd)
      self._results.put((rnd, samples, base.now() - t0, metrics))
    except BaseException as e:  # pylint: disable=broad-except
      self._results.put((rnd, e, 0.0, {}))

  def _produce(self, rnd: base.Round) -> tuple[base.Round, list, dict]:
    """Generates round `rnd`: (the round trained on, its samples, scheduler metrics)."""
    if self.filter_rounds is not None:  # dynamic sampling: extra rounds, merged into rnd
      samples, metrics = self.filtered_round(rnd)
      return rnd, samples, metrics
    samples = list(self.generate_round(rnd))
    return rnd, samples, self.scheduler.observe(samples)

  def _next_round(self, it: int) -> base.Round:
    """Iteration it's round, made on the trainer's thread before its generation starts."""
    return self.rounds(it)

  def _check_staleness(self, it: int, samples) -> None:
    stale = max(it - s.weight_version for s in samples)
    if stale > self.max_staleness:
      raise RuntimeError(
          f"A sample of iteration {it} is {stale} versions old, beyond "
          f"max_staleness={self.max_staleness}; this is a bug."
      )

  def _start(self, it: int) -> None:
    rnd = self._next_round(it)
    self._thread = threading.Thread(
        target=self._generate, args=(rnd,), name=f"generate-{it}", daemon=True
    )
    self._thread.start()

  def _collect(self, it: int):
    rnd, samples, generation_s, metrics = self._results.get()
    self._thread.join()
    self._thread = None
    if isinstance(samples, BaseException):
      raise samples
    assert rnd.it == it, (rnd.it, it)
    return rnd, samples, generation_s, metrics

  # ------------------------------------------------------------ trainer side
  def chunks(self, it: int):
    if not self._started:  # first iteration of this process
      self._started = True
      with self._cond:
        if self._pushed is None:  # nothing pushed yet: the generators hold version `it`
          self._pushed = it
      self._start(it)
    t_wait = base.now()
    rnd, samples, generation_s, metrics = self._collect(it)
    self.round = rnd
    wait_s = base.now() - t_wait
    samples.sort(key=lambda s: s.prompt_id)
    self._check_staleness(it, samples)
    # The next batch starts now, generated while this one trains.
    if it + 1 < self.num_iterations:
      self._start(it + 1)
    self.generated = base.Generated(
        rnd, generation_s=generation_s, wait_s=wait_s, scheduler_metrics=metrics
    )
    yield samples

  def push(self, tensors, version: int):
    """Sends the weights without waiting for them to load."""
    if self._pending is not None:
      self._pending.wait()
    handle = self.rollout.update(tensors, version)
    with self._cond:
      self._pending = handle
      self._pushed = version
      self._cond.notify_all()
    return handle

  def quiesce(self) -> None:
    if self._pending is not None:
      self._pending.wait()
      self._pending = None

  def close(self) -> None:
    if self._thread is not None:
      self._results.get()
      self._thread.join()
      self._thread = None
    super().close()
