"""LengthBatcher: stream mode's per-length mini-batches."""

import numpy as np
import pytest

from streamrl.generator.rollout import Sample
from streamrl.pipeline.stream import LengthBatcher
from streamrl.trainer import experience

pytestmark = [pytest.mark.unit]


def item(rid, prompt_len, resp_len):
  s = Sample(
      prompt_id=rid,
      prompt_token_ids=(1,) * prompt_len,
      token_ids=(7,) * resp_len,
      logprobs=(-1.0,) * resp_len,
      finish_reason="stop",
      weight_version=0,
      instance_id=0,
  )
  return s


def padded(batch):
  return experience.bucket_length(max(LengthBatcher.length(x) for x in batch))


def test_a_full_bucket_is_emitted_at_once_and_alone():
  b = LengthBatcher(size=2)
  assert b.add([item(0, 10, 5)]) == []  # bucket 32
  assert b.add([item(1, 10, 40)]) == []  # bucket 64: not mixed with the short one
  out = b.add([item(2, 5, 5)])  # bucket 32 is full
  assert [[x.prompt_id for x in m] for m in out] == [[0, 2]]
  assert b.pending() == 1


def test_flush_sorts_what_is_left_and_keeps_every_item_once():
  rng = np.random.default_rng(0)
  b = LengthBatcher(size=4)
  emitted = []
  for rid in range(24):
    emitted += b.add([item(rid, int(rng.integers(3, 20)), int(rng.integers(1, 90)))])
  # Emitted while streaming: each mini-batch from one bucket.
  for m in emitted:
    assert len({experience.bucket_length(LengthBatcher.length(x)) for x in m}) == 1
  rest = b.flush()
  assert b.pending() == 0
  assert all(len(m) == 4 for m in emitted + rest)
  ids = sorted(x.prompt_id for m in emitted + rest for x in m)
  assert ids == list(range(24))
  # Sorted by bucket: padded lengths never decrease along the flushed batches.
  assert [padded(m) for m in rest] == sorted(padded(m) for m in rest)


def test_groups_stay_whole():
  b = LengthBatcher(size=4, group_size=2)
  out = []
  for g in range(6):
    long = 60 if g % 2 else 5
    out += b.add([item(2 * g, 10, long), item(2 * g + 1, 10, 3)])
  out += b.flush()
  for m in out:
    ids = sorted(x.prompt_id for x in m)
    assert all(ids[k] // 2 == ids[k + 1] // 2 for k in range(0, 4, 2)), ids


def test_add_sample_waits_for_whole_groups_in_id_order():
  b = LengthBatcher(size=2, group_size=2)
  assert b.add_sample(item(1, 5, 5)) == []
  out = b.add_sample(item(0, 5, 5))
  assert [[x.prompt_id for x in m] for m in out] == [[0, 1]]
  b.add_sample(item(3, 5, 5))  # its partner never arrives
  with pytest.raises(RuntimeError, match="incomplete groups"):
    b.flush()


def test_flush_refuses_a_partial_mini_batch():
  b = LengthBatcher(size=4)
  b.add([item(0, 3, 3)])
  with pytest.raises(RuntimeError, match="multiple of mini_batch_size"):
    b.flush()


def test_size_must_hold_whole_groups():
  with pytest.raises(ValueError, match="multiple of group size"):
    LengthBatcher(size=6, group_size=4)
