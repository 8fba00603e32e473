import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl.models import config, transformer
from streamrl.trainer import sharding

pytestmark = [pytest.mark.unit]


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


# ------------------------------------------------------------- precision
BF16 = config.ComputeConfig(dtype="bfloat16")


def _tokens(vocab, b=3, t=24, seed=3):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, vocab)


def test_a_fixed_mesh_smaller_than_the_host_uses_its_first_devices():
  # 8 faked devices (conftest): fixed axes of 2 x 1 take the first two; -1
  # still takes all of them, and asking for more than there are is refused.
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 1})
  assert list(mesh.devices.flat) == jax.devices()[:2]
  assert sharding.make_mesh({"fsdp": -1}).devices.size == len(jax.devices())
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh({"fsdp": 4, "tensor": 4})


def test_compute_config_refuses_unknown_values():
  with pytest.raises(ValueError, match="compute dtype"):
    config.ComputeConfig(dtype="float16")
  with pytest.raises(ValueError, match="remat"):
    config.ComputeConfig(remat="some")
  with pytest.raises(ValueError, match="logprob_chunk"):
    config.ComputeConfig(logprob_chunk=-1)


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
def test_bf16_compute_logprobs_are_close_to_fp32(make):
  """bf16 activations and matmuls (fp32 master weights, fp32 log-softmax)
  against fp32 compute, on the same weights.

  Measured (tiny random models, 3 x 24 tokens, vocab 64, logprobs ~ -4.2):
  max |diff| 3.3e-3 / mean 1.0e-3 (qwen2), 5.4e-3 / 1.6e-3 (llama) with the
  fp32 LM head; 3.4e-3 / 1.1e-3 and 6.1e-3 / 1.6e-3 with a bf16 head;
  entropies within 3.3e-4. Tolerance: 2e-2 max, 4e-3 mean (entropy 1e-2).
  """
  model = transformer.Transformer(make(64), rngs=nnx.Rngs(0))
  tokens = _tokens(64)
  ref, ref_ent = transformer.sequence_logprobs(model, tokens)
  for compute in (BF16, dataclasses.replace(BF16, fp32_lm_head=False)):
    logp, ent = transformer.sequence_logprobs(model, tokens, compute=compute)
    assert logp.dtype == ent.dtype == jnp.float32
    diff = np.abs(np.asarray(logp) - np.asarray(ref))
    assert diff.max() < 2e-2 and diff.mean() < 4e-3, (compute, diff.max(), diff.mean())
    assert diff.max() > 0  # really computed in bf16
    np.testing.assert_allclose(ent, ref_ent, atol=1e-2)
  # Parameters are not converted in place: the model stays fp32.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))


def test_bf16_compute_runs_in_bf16_with_fp32_logits():
  model = transformer.Transformer(config.tiny_qwen2(64), rngs=nnx.Rngs(0))
  tokens = _tokens(64)
  h = model.trunk(tokens, None, BF16)
  assert h.dtype == jnp.float32  # fp32 LM head: the last norm's output is fp32
  h = model.trunk(tokens, None, dataclasses.replace(BF16, fp32_lm_head=False))
  assert h.dtype == jnp.bfloat16
  assert model(tokens, compute=BF16).dtype == jnp.float32
  critic = transformer.Critic(config.tiny_qwen2(64), rngs=nnx.Rngs(0))
  assert critic(tokens, compute=BF16).dtype == jnp.float32


