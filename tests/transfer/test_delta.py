"""Delta chunks reconstruct the new payload bit for bit, and damage is caught."""

import zlib

import ml_dtypes
import numpy as np
import pytest

from streamrl.transfer import delta
from streamrl.transfer.manifest import TransferError, payload_size, read_payload, verify_chunk, write_payload

pytestmark = [pytest.mark.unit]


def _adamw_step(w, lr, rng):
  g = rng.standard_normal(w.shape).astype(np.float32)
  return w.astype(np.float32) - lr * (np.sign(g) + 0.01 * w.astype(np.float32))


def _payload(tensors, version, chunk_bytes=512):
  buf = bytearray(payload_size(tensors))
  return write_payload(tensors, memoryview(buf), version, chunk_bytes), buf


@pytest.mark.parametrize(
    "dtype,lr,kind",
    [
        (np.float32, 1e-3, delta.XOR_ZLIB),  # every word moves: dense
        (ml_dtypes.bfloat16, 1e-6, delta.XOR_SPARSE),
    ],
)  # few move
def test_delta_reconstruction_is_bit_exact(dtype, lr, kind):
  rng = np.random.default_rng(0)
  w = (rng.standard_normal((64, 48)) * 0.02).astype(np.float32)
  special = np.array(
      [np.nan, -0.0, np.inf, -np.inf, 1e-40, 0.0], np.float32
  )  # NaN, signed zero, subnormal
  old = {
      "w": w.astype(dtype),
      "s": special.astype(dtype),
      "b": rng.standard_normal(5).astype(np.float32),
  }
  new = {
      "w": _adamw_step(w, lr, rng).astype(dtype),
      "s": special[::-1].astype(dtype),
      "b": old["b"] + np.float32(1e-7),
  }
  m_old, b_old = _payload(old, 1)
  m_new, b_new = _payload(new, 2)
  assert m_old.layout == m_new.layout
  out = bytearray(len(b_new))
  kinds = []
  for i in range(m_new.num_chunks):
    a, b = m_new.chunk_range(i)
    k, blob = delta.encode_chunk(memoryview(b_new)[a:b], memoryview(b_old)[a:b], m_new.word_bytes)
    kinds.append(k)
    if k == delta.RAW:
      out[a:b] = b_new[a:b]
    else:
      delta.decode_chunk(k, blob, memoryview(b_old)[a:b], memoryview(out)[a:b], m_new.word_bytes)
    verify_chunk(memoryview(out), m_new, i)
  assert kind in kinds
  assert bytes(out) == bytes(b_new)
  got = read_payload(memoryview(out), m_new)
  for k in new:
    assert got[k].tobytes() == np.ascontiguousarray(new[k]).tobytes()


def test_unchanged_words_compress_away_and_noise_goes_raw():
  rng = np.random.default_rng(1)
  base = rng.integers(0, 2**16, 1 << 16, dtype=np.uint16)
  new = base.copy()
  new[::50] ^= 1  # 2% of the words change one bit
  kind, blob = delta.encode_chunk(
      memoryview(new.view(np.uint8)), memoryview(base.view(np.uint8)), 2
  )
  assert kind == delta.XOR_SPARSE and len(blob) < 0.05 * new.nbytes
  kind, blob = delta.encode_chunk(
      memoryview(base.view(np.uint8)), memoryview(base.view(np.uint8)), 2
  )
  assert kind == delta.XOR_SPARSE and len(blob) < 16  # identical chunk: a few bytes
  kind, blob = delta.encode_chunk(memoryview(rng.bytes(4096)), memoryview(bytes(4096)), 2)
  assert (kind, blob) == (delta.RAW, None)  # random data: not worth a delta


@pytest.mark.parametrize("dense", [True, False])
def test_damaged_or_oversized_delta_is_rejected(dense):
  rng = np.random.default_rng(2)
  base = rng.integers(0, 256, 4096, dtype=np.uint8)
  new = base.copy()
  new[:: (1 if dense else 64)] ^= 0x01
  kind, blob = delta.encode_chunk(memoryview(new), memoryview(base), 2)
  assert kind == (delta.XOR_ZLIB if dense else delta.XOR_SPARSE)
  damaged = bytearray(blob)
  damaged[len(damaged) // 2] ^= 0xFF
  out = memoryview(bytearray(4096))
  try:  # damage either fails to inflate or reconstructs wrong bytes; never silently right
    delta.decode_chunk(kind, bytes(damaged), memoryview(base), out, 2)
    assert bytes(out) != new.tobytes()
  except TransferError:
    pass
  bomb = zlib.compress(bytes(1 << 20))
  with pytest.raises(TransferError, match="declared size"):
    delta.decode_chunk(delta.XOR_ZLIB, bomb, memoryview(base), out, 2)
  with pytest.raises(TransferError):
    delta.decode_chunk(
        delta.XOR_SPARSE, (10**6).to_bytes(4, "little") + bomb, memoryview(base), out, 2
    )
