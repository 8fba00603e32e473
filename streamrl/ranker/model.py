"""A small Flax NNX model that scores a prompt by its expected output length.

tokens -> embedding + learned positions -> a few pre-LN transformer blocks
(bidirectional, padding masked) -> [masked mean ; attention pooling ;
log(prompt length)] -> MLP -> one scalar per prompt.

The scalar is read as log1p(output length) when trained with the regression
loss; with the pairwise loss only its order is meaningful. The prompt length
is fed explicitly because mean pooling alone cannot count tokens, and output
length often scales with input length (copy, translate, summarise).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class _Block(nnx.Module):
  """Pre-LN transformer block: x + MHA(LN(x)); x + MLP(LN(x))."""

  def __init__(self, d_model: int, num_heads: int, mlp_dim: int, *, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=num_heads,
        in_features=d_model,
        decode=False,
        deterministic=True,
        keep_rngs=False,
        rngs=rngs,
    )
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.mlp_in = nnx.Linear(d_model, mlp_dim, rngs=rngs)
    self.mlp_out = nnx.Linear(mlp_dim, d_model, rngs=rngs)

  def __call__(self, x_btd: jax.Array, mask_b11t: jax.Array) -> jax.Array:
    x_btd = x_btd + self.attn(self.ln1(x_btd), mask=mask_b11t)
    return x_btd + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x_btd))))


class LengthRanker(nnx.Module):
  """Prompt tokens -> scalar length score.

  Args:
    vocab_size: the policy tokenizer's vocabulary size; ids must be < it.
    max_len: longest prompt (tokens) the position table covers.
    d_model, num_layers, num_heads, mlp_dim: size of the encoder.
  """

  def __init__(
      self,
      vocab_size: int,
      max_len: int,
      *,
      d_model: int = 64,
      num_layers: int = 2,
      num_heads: int = 4,
      mlp_dim: int = 128,
      rngs: nnx.Rngs,
  ):
    self.vocab_size = vocab_size
    self.max_len = max_len
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.pos = nnx.Embed(max_len, d_model, rngs=rngs)
    self.blocks = nnx.List(
        [_Block(d_model, num_heads, mlp_dim, rngs=rngs) for _ in range(num_layers)]
    )
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.pool_query = nnx.Linear(d_model, 1, rngs=rngs)
    self.head_in = nnx.Linear(2 * d_model + 1, mlp_dim, rngs=rngs)
    self.head_out = nnx.Linear(mlp_dim, 1, rngs=rngs)

  def __call__(self, tokens_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """Scores a padded batch.

    Args:
      tokens_bt: [B, T] int token ids (T <= max_len); padding ids are ignored.
      mask_bt: [B, T] bool, True on real prompt tokens.
    Returns:
      score_b: [B] float32.
    """
    t = tokens_bt.shape[1]
    x_btd = self.embed(tokens_bt) + self.pos(jnp.arange(t))[None]
    # Attend only to real tokens; a fully padded row (empty prompt) attends to
    # nothing and is handled by the safe pooling below.
    mask_b11t = mask_bt[:, None, None, :]
    for block in self.blocks:
      x_btd = block(x_btd, mask_b11t)
    x_btd = self.ln_f(x_btd)

    m_bt1 = mask_bt[..., None].astype(x_btd.dtype)
    n_b1 = jnp.sum(m_bt1, axis=1)
    mean_bd = jnp.sum(x_btd * m_bt1, axis=1) / jnp.maximum(n_b1, 1.0)
    logits_bt = jnp.where(mask_bt, self.pool_query(x_btd)[..., 0], -1e9)
    attn_bt = jax.nn.softmax(logits_bt, axis=-1) * mask_bt
    attn_bd = jnp.einsum("BT,BTD->BD", attn_bt, x_btd)
    feats = jnp.concatenate([mean_bd, attn_bd, jnp.log1p(n_b1)], axis=-1)
    return self.head_out(jax.nn.gelu(self.head_in(feats)))[:, 0]
