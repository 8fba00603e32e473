import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl.models import config, transformer
from streamrl.trainer import sharding


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
def test_logprobs_are_a_normalised_distribution(make):
  cfg = make(64)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
  logits = model(tokens)
  assert logits.shape == (2, 12, 64)
  np.testing.assert_allclose(jnp.exp(jax.nn.log_softmax(logits)).sum(-1), 1.0, rtol=1e-5)
  logp, ent = transformer.sequence_logprobs(model, tokens)
  assert logp.shape == ent.shape == (2, 12)
  assert np.all(np.asarray(logp) <= 0) and np.all(np.asarray(ent) >= 0)
  # Column t scores token t+1: check one entry by hand.
  ref = jax.nn.log_softmax(logits[0, 3])[tokens[0, 4]]
  np.testing.assert_allclose(logp[0, 3], ref, rtol=1e-6)


def test_causal_future_tokens_do_not_change_the_past():
  model = transformer.Transformer(config.tiny_qwen2(64), rngs=nnx.Rngs(0))
  a = jnp.array([[1, 5, 6, 7, 8, 9]])
  b = a.at[0, 4:].set(jnp.array([20, 21]))
  np.testing.assert_allclose(model(a)[0, :4], model(b)[0, :4], atol=1e-6)


def test_gqa_equals_full_attention_with_repeated_kv_heads():
  """A GQA model equals an MHA model whose kv heads are repeated per group."""
  cfg = config.tiny_llama(64)  # 6 query heads, 3 kv heads
  gqa = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  mha_cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads)
  mha = transformer.Transformer(mha_cfg, rngs=nnx.Rngs(1))
  g = cfg.num_heads // cfg.num_kv_heads
  for src, dst in zip(gqa.trunk.blocks, mha.trunk.blocks):
    for name in ("w_q_dhn", "w_o_hnd"):
      getattr(dst.attn, name)[...] = getattr(src.attn, name)[...]
    for name in ("w_k_dkn", "w_v_dkn"):
      getattr(dst.attn, name)[...] = jnp.repeat(getattr(src.attn, name)[...], g, axis=1)
    for name in ("w_gate_df", "w_up_df", "w_down_fd"):
      getattr(dst.mlp, name)[...] = getattr(src.mlp, name)[...]
  mha.trunk.embedding_vd[...] = gqa.trunk.embedding_vd[...]
  mha.w_head_dv[...] = gqa.w_head_dv[...]
  tokens = jnp.array([[1, 4, 9, 16, 25, 36, 49]])
  np.testing.assert_allclose(gqa(tokens), mha(tokens), atol=1e-5)


def test_critic_shares_the_trunk_shape_and_returns_scalars():
  critic = transformer.Critic(config.tiny_qwen2(64), rngs=nnx.Rngs(0))
  values = critic(jnp.ones((3, 7), jnp.int32))
  assert values.shape == (3, 7)


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
def test_forward_on_8_device_mesh_matches_single_device(make):
  assert jax.device_count() >= 8, "tests/conftest.py should fake 8 CPU devices"
  cfg = make(64)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (8, 16), 0, 64)
  ref = transformer.sequence_logprobs(model, tokens)[0]
  mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
  sharded = sharding.shard_module(model, mesh)
  # Parameters really are split across devices.
  w = sharded.trunk.blocks[0].mlp.w_gate_df[...]
  assert w.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert len(w.addressable_shards) == 8 and w.addressable_shards[0].data.shape == (
      cfg.hidden_size // 2,
      cfg.intermediate_size // 4,
  )
  out = transformer.sequence_logprobs(
      sharded, jax.device_put(tokens, sharding.batch_sharding(mesh, 2))
  )[0]
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
