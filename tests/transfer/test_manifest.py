"""Payload format: safetensors compatibility, chunk checksums, schema refusal."""

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn

from streamrl.transfer.manifest import (
    ChecksumError,
    Manifest,
    SchemaMismatch,
    TensorSpec,
    TransferError,
    check_schema,
    describe_payload,
    payload_size,
    read_payload,
    schema_of,
    verify_chunk,
    write_payload,
)

pytestmark = [pytest.mark.unit]


def _tensors(seed=0):
  rng = np.random.default_rng(seed)
  return {
      "model.embed_tokens.weight": rng.standard_normal((33, 16)).astype(ml_dtypes.bfloat16),
      "model.layers.0.mlp.up_proj.weight": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
      "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(15).astype(np.float32),
      "model.norm.weight": rng.standard_normal(16).astype(np.float32),
      "step": np.array([7, -3], np.int64),
  }


def _build(tensors, version=1, chunk_bytes=256):
  buf = bytearray(payload_size(tensors))
  m = write_payload(tensors, memoryview(buf), version, chunk_bytes)
  return m, buf


def _same(a, b):
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_roundtrip_zero_copy_views_are_bit_exact_and_read_only():
  t = _tensors()
  m, buf = _build(t)
  assert m.num_chunks == -(-len(buf) // 256)
  out = read_payload(memoryview(buf), m)
  assert set(out) == set(t) and all(_same(out[k], t[k]) for k in t)
  assert not out["model.norm.weight"].flags.writeable
  # layout: itemsize descending, so every view is aligned
  assert [s.itemsize for s in m.tensors] == sorted((s.itemsize for s in m.tensors), reverse=True)
  assert all(a.flags.aligned for a in out.values())


def test_payload_is_a_safetensors_file_both_ways():
  plain = {k: v for k, v in _tensors().items() if v.dtype != ml_dtypes.bfloat16}
  m, buf = _build(plain)
  lib = stn.load(bytes(buf))  # the library reads our bytes
  assert all(_same(lib[k], plain[k]) for k in plain)
  t = _tensors()
  data = stn.save(t)  # we read the library's bytes (bf16 included, which its numpy loader cannot)
  out = read_payload(memoryview(data), describe_payload(memoryview(data), 1, 1024))
  assert all(_same(out[k], t[k]) for k in t)


def test_flipped_bit_is_caught_by_its_chunk_checksum_only():
  m, buf = _build(_tensors())
  buf[300] ^= 0x10  # inside chunk 1
  verify_chunk(memoryview(buf), m, 0)
  with pytest.raises(ChecksumError, match="chunk 1"):
    verify_chunk(memoryview(buf), m, 1)


def test_manifest_json_roundtrip_and_validation():
  m, _ = _build(_tensors())
  assert Manifest.from_json(json.loads(json.dumps(m.to_json()))) == m
  bad = m.to_json() | {"checksums": m.to_json()["checksums"][:-1]}
  with pytest.raises(TransferError):
    Manifest.from_json(bad)
  with pytest.raises(TransferError):
    Manifest.from_json({"version": 1})


def test_header_that_disagrees_with_manifest_is_rejected():
  m, buf = _build(_tensors())
  specs = tuple(
      TensorSpec(s.name, (4, 4) if s.name == "model.norm.weight" else s.shape, s.dtype)
      for s in m.tensors
  )
  forged = Manifest(1, specs, m.total_bytes, m.chunk_bytes, m.checksums)
  with pytest.raises(TransferError, match="model.norm.weight"):
    read_payload(memoryview(buf), forged)


def test_schema_refusal_names_the_first_mismatched_parameter():
  t = _tensors()
  got = schema_of(t)
  expected = {k: (v.shape, v.dtype) for k, v in t.items()}
  check_schema(got, expected, 3)  # matches
  expected["model.layers.0.mlp.up_proj.weight"] = ((8, 16), ml_dtypes.bfloat16)
  expected["model.norm.weight"] = ((17,), np.float32)
  with pytest.raises(SchemaMismatch) as e:
    check_schema(got, expected, 3)
  msg = str(e.value)
  assert "'model.layers.0.mlp.up_proj.weight'" in msg and "(16, 8)" in msg and "(8, 16)" in msg
  assert "model.norm.weight" not in msg and msg.count("expects") == 1
  del expected["model.layers.0.mlp.up_proj.weight"]
  expected["model.norm.weight"] = ((16,), "BF16")
  with pytest.raises(
      SchemaMismatch, match="'model.norm.weight' has dtype F32 but the model expects BF16"
  ):
    check_schema(got, expected, 3)
  expected["model.norm.weight"] = ((16,), np.float32)
  with pytest.raises(
      SchemaMismatch, match="'model.layers.0.mlp.up_proj.weight' is not a parameter"
  ):
    check_schema(got, expected, 3)
  del expected["step"]
  expected["model.layers.0.mlp.up_proj.weight"] = ((16, 8), ml_dtypes.bfloat16)
  expected["lm_head.weight"] = ((33, 16), ml_dtypes.bfloat16)
  with pytest.raises(SchemaMismatch, match="'lm_head.weight' is missing"):
    check_schema(got, expected, 3)


def test_unsupported_dtype_is_refused_with_a_fix():
  with pytest.raises(ValueError, match="convert the tensor"):
    payload_size({"x": np.zeros(3, np.complex64)})