def _loss_and_grads(model, tokens, compute, temperature=1.0):
  """A loss that uses logprobs and entropies with distinct weights."""
  graphdef, params = nnx.split(model, nnx.Param)
  w = jax.random.normal(jax.random.key(9), tokens.shape)

  def loss(p):
    logp, ent = transformer.next_token_logprobs(
        nnx.merge(graphdef, p), tokens, temperature, compute
    )
    return jnp.sum(w * logp) + 0.3 * jnp.sum(w[::-1] * ent), (logp, ent)

  (value, (logp, ent)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return value, logp, ent, grads


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
@pytest.mark.parametrize("chunk", [5, 8, 23])
def test_chunked_logprobs_and_gradients_equal_unchunked(make, chunk):
  # t = 24: chunk 5 pads the last chunk, 8 divides, 23 leaves a 1-position chunk.
  model = transformer.Transformer(make(64), rngs=nnx.Rngs(0))
  tokens = _tokens(64)
  full = _loss_and_grads(model, tokens, config.ComputeConfig(), temperature=0.7)
  chunked = _loss_and_grads(model, tokens, config.ComputeConfig(logprob_chunk=chunk), 0.7)
  for a, b in zip(full[1:3], chunked[1:3]):
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
  # The loss sums w * logp + 0.3 w' * ent over all positions: it may differ by
  # what the elements differ by, weighted, plus fp32 pairwise-summation error
  # (ceil(log2 n) * eps * sum |terms|); a bound, not one CPU's measurement.
  w = np.abs(np.asarray(jax.random.normal(jax.random.key(9), tokens.shape)))
  logp, ent = (np.asarray(x, np.float64) for x in full[1:3])
  d_logp, d_ent = (
      np.abs(np.asarray(b, np.float64) - a).max() for a, b in zip((logp, ent), chunked[1:3])
  )
  terms = np.concatenate([(w * np.abs(logp)).ravel(), (0.3 * w[::-1] * np.abs(ent)).ravel()])
  eps = np.finfo(np.float32).eps
  bound = w.sum() * (d_logp + 0.3 * d_ent) + np.ceil(np.log2(terms.size)) * eps * terms.sum()
  assert abs(float(chunked[0]) - float(full[0])) <= bound
  for a, b in zip(jax.tree.leaves(full[3]), jax.tree.leaves(chunked[3])):
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)
  # The last column is padding in both.
  assert np.all(np.asarray(chunked[1])[:, -1] == 0)


def test_chunked_scoring_never_holds_full_logits():
  """The compiled scorer's temporaries shrink with the chunk: the [b, t, v]
  fp32 logits (and their log-softmax) exist one chunk at a time."""
  cfg = dataclasses.replace(config.tiny_qwen2(8192), num_layers=1)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = _tokens(8192, b=2, t=128)

  def temp_bytes(chunk):
    compute = config.ComputeConfig(logprob_chunk=chunk)
    lowered = transformer.sequence_logprobs.lower(model, tokens, compute=compute)
    return lowered.compile().memory_analysis().temp_size_in_bytes

  full_logits = 2 * 128 * 8192 * 4
  # Measured: 16.8 MB unchunked, 4.3 MB in chunks of 32, 2.2 MB in chunks of 16.
  assert temp_bytes(0) >= 2 * full_logits
  assert temp_bytes(16) < full_logits / 3


