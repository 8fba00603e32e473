"""Qwen2 / Llama decoder in Flax NNX.

The model knows nothing of meshes or jit: every parameter carries logical axis
names in its `logical_axes` metadata, and `streamrl.trainer.sharding` turns them
into shardings with rules taken from the config.

Shapes: b batch, t time, d hidden, h query heads, k kv heads, g = h // k,
n head_dim, f MLP width, v vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from streamrl.models.config import ModelConfig


def _param(rngs: nnx.Rngs, init, shape, axes, dtype=jnp.float32) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


_normal = jax.nn.initializers.normal(0.02)
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
    self.scale = _param(rngs, _ones, (dim,), ("norm",))
    self.eps = eps

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    x = x_btd.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(x_btd.dtype)


def rope(x_bthn: jax.Array, positions_bt: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the HF layout (halves rotated, not interleaved)."""
  n = x_bthn.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, n, 2, dtype=jnp.float32) / n))
  freqs_btn = positions_bt[..., None].astype(jnp.float32) * inv_freq
  cos = jnp.cos(freqs_btn)[:, :, None, :]
  sin = jnp.sin(freqs_btn)[:, :, None, :]
  x1, x2 = jnp.split(x_bthn.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_bthn.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, h, k, n = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    self.w_q_dhn = _param(rngs, _normal, (d, h, n), ("embed", "q_heads", "head_dim"))
    self.w_k_dkn = _param(rngs, _normal, (d, k, n), ("embed", "kv_heads", "head_dim"))
    self.w_v_dkn = _param(rngs, _normal, (d, k, n), ("embed", "kv_heads", "head_dim"))
    self.w_o_hnd = _param(rngs, _normal, (h, n, d), ("q_heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      self.b_q_hn = _param(rngs, _zeros, (h, n), ("q_heads", "head_dim"))
      self.b_k_kn = _param(rngs, _zeros, (k, n), ("kv_heads", "head_dim"))
      self.b_v_kn = _param(rngs, _zeros, (k, n), ("kv_heads", "head_dim"))

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array) -> jax.Array:
    cfg = self.cfg
    q = jnp.einsum("BTD,DHN->BTHN", x_btd, self.w_q_dhn[...])
    k = jnp.einsum("BTD,DKN->BTKN", x_btd, self.w_k_dkn[...])
    v = jnp.einsum("BTD,DKN->BTKN", x_btd, self.w_v_dkn[...])
    if cfg.qkv_bias:
      q, k, v = q + self.b_q_hn[...], k + self.b_k_kn[...], v + self.b_v_kn[...]
    q = rope(q, positions_bt, cfg.rope_theta)
    k = rope(k, positions_bt, cfg.rope_theta)
    b, t, h, n = q.shape
    g = h // cfg.num_kv_heads
    # Query head j uses kv head j // g, as in HF's repeat_kv.
    q_btkgn = q.reshape(b, t, cfg.num_kv_heads, g, n)
    logits = jnp.einsum("BTKGN,BSKN->BKGTS", q_btkgn, k).astype(jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(n))
    causal_ts = positions_bt[:, None, None, :, None] >= positions_bt[:, None, None, None, :]
    logits = jnp.where(causal_ts, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out_btkgn = jnp.einsum("BKGTS,BSKN->BTKGN", probs, v)
    out_bthn = out_btkgn.reshape(b, t, h, n)
    return jnp.einsum("BTHN,HND->BTD", out_bthn, self.w_o_hnd[...])


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.w_gate_df = _param(rngs, _normal, (d, f), ("embed", "mlp"))
    self.w_up_df = _param(rngs, _normal, (d, f), ("embed", "mlp"))
    self.w_down_fd = _param(rngs, _normal, (f, d), ("mlp", "embed"))

  def __call__(self, x_btd: jax.Array) -> jax.Array:
    gate = jax.nn.silu(x_btd @ self.w_gate_df[...])
    return (gate * (x_btd @ self.w_up_df[...])) @ self.w_down_fd[...]


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x_btd: jax.Array, positions_bt: jax.Array) -> jax.Array:
    x_btd = x_btd + self.attn(self.attn_norm(x_btd), positions_bt)
    return x_btd + self.mlp(self.mlp_norm(x_btd))


class Trunk(nnx.Module):
  """Embedding, decoder blocks and the final norm: hidden states out."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding_vd = _param(rngs, _normal, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)

  def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None):
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    x_btd = jnp.take(self.embedding_vd[...], tokens_bt, axis=0)
    for block in self.blocks:
      x_btd = block(x_btd, positions_bt)
    return self.final_norm(x_btd)


class Transformer(nnx.Module):
  """The policy: a trunk and a language-model head (tied or untied)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      self.w_head_dv = _param(rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

  def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None):
    """Returns float32 logits [b, t, v]."""
    h_btd = self.trunk(tokens_bt, positions_bt)
    if self.cfg.tie_embeddings:
      logits = jnp.einsum("BTD,VD->BTV", h_btd, self.trunk.embedding_vd[...])
    else:
      logits = h_btd @ self.w_head_dv[...]
    return logits.astype(jnp.float32)


class Critic(nnx.Module):
  """The value model: the policy's trunk with a scalar head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs=rngs)
    self.w_value_d = _param(rngs, _zeros, (cfg.hidden_size,), ("embed",))
    self.b_value = _param(rngs, _zeros, (), ())

  def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array | None = None):
    """Returns float32 values [b, t]."""
    h_btd = self.trunk(tokens_bt, positions_bt)
    values = h_btd @ self.w_value_d[...] + self.b_value[...]
    return values.astype(jnp.float32)


def token_logprobs(
    logits_btv: jax.Array, targets_bt: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
  """Log-probabilities of `targets_bt` and the entropy at each position.

  `temperature` divides the logits first, so the result is the distribution
  the generator actually sampled from.
  """
  logp_btv = jax.nn.log_softmax(logits_btv / temperature, axis=-1)
  logp_bt = jnp.take_along_axis(logp_btv, targets_bt[..., None], axis=-1)[..., 0]
  entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
  return logp_bt, entropy_bt


@nnx.jit(static_argnames=("temperature",))
def sequence_logprobs(
    model: Transformer, tokens_bt: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
  """Per-token logprobs of a right-padded token batch under `model`.

  Position t of the outputs scores token t + 1 given tokens [0, t]; the last
  column is padding (zero) so the outputs keep shape [b, t].
  """
  logits = model(tokens_bt)
  logp, ent = token_logprobs(logits[:, :-1], tokens_bt[:, 1:], temperature)
  pad = jnp.zeros_like(logp[:, :1])
  return jnp.concatenate([logp, pad], 1), jnp.concatenate([ent, pad], 1)
