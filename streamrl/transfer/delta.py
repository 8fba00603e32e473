"""Delta encoding of one payload chunk against the same chunk of an older version.

encode: zlib(byte_shuffle(new XOR base)); decode: base XOR unshuffle(inflate(.)).

Why this scheme:
- XOR of the raw bit patterns is exact for any dtype (no float arithmetic, so
  reconstruction is bitwise and NaNs/-0.0 survive), and an unchanged word
  XORs to 0.
- A small optimizer step changes few bf16 words at all (below half an ulp the
  rounded value stays put) and, for fp32, mostly the low mantissa bytes. The
  byte shuffle groups byte k of every word together (word = the payload's
  smallest itemsize), so the all-zero high-byte planes compress to almost
  nothing. Measured on 16M random bf16 weights with an AdamW-like step at
  lr=1e-6: zlib level 1 without shuffle 0.128 of the raw size, with shuffle
  0.106; fp32: 0.561 vs 0.465.
- zlib is the only compressor in the standard library (no zstd/lz4 installed);
  level 1 is 3-10x faster than level 6 for a few points of ratio. zlib
  releases the GIL, so chunks are encoded on a small thread pool ahead of the
  socket.
- Exactness is verified end to end: the receiver checks every reconstructed
  chunk against the *full* payload's crc32 from the manifest, so a wrong base
  or a damaged delta can never be loaded.
"""

from __future__ import annotations

import zlib

import numpy as np

from streamrl.transfer.manifest import TransferError

RAW, XOR_ZLIB = 0, 1  # chunk encodings on the wire


def _shuffle(x: np.ndarray, word: int) -> np.ndarray:
    if word <= 1 or x.size % word:
        return x
    return np.ascontiguousarray(x.reshape(-1, word).T)


def _unshuffle(x: np.ndarray, word: int) -> np.ndarray:
    if word <= 1 or x.size % word:
        return x
    return np.ascontiguousarray(x.reshape(word, -1).T).reshape(-1)


def encode_chunk(new: memoryview, base: memoryview, word: int, level: int = 1) -> bytes:
    """Delta of two equal-length byte ranges: zlib(shuffle(new ^ base, word))."""
    a = np.frombuffer(new, np.uint8)
    b = np.frombuffer(base, np.uint8)
    if a.size != b.size:
        raise ValueError("delta needs equal-length chunks; the layouts differ.")
    return zlib.compress(_shuffle(np.bitwise_xor(a, b), word), level)


def decode_chunk(enc: bytes, base: memoryview, out: memoryview, word: int) -> None:
    """Writes base ^ unshuffle(inflate(enc)) into ``out`` (len(out) == len(base)).

    Bounded inflate: a delta that expands beyond the chunk size (a zip bomb or
    a damaged stream) raises TransferError instead of allocating memory.
    """
    n = len(out)
    d = zlib.decompressobj()
    try:
        raw = d.decompress(enc, n)
        if d.unconsumed_tail or len(raw) != n or not d.eof:
            raise TransferError("delta chunk does not inflate to the chunk size")
    except zlib.error as e:
        raise TransferError(f"delta chunk is damaged: {e}") from None
    x = _unshuffle(np.frombuffer(raw, np.uint8), word)
    np.bitwise_xor(x, np.frombuffer(base, np.uint8), out=np.frombuffer(out, np.uint8))


def encode_or_raw(new: memoryview, base: memoryview, word: int, level: int = 1,
                  max_ratio: float = 0.95) -> tuple[int, bytes | None]:
    """(XOR_ZLIB, bytes) when the delta saves at least 1 - max_ratio, else (RAW, None)."""
    enc = encode_chunk(new, base, word, level)
    if len(enc) <= max_ratio * len(new):
        return XOR_ZLIB, enc
    return RAW, None
