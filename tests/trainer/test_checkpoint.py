"""Checkpointer: bit-exact round trip, keep-last-N, sharded restore, refusals."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from streamrl.trainer.checkpoint import Checkpointer

pytestmark = [pytest.mark.unit]

FP = {"algo": "ppo", "critic": True, "model": {"d_model": 16, "num_layers": 2, "mesh": (1, 8)}}


def _state(seed: int = 0):
  """A run-like pytree: nnx params, a dict of arrays, optimizer-ish tuple, RNG keys."""
  rng = np.random.default_rng(seed)
  actor = nnx.split(nnx.Linear(8, 16, rngs=nnx.Rngs(seed)))[1]
  critic = {
      "w": jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16),
      "b": jnp.asarray(rng.standard_normal(4), jnp.float32),
  }
  opt = (
      jnp.asarray(rng.integers(0, 100, (16,)), jnp.int32),
      {"mu": jnp.asarray(rng.standard_normal((8, 16)))},
  )
  return {
      "actor": actor,
      "critic": critic,
      "opt": opt,
      "rng": jax.random.key(seed),
      "rng_data": jax.random.key_data(jax.random.key(seed + 1)),
  }


def _leaves(tree):
  """Numpy leaves, typed PRNG keys as their raw data, for exact comparison."""

  def raw(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    return np.asarray(x)

  return [raw(x) for x in jax.tree.leaves(tree)]


def _assert_bit_exact(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(_leaves(a), _leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _listing(d):
  out = {}
  for root, dirs, files in os.walk(d):
    for name in dirs + files:
      p = os.path.join(root, name)
      out[p] = os.stat(p).st_mtime_ns
  return out


def test_round_trip_is_bit_exact_and_carries_meta(tmp_path):
  state = _state()
  meta = {"data": {"index": 7, "epoch": np.int64(1)}, "weight_version": 3, "counters": [1, 2]}
  with Checkpointer(str(tmp_path / "ck"), fingerprint=FP) as ck:
    assert ck.latest_step() is None
    assert ck.save(5, state, meta)
    assert ck.latest_step() == 5
    step, restored, meta_back = ck.restore(jax.tree.map(jnp.zeros_like, state))
  assert step == 5
  _assert_bit_exact(restored, state)
  assert isinstance(restored["actor"], nnx.State)
  assert meta_back == {"data": {"index": 7, "epoch": 1}, "weight_version": 3, "counters": [1, 2]}
  # A new Checkpointer (a restarted run) sees the same thing.
  with Checkpointer(str(tmp_path / "ck"), fingerprint=dict(FP)) as ck:
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    step, restored, _ = ck.restore(abstract)
  assert step == 5
  _assert_bit_exact(restored, state)


def test_keeps_last_n_and_restores_latest_or_given_step(tmp_path):
  with Checkpointer(str(tmp_path), keep=2, fingerprint=FP) as ck:
    for step in (1, 2, 3, 4):
      ck.save(step, _state(step), {"step": step})
    assert ck.all_steps() == [3, 4]
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["3", "4"]
    step, arrays, meta = ck.restore(_state(0))
    assert (step, meta) == (4, {"step": 4})
    _assert_bit_exact(arrays, _state(4))
    step, arrays, meta = ck.restore(_state(0), step=3)
    assert (step, meta) == (3, {"step": 3})
    _assert_bit_exact(arrays, _state(3))
    # Saving a step that is already there leaves it alone.
    before = _listing(tmp_path)
    assert not ck.save(4, _state(9), {"step": 99})
    assert _listing(tmp_path) == before
    with pytest.raises(ValueError, match="newer step 4"):
      ck.save(2, _state(2), {})
    with pytest.raises(FileNotFoundError, match="steps there"):
      ck.restore(_state(0), step=1)


def test_restore_onto_sharded_template(tmp_path):
  assert jax.device_count() == 8, "tests/conftest.py should fake 8 CPU devices"
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  state = _state(1)
  with Checkpointer(str(tmp_path), fingerprint=FP) as ck:
    ck.save(10, state, {})  # Saved from single-device arrays...

    def spec(x):
      if x.ndim == 2:
        return P("fsdp", "data") if x.shape[1] % 2 == 0 else P("fsdp", None)
      return P("fsdp") if x.ndim == 1 and x.shape[0] % 4 == 0 else P()

    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))),
        state,
    )
    _, restored, _ = ck.restore(abstract)  # ...restored sharded over 8 devices.
  _assert_bit_exact(restored, state)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
  assert len(restored["opt"][1]["mu"].sharding.device_set) == 8
  assert restored["opt"][1]["mu"].addressable_shards[0].data.shape == (2, 8)


def test_refuses_incompatible_fingerprint_without_touching_anything(tmp_path):
  with Checkpointer(str(tmp_path), fingerprint=FP) as ck:
    ck.save(1, _state(), {"a": 1})
    ck.save(2, _state(), {"a": 2})
  before = _listing(tmp_path)
  other = {"algo": "ppo", "critic": True, "model": {"d_model": 16, "num_layers": 4, "mesh": (1, 8)}}
  with pytest.raises(
      ValueError, match=r"model\.num_layers is 2 there but 4 now; use a new --workdir"
  ):
    Checkpointer(str(tmp_path), keep=1, fingerprint=other)
  with pytest.raises(ValueError, match=r"critic is true there but null now"):
    Checkpointer(str(tmp_path), keep=1, fingerprint={k: v for k, v in FP.items() if k != "critic"})
  assert _listing(tmp_path) == before
  # Tuples and lists are the same fingerprint (JSON), and the same one resumes.
  with Checkpointer(
      str(tmp_path), fingerprint={**FP, "model": {**FP["model"], "mesh": [1, 8]}}
  ) as ck:
    assert ck.latest_step() == 2


def test_refuses_foreign_checkpoints_and_mismatched_templates(tmp_path):
  import orbax.checkpoint as ocp

  foreign = tmp_path / "foreign"
  with ocp.CheckpointManager(str(foreign), options=ocp.CheckpointManagerOptions(create=True)) as m:
    m.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave({"x": np.zeros(2)})))
    m.wait_until_finished()
  before = _listing(foreign)
  with pytest.raises(ValueError, match="not written by streamrl's Checkpointer"):
    Checkpointer(str(foreign), fingerprint=FP)
  assert _listing(foreign) == before

  with Checkpointer(str(tmp_path / "ok"), fingerprint=FP) as ck:
    state = _state()
    ck.save(1, state, {})
    grown = {**state, "critic": {**state["critic"], "w": jnp.zeros((8, 5), jnp.bfloat16)}}
    with pytest.raises(
        ValueError, match=r"\['critic'\]\['w'\] has shape \(8, 4\) in the checkpoint but \(8, 5\)"
    ):
      ck.restore(grown)
    with pytest.raises(
        ValueError, match=r"\['critic'\]\['b'\] is in the checkpoint but not in the restore"
    ):
      ck.restore({**state, "critic": {"w": state["critic"]["w"]}})
    with pytest.raises(ValueError, match="must be JSON-serialisable"):
      ck.save(2, state, {"bad": object()})
  with pytest.raises(ValueError, match="must be JSON-serialisable"):
    Checkpointer(str(tmp_path / "x"), fingerprint={"f": object()})
