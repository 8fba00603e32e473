"""Delta chunks reconstruct the new payload bit for bit, and damage is caught."""

import zlib

import ml_dtypes
import numpy as np
import pytest

from streamrl.transfer import delta
from streamrl.transfer.manifest import TransferError, payload_size, read_payload, verify_chunk, write_payload


def _adamw_step(w, lr, rng):
    g = rng.standard_normal(w.shape).astype(np.float32)
    return w.astype(np.float32) - lr * (np.sign(g) + 0.01 * w.astype(np.float32))


def _payload(tensors, version, chunk_bytes=512):
    buf = bytearray(payload_size(tensors))
    return write_payload(tensors, memoryview(buf), version, chunk_bytes), buf


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_delta_reconstruction_is_bit_exact(dtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 48)) * 0.02).astype(np.float32)
    special = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-40], np.float32)  # NaN payload and subnormals too
    old = {"w": w.astype(dtype), "s": special.astype(dtype), "b": rng.standard_normal(5).astype(np.float32)}
    new = {"w": _adamw_step(w, 1e-3, rng).astype(dtype), "s": special[::-1].astype(dtype),
           "b": old["b"] + np.float32(1e-7)}
    m_old, b_old = _payload(old, 1)
    m_new, b_new = _payload(new, 2)
    assert m_old.layout == m_new.layout
    out = bytearray(len(b_new))
    for i in range(m_new.num_chunks):
        a, b = m_new.chunk_range(i)
        enc = delta.encode_chunk(memoryview(b_new)[a:b], memoryview(b_old)[a:b], m_new.word_bytes)
        delta.decode_chunk(enc, memoryview(b_old)[a:b], memoryview(out)[a:b], m_new.word_bytes)
        verify_chunk(memoryview(out), m_new, i)
    assert bytes(out) == bytes(b_new)
    got = read_payload(memoryview(out), m_new)
    for k in new:
        assert got[k].tobytes() == np.ascontiguousarray(new[k]).tobytes()


def test_unchanged_words_compress_away():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2 ** 16, 1 << 16, dtype=np.uint16)
    new = base.copy()
    new[::50] ^= 1  # 2% of the words change one bit
    enc = delta.encode_chunk(memoryview(new.view(np.uint8)), memoryview(base.view(np.uint8)), 2)
    assert len(enc) < 0.1 * new.nbytes
    kind, _ = delta.encode_or_raw(memoryview(rng.bytes(4096)), memoryview(bytes(4096)), 2)
    assert kind == delta.RAW  # random data: not worth a delta, send raw


def test_damaged_or_oversized_delta_is_rejected():
    base = memoryview(bytes(1024))
    new = memoryview(bytes(range(256)) * 4)
    enc = bytearray(delta.encode_chunk(new, base, 2))
    enc[len(enc) // 2] ^= 0xFF
    with pytest.raises(TransferError):
        delta.decode_chunk(bytes(enc), base, memoryview(bytearray(1024)), 2)
    bomb = zlib.compress(bytes(1 << 20))
    with pytest.raises(TransferError, match="chunk size"):
        delta.decode_chunk(bomb, base, memoryview(bytearray(1024)), 2)