def _relative_difference(a, b) -> float:
  """||a - b|| / ||a|| over all leaves of two gradient trees."""
  sq = lambda x: float(np.sum(np.square(np.asarray(x, np.float64))))
  diff = sum(
      sq(np.asarray(x, np.float64) - y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
  return (diff / sum(sq(x) for x in jax.tree.leaves(a))) ** 0.5


@pytest.mark.parametrize("remat", ["full", "dots", "minimal"])
def test_remat_gives_the_same_loss_and_gradients(remat):
  """fp32: the same (bit for bit, measured). bf16: the same loss (the recomputed forward rounds the
  same way) and gradients within bf16 noise -- XLA fuses the backward's bf16
  cotangents differently. Measured ||g_remat - g|| / ||g||: 4.8e-3 (full),
  2.4e-3 (dots), against 6.5e-3 for bf16 vs fp32 compute itself."""
  model = transformer.Transformer(config.tiny_llama(64), rngs=nnx.Rngs(0))
  tokens = _tokens(64)
  plain = _loss_and_grads(model, tokens, config.ComputeConfig())
  rematted = _loss_and_grads(model, tokens, config.ComputeConfig(remat=remat))
  assert float(rematted[0]) == pytest.approx(float(plain[0]), rel=1e-7)
  for a, b in zip(jax.tree.leaves(plain[3]), jax.tree.leaves(rematted[3])):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
  bf16 = config.ComputeConfig(dtype="bfloat16")
  plain = _loss_and_grads(model, tokens, bf16)
  rematted = _loss_and_grads(model, tokens, dataclasses.replace(bf16, remat=remat))
  assert float(rematted[0]) == pytest.approx(float(plain[0]), rel=1e-7)
  assert _relative_difference(plain[3], rematted[3]) < 1e-2


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
def test_read_dtype_cast_keeps_the_logprobs_and_halves_the_matmul_weights(make):
  cfg = make(64)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  critic = transformer.Critic(cfg, rngs=nnx.Rngs(1))
  tokens = _tokens(64)
  graphdef, params = nnx.split(model, nnx.Param)
  fp32 = transformer.read_dtype_cast(params, cfg, config.ComputeConfig())
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(fp32))
  for compute in (BF16, dataclasses.replace(BF16, fp32_lm_head=False)):
    cast = transformer.read_dtype_cast(params, cfg, compute)
    dtypes = {
        jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_flatten_with_path(cast)[0]
    }
    head = "['trunk']['embedding_vd'].value" if cfg.tie_embeddings else "['w_head_dv'].value"
    assert dtypes[head] == (jnp.float32 if compute.fp32_lm_head else jnp.bfloat16)
    assert dtypes["['trunk']['blocks'][0]['mlp']['w_up_df'].value"] == jnp.bfloat16
    assert dtypes["['trunk']['blocks'][0]['attn_norm']['scale'].value"] == jnp.float32
    want = transformer.sequence_logprobs(nnx.merge(graphdef, params), tokens, compute=compute)
    got = transformer.sequence_logprobs(nnx.merge(graphdef, cast), tokens, compute=compute)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
  cgraph, cparams = nnx.split(critic, nnx.Param)
  ccast = transformer.read_dtype_cast(cparams, cfg, BF16)
  assert ccast["w_value_d"][...].dtype == jnp.float32
  np.testing.assert_array_equal(
      nnx.merge(cgraph, ccast)(tokens, compute=BF16), critic(tokens, compute=BF16)
  )


@pytest.mark.parametrize("make,mha", [(config.tiny_qwen2, False), (config.tiny_llama, True)])
def test_fused_attention_equals_the_reference_path_in_fp32(make, mha):
  """jax.nn.dot_product_attention (grouped kv heads, causal) against the
  spelled-out scores, on grouped-query and multi-head configs: logits,
  logprobs and gradients."""
  cfg = make(64)
  if mha:
    cfg = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads)
  assert (cfg.num_heads == cfg.num_kv_heads) == mha
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  tokens = _tokens(64)
  fused = config.ComputeConfig(attention="fused")
  ref = config.ComputeConfig(attention="reference")
  logits = nnx.jit(lambda m, c: m(tokens, compute=c), static_argnums=1)
  assert float(jnp.abs(logits(model, fused) - logits(model, ref)).max()) <= 1e-5
  got, want = _loss_and_grads(model, tokens, fused), _loss_and_grads(model, tokens, ref)
  np.testing.assert_allclose(got[1], want[1], atol=1e-5)
  for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3])):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_explicit_positions_take_the_reference_path():
  """Positions other than 0..t-1 (here with gaps) mask by position, which the
  fused call cannot: both settings must give the reference result."""
  model = transformer.Transformer(config.tiny_qwen2(64), rngs=nnx.Rngs(0))
  tokens = jnp.array([[3, 5, 7, 9, 11]])
  positions = jnp.array([[0, 1, 4, 9, 16]])
  a = model(tokens, positions, config.ComputeConfig(attention="fused"))
  b = model(tokens, positions, config.ComputeConfig(attention="reference"))
  np.testing.assert_array_equal(a, b)
  assert float(jnp.abs(a - model(tokens)).max()) > 1e-4  # RoPE saw the positions


