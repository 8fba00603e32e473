"""Delta encoding of one payload chunk against the same chunk of an older version.

Both encodings start from x = new XOR base over the raw bytes, viewed as
words of the payload's smallest itemsize (2 bytes for a bf16 model):

- XOR_SPARSE (few words changed, the usual case for bf16 weights after one
  small optimizer step): the positions of the non-zero words as gaps, byte
  planes split, plus the changed words, zlib-compressed. Decoding is a copy of
  the base and one scattered XOR.
- XOR_ZLIB (many words changed, e.g. fp32 weights where every low mantissa
  byte moves): zlib with run-length strategy over the byte-shuffled XOR
  (byte k of every word together, so the high-byte planes, mostly zero,
  collapse).

Why: XOR of the bit patterns is exact for every dtype (no float arithmetic,
NaNs and -0.0 survive), and an unchanged word is 0. zlib is the only
compressor in the standard library (no zstd/lz4 here). On bf16 weights after
one small optimizer step, the sparse form is both the smallest and the fastest
of the three encodings tried (zlib on the plain XOR, the shuffled run-length
variant, the sparse form; sizes and rates in experiments/RESULTS.md). A chunk
whose delta would not save at least 5% goes raw. Exactness is checked end to
end: the receiver compares every reconstructed chunk with the checksum of the
new version's chunk, so a wrong base or a damaged delta is never loaded.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from streamrl.transfer.manifest import TransferError

RAW, XOR_ZLIB, XOR_SPARSE = 0, 1, 2  # chunk encodings on the wire
SPARSE_MAX_DENSITY = 1 / 8  # above this fraction of changed words the dense form is smaller
_COUNT = struct.Struct("<I")
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _word(word: int, nbytes: int) -> int:
  return word if word in _WORDS and nbytes % word == 0 else 1


def _shuffle(x: np.ndarray, word: int) -> np.ndarray:
  return x if word == 1 else np.ascontiguousarray(x.reshape(-1, word).T)


def _unshuffle(x: np.ndarray, word: int) -> np.ndarray:
  return x if word == 1 else np.ascontiguousarray(x.reshape(word, -1).T).reshape(-1)


def _inflate(blob: bytes, n: int) -> bytes:
  """Inflates exactly n bytes; TransferError if the stream is damaged or would exceed n."""
  d = zlib.decompressobj()
  try:
    raw = d.decompress(blob, n)
    if d.unconsumed_tail or len(raw) != n or not d.eof:
      raise TransferError("delta chunk does not inflate to its declared size")
  except zlib.error as e:
    raise TransferError(f"delta chunk is damaged: {e}") from None
  return raw


def encode_chunk(
    new: memoryview, base: memoryview, word: int, level: int = 1, max_ratio: float = 0.95
) -> tuple[int, bytes | None]:
  """(encoding, blob) for ``new`` given ``base`` (equal lengths); (RAW, None) if a delta saves < 5%."""
  a = np.frombuffer(new, np.uint8)
  b = np.frombuffer(base, np.uint8)
  if a.size != b.size:
    raise ValueError("delta needs equal-length chunks; the layouts differ.")
  w = _word(word, a.size)
  x = np.bitwise_xor(a, b)
  xw = x.view(_WORDS[w])
  changed = np.count_nonzero(xw)
  if changed <= SPARSE_MAX_DENSITY * xw.size:
    idx = np.flatnonzero(xw != 0)
    gaps = np.diff(idx, prepend=0).astype(np.uint32)  # gaps[0] = idx[0]; chunk < 2^32 words
    body = _shuffle(gaps.view(np.uint8), 4).tobytes() + xw[idx].tobytes()
    kind, blob = XOR_SPARSE, _COUNT.pack(changed) + zlib.compress(body, level)
  else:
    c = zlib.compressobj(level, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    kind, blob = XOR_ZLIB, c.compress(_shuffle(x, w)) + c.flush()
  return (kind, blob) if len(blob) <= max_ratio * a.size else (RAW, None)


def decode_chunk(kind: int, blob: bytes, base: memoryview, out: memoryview, word: int) -> None:
  """Writes the chunk ``encode_chunk`` described into ``out`` (len(out) == len(base))."""
  n = len(out)
  w = _word(word, n)
  dst = np.frombuffer(out, np.uint8)
  src = np.frombuffer(base, np.uint8)
  if kind == XOR_ZLIB:
    x = _unshuffle(np.frombuffer(_inflate(blob, n), np.uint8), w)
    np.bitwise_xor(x, src, out=dst)
  elif kind == XOR_SPARSE:
    if len(blob) < _COUNT.size:
      raise TransferError("sparse delta chunk is truncated")
    (count,) = _COUNT.unpack(blob[: _COUNT.size])
    if count > n // w:
      raise TransferError("sparse delta chunk claims more words than the chunk holds")
    raw = np.frombuffer(_inflate(blob[_COUNT.size :], count * (4 + w)), np.uint8)
    idx = np.cumsum(_unshuffle(raw[: 4 * count], 4).view(np.uint32), dtype=np.int64)
    if count and (idx[-1] >= n // w or (count > 1 and np.any(np.diff(idx) <= 0))):
      raise TransferError("sparse delta chunk has positions outside the chunk")
    np.copyto(dst, src)
    words = dst.view(_WORDS[w])
    words[idx] ^= raw[4 * count :].view(_WORDS[w])
  else:
    raise TransferError(f"unknown delta encoding {kind}")
