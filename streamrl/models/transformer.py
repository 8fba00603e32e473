"""Qwen2 / Qwen3 / Llama / Mistral decoder in Flax NNX.

The model knows nothing of meshes or jit: every parameter carries logical axis
names in its `logical_axes` metadata, and `streamrl.trainer.sharding` turns them
into shardings with rules taken from the config.

Precision: parameters are stored as given (fp32 master weights in the trainer)
and each module casts a weight to its input's dtype where it uses it, so the
activations' dtype -- set once, at the embedding, from `ComputeConfig.dtype`
-- is the compute dtype. RMSNorm, RoPE and the attention softmax run in fp32
whatever it is; logits and log-probabilities are always fp32, and with
`fp32_lm_head` the last norm and the head's matmul are fp32 too.
`read_dtype_cast` stores a frozen copy in exactly the dtypes the forward pass
reads, which halves it under bf16 compute without changing any result.

LoRA: the trunk takes an optional adapter per layer (`project`), applied
beside each frozen weight rather than merged into it, so a LoRA step never
holds a merged weight or a weight-sized gradient (streamrl/models/lora.py).

Shapes: b batch, t time, d hidden, h query heads, k kv heads, g = h // k,
n head_dim, f MLP width, v vocab, r adapter rank.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from streamrl.models.config import ComputeConfig, ModelConfig, RopeScaling

_F32 = jnp.float32
_DEFAULT_COMPUTE = ComputeConfig()
# Names of the block's intermediates that remat "minimal" keeps (`checkpoint_name`).
_SAVED_NAMES = ("q_proj", "k_proj", "v_proj", "attn_out", "mlp_hidden")
# jax.checkpoint policies of `ComputeConfig.remat` (None: save only the inputs).
# "dots" keeps matmuls without batch dimensions -- the weight projections --
# and so recomputes the [b, heads, t, t] attention scores, the biggest tensors.
# "minimal" keeps the named projections and the attention output: the backward
# pass recomputes only the norms, RoPE, elementwise ops and the attention core.
_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*_SAVED_NAMES),
}


# A layer's adapters: projection name (q, k, v, o, gate, up, down) -> {"a": [in, r],
# "b": [r, out]} with the scale folded into b (`lora.by_layer`).
LayerAdapters = Mapping[str, Mapping[str, jax.Array]]


def project(
    spec: str, x: jax.Array, w: jax.Array, adapter: Mapping[str, jax.Array] | None = None
) -> jax.Array:
  """`einsum(spec, x, w)` in x's dtype, plus an unmerged LoRA term (x @ a) @ b.

  Args:
    spec: the einsum of the projection; x's leading two dims are batch and time.
    x: [b, t, ...] activations; w: the stored weight, cast to x's dtype here.
    adapter: None, or {"a": [in, r], "b": [r, out]} (scale folded into b) with
      `in` x's trailing dims and `out` the result's trailing dims, each
      flattened in order (the HF layout's flattening, streamrl/models/lora.py).
  Returns:
    x w + (x a) b, the result of the merged weight w + a b up to rounding; the
    low-rank term is [b, t, r] in between, so no weight-sized array is formed
    forward or backward.
  """
  dt = x.dtype
  y = matmul(spec, x, w)
  if adapter is None:
    return y
  low_btr = x.reshape(x.shape[:2] + (-1,)) @ adapter["a"].astype(dt)
  return y + (low_btr @ adapter["b"].astype(dt)).reshape(y.shape)


def _tie(w: jax.Array, dy: jax.Array) -> jax.Array:
  """`w`, computable only once `dy` exists: XLA cannot hoist or share a cast of
  it with the forward pass's (it keeps a float multiply by zero, and its CPU
  compiler drops optimization barriers)."""
  return w + (dy.reshape(-1)[0] * 0).astype(w.dtype)


def _einsum_specs(spec: str) -> tuple[str, str, str]:
  ins, y = spec.split("->")
  x, w = ins.split(",")
  return x, w, y


def _weight_dot(xs: str, x: jax.Array, ws: str, w: jax.Array, ys: str) -> jax.Array:
  """einsum(f"{xs},{ws}->{ys}", x, w) as one fp32-summed dot, the weight on the
  side where XLA's CPU dot reads it as it lies: the left operand when its
  contracted dimensions are its last ones, else the right (the other way
  round it would copy every weight transposed, and keep the copies)."""
  contract = [c for c in ws if c in xs and c not in ys]
  batch = [c for c in ws if c in xs and c in ys]
  w_left = ws.endswith("".join(contract))
  (ls, lhs), (rs, rhs) = ((ws, w), (xs, x)) if w_left else ((xs, x), (ws, w))
  index = lambda spec, names: tuple(spec.index(c) for c in names)
  dims = ((index(ls, contract), index(rs, contract)), (index(ls, batch), index(rs, batch)))
  y = jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=_F32)
  free = lambda spec: [c for c in spec if c not in contract and c not in batch]
  order = batch + free(ls) + free(rs)
  return jnp.transpose(y, [order.index(c) for c in ys])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def matmul(spec: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """`einsum(spec, x, w)` on a weight: bf16 operands, fp32 sums, no weight-sized copies.

  The weight is cast to x's dtype and the products accumulate in fp32, in
  the forward and the backward pass alike. Written as a plain einsum, a bf16
  dot with a bf16 result runs on XLA's CPU backend as an fp32 dot of fp32
  copies of its operands, and autodiff keeps the weight's copy from the
  forward pass to the backward pass: an fp32 copy of every weight at once.
  Here the backward pass reads the stored weight again (cast again when its
  dtype is not x's) and keeps only x; each dot takes the weight in its
  stored layout (`_weight_dot`).

  Args:
    spec: a two-operand einsum "X,W->Y" (x first) without repeated indices.
    x: activations; w: the stored weight (any float dtype), read in x's dtype.
    out_dtype: the result's dtype (default x's).
  Returns:
    the einsum, in `out_dtype`; gradients for x in x's dtype and for w in w's.
  """
  xs, ws, ys = _einsum_specs(spec)
  y = _weight_dot(xs, x, ws, w.astype(x.dtype), ys)
  return y.astype(out_dtype or x.dtype)


def _matmul_fwd(spec, x, w, out_dtype):
  return matmul(spec, x, w, out_dtype), (x, w)


def _matmul_bwd(spec, out_dtype, res, dy):
  del out_dtype
  x, w_stored = res
  xs, ws, ys = _einsum_specs(spec)
  dt = x.dtype
  w = w_stored if w_stored.dtype == dt else _tie(w_stored, dy)
  w, dy = w.astype(dt), dy.astype(dt)
  dx = _weight_dot(ys, dy, ws, w, xs).astype(dt)
  dw = jnp.einsum(f"{xs},{ys}->{ws}", x, dy, preferred_element_type=_F32)
  return dx, dw.astype(w_stored.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _param(rngs: nnx.Rngs, init, shape, axes, dtype=jnp.float32) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


_normal = jax.nn.initializers.normal(0.02)
_zeros = jax.nn.initializers.zeros
_ones = jax.nn.initializers.ones
# The parameters that do not start random (by name); every other one is normal(0.02).
_NOT_RANDOM = {
    "scale": _ones,
    "b_q_hn": _zeros,
    "b_k_kn": _zeros,
    "b_v_kn": _zeros,
    "w_value_d": _zeros,
    "b_value": _zeros,
}


def initializer(name: str):
  """The initializer of the parameter called `name`, as the constructors use it
  (for `sharding.random_init`, which makes each parameter on its own)."""
  return _NOT_RANDOM.get(name, _normal)


def embed(table_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
  """Rows `tokens_bt` of the table [v, d], in its stored dtype (only [b, t, d]
  is converted afterwards). A 16-bit table is gathered as integers: XLA's CPU
  backend gathers 16-bit floats through an fp32 copy of the whole table
  (inside a loop over micro-batches made once and kept for the loop). Its
  gradient is the usual scatter-add, formed only when the table is trained."""
  if table_vd.dtype.itemsize != 2:
    return jnp.take(table_vd, tokens_bt, axis=0)
  return _take_16bit(table_vd, tokens_bt)


@jax.custom_vjp
def _take_16bit(table_vd: jax.Array, tokens_bt: jax.Array) -> jax.Array:
  bits = jax.lax.bitcast_convert_type(table_vd, jnp.uint16)
  return jax.lax.bitcast_convert_type(jnp.take(bits, tokens_bt, axis=0), table_vd.dtype)


def _take_16bit_fwd(table_vd, tokens_bt):
  return _take_16bit(table_vd, tokens_bt), (table_vd, tokens_bt)


def _take_16bit_bwd(res, dx_btd):
  table_vd, tokens_bt = res
  grad = jnp.zeros(table_vd.shape, _F32).at[tokens_bt].add(dx_btd.astype(_F32))
  return grad.astype(table_vd.dtype), None


_take_16bit.defvjp(_take_16bit_fwd, _take_16bit_bwd)


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, *, rngs: nnx.Rngs):
    self.scale = _param(rngs, _ones, (dim,), ("norm",))
    self.eps = eps

  def __call__(self, x_btd: jax.Array, out_dtype=None) -> jax.Array:
    """Normalises in fp32; returns `out_dtype` (default: the input's dtype)."""
    x = x_btd.astype(_F32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...].astype(_F32)).astype(out_dtype or x_btd.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> jax.Array:
  """RoPE's inverse frequencies [head_dim // 2] (fp32), scaled as HF does.

  Default: theta^(-2i / head_dim). "linear" divides them all by the factor.
  "llama3" (transformers' `_compute_llama3_parameters`, in the same fp32 op
  order) works on wavelengths w = 2 pi / f against the pre-training context
  L = original_max_position_embeddings: w < L / high_freq_factor keeps f,
  w > L / low_freq_factor gives f / factor, and in between
  f * ((1 - s) / factor + s) with s = (L / w - low) / (high - low).
  """
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=_F32) / head_dim))
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return inv_freq / scaling.factor
  factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
  context = scaling.original_max_position_embeddings
  low_freq_wavelen, high_freq_wavelen = context / low, context / high
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (context / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return jnp.where(medium, smoothed, scaled)


def rope(
    x_bthn: jax.Array,
    positions_bt: jax.Array,
    theta: float,
    scaling: RopeScaling | None = None,
) -> jax.Array:
  """Rotary embedding in the HF layout (halves rotated, not interleaved)."""
  inv_freq = rope_inv_freq(x_bthn.shape[-1], theta, scaling)
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
    if cfg.qk_norm:  # Qwen3: one [n] scale shared by all heads, for q and for k
      self.q_norm = RMSNorm(n, cfg.rms_norm_eps, rngs=rngs)
      self.k_norm = RMSNorm(n, cfg.rms_norm_eps, rngs=rngs)

  def __call__(
      self,
      x_btd: jax.Array,
      positions_bt: jax.Array | None = None,
      attention: str = "fused",
      adapters: LayerAdapters | None = None,
  ) -> jax.Array:
    """Causal self-attention; `positions_bt` None means 0, 1, ..., t - 1 in every row;
    `adapters` (q, k, v, o) as `project` takes them."""
    cfg, dt = self.cfg, x_btd.dtype
    ad = adapters or {}
    q = project("BTD,DHN->BTHN", x_btd, self.w_q_dhn[...], ad.get("q"))
    k = project("BTD,DKN->BTKN", x_btd, self.w_k_dkn[...], ad.get("k"))
    v = project("BTD,DKN->BTKN", x_btd, self.w_v_dkn[...], ad.get("v"))
    if cfg.qkv_bias:
      q = q + self.b_q_hn[...].astype(dt)
      k = k + self.b_k_kn[...].astype(dt)
      v = v + self.b_v_kn[...].astype(dt)
    q, k, v = (
        checkpoint_name(q, "q_proj"),
        checkpoint_name(k, "k_proj"),
        checkpoint_name(v, "v_proj"),
    )
    if cfg.qk_norm:  # over head_dim, after the projection and before RoPE, as HF's Qwen3
      q = self.q_norm(q)
      k = self.k_norm(k)
    default_positions = positions_bt is None
    if default_positions:
      positions_bt = jnp.broadcast_to(jnp.arange(x_btd.shape[1]), x_btd.shape[:2])
    q = rope(q, positions_bt, cfg.rope_theta, cfg.rope_scaling)
    k = rope(k, positions_bt, cfg.rope_theta, cfg.rope_scaling)
    if attention == "fused" and default_positions:
      out_bthn = fused_attention(q, k, v)
    else:
      out_bthn = reference_attention(q, k, v, positions_bt)
    out_bthn = checkpoint_name(out_bthn, "attn_out")
    return project("BTHN,HND->BTD", out_bthn, self.w_o_hnd[...], ad.get("o"))


def fused_attention(q_bthn: jax.Array, k_btkn: jax.Array, v_btkn: jax.Array) -> jax.Array:
  """Causal attention through `jax.nn.dot_product_attention`: grouped kv heads
  natively, cuDNN's fused kernel on GPUs where it applies, XLA elsewhere.
  Scores accumulate and the softmax runs in fp32, as in `reference_attention`."""
  return jax.nn.dot_product_attention(q_bthn, k_btkn, v_btkn, is_causal=True)


def reference_attention(
    q_bthn: jax.Array, k_btkn: jax.Array, v_btkn: jax.Array, positions_bt: jax.Array
) -> jax.Array:
  """Attention spelled out: fp32 [b, k, g, t, s] scores masked by positions
  (query at position p sees keys at positions <= p), softmax, weighted sum."""
  b, t, h, n = q_bthn.shape
  kv_heads = k_btkn.shape[2]
  g = h // kv_heads
  # Query head j uses kv head j // g, as in HF's repeat_kv.
  q_btkgn = q_bthn.reshape(b, t, kv_heads, g, n)
  logits = jnp.einsum("BTKGN,BSKN->BKGTS", q_btkgn, k_btkn, preferred_element_type=_F32)
  logits = logits / jnp.sqrt(jnp.float32(n))
  causal_ts = positions_bt[:, None, None, :, None] >= positions_bt[:, None, None, None, :]
  logits = jnp.where(causal_ts, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v_btkn.dtype)
  out_btkgn = jnp.einsum("BKGTS,BSKN->BTKGN", probs, v_btkn)
  return out_btkgn.reshape(b, t, h, n)


class MLP(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.hidden_size, cfg.intermediate_size
    self.w_gate_df = _param(rngs, _normal, (d, f), ("embed", "mlp"))
    self.w_up_df = _param(rngs, _normal, (d, f), ("embed", "mlp"))
    self.w_down_fd = _param(rngs, _normal, (f, d), ("mlp", "embed"))

  def __call__(self, x_btd: jax.Array, adapters: LayerAdapters | None = None) -> jax.Array:
    """SwiGLU; `adapters` (gate, up, down) as `project` takes them."""
    ad = adapters or {}
    gate = jax.nn.silu(project("BTD,DF->BTF", x_btd, self.w_gate_df[...], ad.get("gate")))
    up = project("BTD,DF->BTF", x_btd, self.w_up_df[...], ad.get("up"))
    hidden = checkpoint_name(gate * up, "mlp_hidden")
    return project("BTF,FD->BTD", hidden, self.w_down_fd[...], ad.get("down"))


class Block(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(
      self,
      x_btd: jax.Array,
      positions_bt: jax.Array | None,
      attention: str = "fused",
      adapters: LayerAdapters | None = None,
  ) -> jax.Array:
    x_btd = x_btd + self.attn(self.attn_norm(x_btd), positions_bt, attention, adapters)
    return x_btd + self.mlp(self.mlp_norm(x_btd), adapters)


class Trunk(nnx.Module):
  """Embedding, decoder blocks and the final norm: hidden states out."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding_vd = _param(rngs, _normal, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs=rngs)

  def __call__(
      self,
      tokens_bt: jax.Array,
      positions_bt: jax.Array | None = None,
      compute: ComputeConfig = _DEFAULT_COMPUTE,
      adapters: Sequence[LayerAdapters] | None = None,
  ) -> jax.Array:
    """Hidden states [b, t, d] after the final norm, in `compute.head_dtype`;
    `adapters`: one layer's LoRA adapters per block (`project`), or None."""
    x_btd = embed(self.embedding_vd[...], tokens_bt).astype(compute.dtype)
    call = lambda block, x, pos, ad: block(x, pos, compute.attention, ad)
    if compute.remat == "none":
      run = call
    else:
      run = nnx.remat(call, policy=_REMAT_POLICIES[compute.remat])
    for i, block in enumerate(self.blocks):
      x_btd = run(block, x_btd, positions_bt, adapters[i] if adapters else None)
    return self.final_norm(x_btd, out_dtype=compute.head_dtype)


class Transformer(nnx.Module):
  """The policy: a trunk and a language-model head (tied or untied)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs=rngs)
    if not cfg.tie_embeddings:
      self.w_head_dv = _param(rngs, _normal, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

  @property
  def head_weight(self) -> jax.Array:
    """The LM head as stored: [v, d] when tied (the embedding), else [d, v]."""
    if self.cfg.tie_embeddings:
      return self.trunk.embedding_vd[...]
    return self.w_head_dv[...]

  def __call__(
      self,
      tokens_bt: jax.Array,
      positions_bt: jax.Array | None = None,
      compute: ComputeConfig = _DEFAULT_COMPUTE,
      adapters: Sequence[LayerAdapters] | None = None,
  ) -> jax.Array:
    """Returns float32 logits [b, t, v] (all of them: see `next_token_logprobs`)."""
    h_btd = self.trunk(tokens_bt, positions_bt, compute, adapters)
    return head_logits(h_btd, self.head_weight, self.cfg.tie_embeddings)


class Critic(nnx.Module):
  """The value model: the policy's trunk with a scalar head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.trunk = Trunk(cfg, rngs=rngs)
    self.w_value_d = _param(rngs, _zeros, (cfg.hidden_size,), ("embed",))
    self.b_value = _param(rngs, _zeros, (), ())

  def __call__(
      self,
      tokens_bt: jax.Array,
      positions_bt: jax.Array | None = None,
      compute: ComputeConfig = _DEFAULT_COMPUTE,
  ) -> jax.Array:
    """Returns float32 values [b, t]; the value head always runs in fp32."""
    h_btd = self.trunk(tokens_bt, positions_bt, compute).astype(_F32)
    return h_btd @ self.w_value_d[...].astype(_F32) + self.b_value[...].astype(_F32)


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


def head_logits(h_btd: jax.Array, w_head: jax.Array, tied: bool) -> jax.Array:
  """fp32 logits [b, t, v] of hidden states under the LM head.

  The head is read in the hidden states' dtype (`ComputeConfig.head_dtype`)
  and the matmul accumulates into fp32, so bf16 logits are never rounded.

  Args:
    h_btd: final-norm output.
    w_head: `Transformer.head_weight` as stored: [v, d] if `tied`, else [d, v].
    tied: whether `w_head` is the embedding.
  """
  spec = "BTD,VD->BTV" if tied else "BTD,DV->BTV"
  return matmul(spec, h_btd, w_head, _F32)


def chunked_token_logprobs(
    h_btd: jax.Array,
    w_head: jax.Array,
    targets_bt: jax.Array,
    *,
    tied: bool,
    temperature: float = 1.0,
    chunk: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """`token_logprobs` of `head_logits(h_btd, ...)`, `chunk` positions at a time.

  A lax.scan over time chunks whose body is rematerialised: only one chunk's
  [b, chunk, v] fp32 logits exist at a time, in the forward pass and in the
  backward pass (which recomputes them from the chunk's hidden states). The
  head enters each chunk as stored and is cast there, so its gradient adds
  up over chunks in the stored dtype (fp32), not the compute dtype. The
  results equal the unchunked ones.

  Args:
    h_btd: [b, t, d] final-norm output; w_head and tied: as `head_logits`.
    targets_bt: [b, t] int, the token scored at each position.
    temperature: divides the logits first (the sampling distribution).
    chunk: positions per chunk; 0 or >= t: in one piece, without remat.
  Returns:
    logp_bt, entropy_bt: [b, t] fp32.
  """

  def score(w, h, targets):
    logits = head_logits(h, w, tied)
    return token_logprobs(logits, targets, temperature)

  b, t = targets_bt.shape
  if not chunk or chunk >= t:
    return score(w_head, h_btd, targets_bt)
  n = -(-t // chunk)
  pad = n * chunk - t
  # [n, b, chunk, ...]: the scan runs over the leading axis.
  h_nbcd = jnp.pad(h_btd, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, -1).swapaxes(0, 1)
  targets_nbc = jnp.pad(targets_bt, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)
  score = jax.checkpoint(score, prevent_cse=False)  # inside a scan: CSE can't undo it

  def body(_, xs):
    return None, score(w_head, *xs)

  _, (logp_nbc, ent_nbc) = jax.lax.scan(body, None, (h_nbcd, targets_nbc))
  unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
  return unchunk(logp_nbc), unchunk(ent_nbc)


def next_token_logprobs(
    model: Transformer,
    tokens_bt: jax.Array,
    temperature: float = 1.0,
    compute: ComputeConfig = _DEFAULT_COMPUTE,
    adapters: Sequence[LayerAdapters] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Per-token logprobs and entropies [b, t] of a right-padded token batch.

  Position t scores token t + 1 given tokens [0, t]; the last column is
  padding (zero) so the outputs keep shape [b, t]. Chunked over time by
  `compute.logprob_chunk` (no full [b, t, v] logits), always fp32.
  `adapters`: LoRA adapters by layer (`Trunk`), applied unmerged.
  """
  h_btd = model.trunk(tokens_bt, None, compute, adapters)
  targets_bt = jnp.concatenate([tokens_bt[:, 1:], jnp.zeros_like(tokens_bt[:, :1])], 1)
  logp, ent = chunked_token_logprobs(
      h_btd,
      model.head_weight,
      targets_bt,
      tied=model.cfg.tie_embeddings,
      temperature=temperature,
      chunk=compute.logprob_chunk,
  )
  last = jnp.arange(tokens_bt.shape[1]) == tokens_bt.shape[1] - 1
  return jnp.where(last, 0.0, logp), jnp.where(last, 0.0, ent)


@nnx.jit(static_argnames=("temperature", "compute"))
def sequence_logprobs(
    model: Transformer,
    tokens_bt: jax.Array,
    temperature: float = 1.0,
    compute: ComputeConfig = _DEFAULT_COMPUTE,
) -> tuple[jax.Array, jax.Array]:
  """`next_token_logprobs`, jitted."""
  return next_token_logprobs(model, tokens_bt, temperature, compute)


def read_dtype_cast(params, cfg: ModelConfig, compute: ComputeConfig):
  """`params` (a Transformer's or Critic's nnx.State) in the dtypes the forward
  pass reads them in under `compute`.

  A frozen copy stored this way gives bit-for-bit the results of the fp32
  original (every module casts a weight to that dtype before use anyway) in
  half the bytes under bf16 compute. fp32 stay: the norm scales, the value
  head, and the LM head (the embedding, when tied) under `fp32_lm_head`.
  Under fp32 compute nothing changes. Returns new arrays (never aliases
  `params`, which a donating step may free), each keeping its sharding.
  """

  def dtype_of(path) -> str:
    name = next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))
    if name in ("scale", "w_value_d", "b_value"):
      return "float32"
    if name == "w_head_dv" or (name == "embedding_vd" and cfg.tie_embeddings):
      return compute.head_dtype
    return compute.dtype

  copy = lambda p, x: jnp.array(x, dtype=dtype_of(p), copy=True)
  return jax.tree_util.tree_map_with_path(copy, params)
