"""The bytes a receiver verifies are the safetensors file its host's engines load: one copy per
host, lazy mappings read once, pinned files never rewritten, nothing left in /dev/shm."""

import os

import ml_dtypes
import numpy as np
import pytest

from streamrl.models import safetensors_io
from streamrl.transfer import Pin, WeightsFile, schema_of
from streamrl.transfer.manifest import payload_size
from streamrl.transfer.shm import SHM_DIR
from .conftest import NAMES, make_tensors, same, wait_until

pytestmark = [pytest.mark.unit]


class LazyTensors(dict):
  """Like models.hf.HFTensors: specs without reading; counts every read of a tensor."""

  def __init__(self, tensors):
    super().__init__(tensors)
    self.reads = {k: 0 for k in tensors}

  def __getitem__(self, name):
    self.reads[name] += 1
    return super().__getitem__(name)

  def items(self):
    raise AssertionError("a lazy mapping must be read one tensor at a time")

  def specs(self):
    return {k: (v.shape, v.dtype) for k, v in dict.items(self)}


def _ours():
  """Our process's files in /dev/shm (threaded receivers share the process)."""
  return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"srl_{os.getpid()}_"))


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_lazy_tensors_are_read_once_and_the_loaded_file_is_bit_exact(cluster, dtype):
  rng = np.random.default_rng(0)
  raw = {n: rng.standard_normal((40, 24)).astype(dtype) for n in NAMES}
  raw[NAMES[0]].view(np.uint8)[:4] = 0xFF  # a NaN pattern survives too
  lazy = LazyTensors(raw)
  pub = cluster.publisher(use_shm=True)
  local = cluster.receiver("local", host="trainer", schema=schema_of(lazy), join=pub)
  remote = cluster.receiver("remote", host="far", schema=schema_of(lazy), join=pub)
  assert lazy.reads == {k: 0 for k in raw}  # planning read nothing
  v = pub.publish(lazy)
  assert pub.wait_acks(v, 10)
  assert lazy.reads == {k: 1 for k in raw}  # each tensor converted exactly once
  for r in (local, remote):
    assert same(r.loads.calls[-1][1], raw)
    path = r._current.path
    assert path is not None and path.startswith(SHM_DIR)
    assert same(safetensors_io.load(path), raw)  # what an engine loads, bit for bit
  assert local._current.path == pub._newest().path  # same host: the sender's file itself
  assert remote._current.path != pub._newest().path  # its own staging file


def test_a_host_receives_once_and_its_receivers_share_the_file(cluster):
  pub = cluster.publisher()
  seen = []

  def record(tensors, version):
    seen.append((version, tensors.path))

  t = make_tensors(1)
  rs = [cluster.receiver(f"h{i}", host="gen-host", schema=schema_of(t), join=pub) for i in range(3)]
  for r in rs:
    r.load_fn = record
  v = pub.publish(t)
  assert pub.wait_acks(v, 10)
  head, *siblings = sorted(rs, key=lambda r: r.name)
  paths = {p for _, p in seen}
  assert len(seen) == 3 and len(paths) == 1  # three receivers, one file
  assert paths == {head._current.path}
  assert head.stats["bytes_copied"] == payload_size(t)
  assert all(s.stats.get("served_shm", 0) == 0 and "bytes_copied" in s.stats for s in siblings)
  assert all(s.stats["bytes_copied"] == 0 for s in siblings)  # they map the head's file
  assert head.stats["served_shm"] == 2
  # Each faulted in staging memory at join; only the head keeps (and used) it.
  assert head._current.segment is not None and all(s._spare is None for s in siblings)
  # The service's own count: the sender's copy plus one per receiving host.
  assert wait_until(lambda: pub.copied_bytes(v) == 2 * payload_size(t))


def test_a_pinned_file_is_neither_rewritten_nor_removed(cluster):
  pub = cluster.publisher(keep_versions=2)
  far = cluster.receiver("far", host="gen-host", join=pub)  # receives into its own file
  near = cluster.receiver("near", host="trainer", join=pub)  # maps the sender's files
  t1 = make_tensors(1)
  assert pub.wait_acks(pub.publish(t1), 10)
  pins = [Pin(far._current.path), Pin(near._current.path)]  # what a staged generator holds
  for seed in range(2, 7):
    assert pub.wait_acks(pub.publish(make_tensors(seed)), 10)
  for pin in pins:
    assert same(safetensors_io.load(pin.path), t1)  # still version 1, still there
    pin.release()
  for seed in range(7, 10):
    assert pub.wait_acks(pub.publish(make_tensors(seed)), 10)
  for pin in pins:  # free again: reused for a newer version or removed
    assert not os.path.exists(pin.path) or not same(safetensors_io.load(pin.path), t1)
  assert len(pub._pool._segments) <= 4 and len(far._retired) <= 1


def test_dev_shm_is_clean_after_close_and_after_a_failed_transfer(cluster, monkeypatch):
  from streamrl.transfer import publisher as publisher_lib

  before = _ours()
  pub = cluster.publisher()
  t = make_tensors(1)
  rs = [
      cluster.receiver("a", host="trainer", schema=schema_of(t), join=pub),
      cluster.receiver("b", host="gen-host", schema=schema_of(t), join=pub),
      cluster.receiver("c", host="gen-host", schema=schema_of(t), join=pub),
      cluster.receiver("d", host="other", schema=schema_of(t), join=pub, use_shm=False),
  ]
  for seed in range(1, 4):
    assert pub.wait_acks(pub.publish(make_tensors(seed)), 10)
  real = publisher_lib.fill_payload

  def corrupt(tensors, manifest, out):
    for i, value in enumerate(real(tensors, manifest, out)):
      if i == 2:
        out[2 * manifest.chunk_bytes] ^= 0x01
      yield value

  monkeypatch.setattr(publisher_lib, "fill_payload", corrupt)
  v = pub.publish(make_tensors(9))
  assert all(wait_until(lambda r=r: v in r._gave_up) for r in rs)  # every attempt refused
  assert _ours() != before  # files exist while the nodes live
  cluster.close()
  assert _ours() == before


def test_weights_file_streams_a_lazy_mapping_once_bit_exactly():
  rng = np.random.default_rng(3)
  raw = {
      "a": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
      "b": rng.standard_normal(7).astype(np.float32),
      "c": rng.standard_normal((2, 2)).astype(np.float16),
  }
  lazy = LazyTensors(raw)
  f = WeightsFile(lazy)
  try:
    assert lazy.reads == {k: 1 for k in raw}
    assert os.path.getsize(f.path) == f.nbytes == payload_size(raw)
    assert same(safetensors_io.load(f.path), raw) and same(f.tensors(), raw)
    header, start = safetensors_io.read_header(f.path)
    assert all(
        (start + e["data_offsets"][0]) % 4 == 0 for e in header.values() if e["dtype"] == "F32"
    )
  finally:
    f.unlink()
  assert not os.path.exists(f.path)