def test_random_init_makes_each_parameter_in_its_sharding_with_a_traced_key():
  cfg = config.tiny_llama(64)
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2})
  build = lambda rngs: transformer.Transformer(cfg, rngs=rngs)
  model = sharding.random_init(build, mesh, 3, transformer.initializer)
  again = sharding.random_init(build, mesh, 3, transformer.initializer)
  other = sharding.random_init(build, mesh, 4, transformer.initializer)
  eager = transformer.Transformer(cfg, rngs=nnx.Rngs(3))  # the constructor's own initializers
  want = dict(nnx.to_flat_state(nnx.state(eager, nnx.Param)))
  shardings = sharding.state_shardings(nnx.state(model), mesh)
  flat_shardings = dict(nnx.to_flat_state(shardings))
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x, ref = np.asarray(var.get_value()), np.asarray(want[path].get_value())
    assert x.shape == ref.shape and x.dtype == ref.dtype
    assert var.get_value().sharding == flat_shardings[path].get_value()
    if np.all(ref == ref.flat[0]):  # zeros / ones in the constructor: the same here
      np.testing.assert_array_equal(x, ref)
    else:
      assert abs(float(x.std()) - float(ref.std())) < 0.2 * float(ref.std())
  leaves = lambda m: [np.asarray(x) for x in jax.tree.leaves(nnx.state(m, nnx.Param))]
  assert all(np.array_equal(a, b) for a, b in zip(leaves(model), leaves(again)))
  assert not np.array_equal(leaves(model)[-1], leaves(other)[-1]) or not np.array_equal(
      np.asarray(model.trunk.embedding_vd[...]), np.asarray(other.trunk.embedding_vd[...])
  )
  # The key is an argument of the jitted programs, not a constant inside them.
  hlo = (
      sharding._leaf_init(  # pylint: disable=protected-access
          transformer.initializer("w_q_dhn"),
          (cfg.hidden_size, cfg.num_heads, cfg.head_dim),
          np.dtype("float32"),
          flat_shardings[("trunk", "blocks", 0, "attn", "w_q_dhn")].get_value(),
      )
      .lower(jax.random.key(0), np.uint32(0))
      .as_text()
  )
  assert "threefry" in hlo.lower() or "rng" in hlo.lower()
  assert "constant" not in hlo.split("ENTRY")[-1].split("\n")[1] if "ENTRY" in hlo else True


@pytest.mark.parametrize(
    "spec,x_shape,w_shape",
    [
        ("BTD,DHN->BTHN", (2, 5, 8), (8, 3, 4)),
        ("BTHN,HND->BTD", (2, 5, 3, 4), (3, 4, 8)),
        ("BTD,VD->BTV", (2, 5, 8), (11, 8)),
        ("BTD,DV->BTV", (2, 5, 8), (8, 11)),
    ],
)
def test_matmul_equals_the_einsum_with_its_gradients(spec, x_shape, w_shape):
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, x_shape)
  w = jax.random.normal(kw, w_shape)
  dy = jax.random.normal(ky, jnp.einsum(spec, x, w).shape)
  plain = lambda x, w: jnp.einsum(spec, x, w)
  ours = lambda x, w: transformer.matmul(spec, x, w)
  np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-5, atol=1e-5)
  for got, want in zip(jax.vjp(ours, x, w)[1](dy), jax.vjp(plain, x, w)[1](dy)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # bf16 activations on an fp32 weight: the gradients come back in each input's dtype.
  xb = x.astype(jnp.bfloat16)
  y, vjp = jax.vjp(ours, xb, w)
  dx, dw = vjp(dy.astype(jnp.bfloat16))
  assert y.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  np.testing.assert_allclose(dw, jax.vjp(plain, x, w)[1](dy)[1], rtol=0.05, atol=0.1)


def test_a_bf16_backward_pass_holds_no_fp32_copy_of_the_weights():
  """Activations' gradient through a stack of frozen bf16 weights: XLA's own
  temporaries stay far below one fp32 copy of the weights."""
  n, d = 6, 512
  ws = [jax.random.normal(jax.random.key(i), (d, d), jnp.bfloat16) for i in range(n)]
  x = jnp.ones((4, 16, d), jnp.bfloat16)

  def loss(x, ws):
    for w in ws:
      x = jnp.tanh(transformer.matmul("BTD,DE->BTE", x, w))
    return x.astype(jnp.float32).sum()

  grad = jax.jit(jax.grad(loss))
  temp = grad.lower(x, ws).compile().memory_analysis().temp_size_in_bytes
  assert temp < n * d * d * 4 / 4, temp


def test_a_bf16_embedding_gathers_exactly_and_still_takes_its_gradient():
  table = jax.random.normal(jax.random.key(0), (11, 4)).astype(jnp.bfloat16)
  tokens = jnp.array([[1, 3, 3], [0, 10, 1]])
  np.testing.assert_array_equal(transformer.embed(table, tokens), jnp.take(table, tokens, axis=0))
  loss = lambda gather: lambda w: (gather(w).astype(jnp.float32) ** 2).sum()
  ours = jax.jit(jax.grad(loss(lambda w: transformer.embed(w, tokens))))(table)
  plain = jax.grad(loss(lambda w: jnp.take(w, tokens, axis=0)))(table)
  assert ours.dtype == jnp.bfloat16 and float(jnp.abs(plain.astype(jnp.float32)).sum()) > 0
  np.testing.assert_array_equal(ours, plain)
