"""The train step: one pure, jitted update of actor (and critic) on a mini-batch.

Batches are dicts of [b, t] arrays aligned with `sequence_logprobs`: column t
describes the prediction of token t + 1.

  tokens_bt      int32   prompt + response, right-padded
  mask_bt        float32 1 where token t + 1 is a response token
  old_logp_bt    trainer logprobs before this iteration's updates
  gen_logp_bt    the generator's sampled-token logprobs
  ref_logp_bt    reference-model logprobs (zeros when there is no KL term)
  advantages_bt, returns_bt, old_values_bt

Precision (`ComputeConfig`, in `Models`): parameters and optimizer state are
fp32; every forward pass casts the weights to the compute dtype where they are
used, inside the jitted function, so gradients arrive (and add up over
micro-batches) in fp32. Log-probabilities are fp32, computed chunk by chunk
over time when `logprob_chunk` is set; decoder blocks are rematerialised
under `remat`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from streamrl import rl
from streamrl.models.config import ComputeConfig
from streamrl.models.transformer import next_token_logprobs
from streamrl.generator.config import Sampling
from streamrl.rl.config import Loss
from streamrl.trainer.config import Optimizer

# The run settings own these defaults; the step's configs take them from there.
_LOSS, _OPTIMIZER, _SAMPLING = Loss(), Optimizer(), Sampling()


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Loss options; static in the jitted step, so equal configs share its code.

  Attributes:
    agg: how token losses become one number (`rl.AGG_MODES`). Splitting a
      mini-batch into micro-batches gives the same loss and gradient in every
      mode (see `micro_batch_weights`).
    norm_constant: the fixed divisor of agg="token_sum_norm" (Dr. GRPO): the
      loss is sum of token losses / (rows · norm_constant). Use the
      maximum response length (sampling.max_tokens); it must be > 0 in
      that mode and is ignored in the others.
    rollout_correction: "none", "tis" or "mis": per-token weights for the
      trainer/generator mismatch (`rl.rollout_correction_weights`).
    is_cap: the cap of the "tis" weights.
    is_level: "token" or "sequence" weights for "tis".
    mis_threshold: "mis" keeps a sequence whose geometric-mean ratio
      trainer/generator lies in [1 / mis_threshold, mis_threshold].
    temperature: the generator's sampling temperature; the logits are
      divided by it, as in `policy_logprobs`.
  """

  clip_low: float = _LOSS.clip_low
  clip_high: float = _LOSS.clip_high
  dual_clip: float | None = None  # loss.dual_clip, with 0 (off) as None
  agg: str = _LOSS.agg
  norm_constant: float = 0.0
  entropy_coef: float = _LOSS.entropy_coef
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_loss: bool = False  # GRPO style; PPO puts the KL penalty in the reward
  vf_clip: float = _LOSS.vf_clip
  rollout_correction: str = "none"  # loss.rollout_correction with "auto" resolved
  is_cap: float = _LOSS.is_cap
  is_level: str = "token"
  mis_threshold: float = _LOSS.mis_threshold
  temperature: float = _SAMPLING.temperature

  def __post_init__(self):
    if self.agg not in rl.AGG_MODES:
      raise ValueError(
          f"Unknown loss aggregation {self.agg!r}; set loss.agg to " f"one of {list(rl.AGG_MODES)}."
      )
    if self.agg == "token_sum_norm" and not self.norm_constant > 0:
      raise ValueError(
          "agg='token_sum_norm' divides by a fixed norm_constant, got "
          f"{self.norm_constant}; set it to the maximum response length."
      )
    if self.rollout_correction not in rl.ROLLOUT_CORRECTIONS:
      raise ValueError(
          f"Unknown rollout correction {self.rollout_correction!r}; use "
          f"one of {list(rl.ROLLOUT_CORRECTIONS)}."
      )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """One optimizer (actor or critic); the run's values come from `optimizer.*`
  (streamrl/trainer/config.py), which also holds these defaults."""

  lr: float = _OPTIMIZER.lr
  warmup_steps: int = _OPTIMIZER.warmup_steps
  decay_steps: int = 1000
  min_lr_ratio: float = 0.1
  weight_decay: float = _OPTIMIZER.weight_decay
  grad_clip: float = _OPTIMIZER.grad_clip
  b1: float = 0.9
  b2: float = 0.95


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if cfg.warmup_steps else cfg.lr,
      peak_value=cfg.lr,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1),
      end_value=cfg.lr * cfg.min_lr_ratio,
  )
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
  )


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  actor: Any
  actor_opt: Any
  critic: Any = None
  critic_opt: Any = None


@dataclasses.dataclass(frozen=True)
class Models:
  """The static half of the train state: graph definitions, optimizer configs
  and how the forward passes run (`compute`: dtype, remat, logprob chunks).

  Every field compares and hashes by value (nnx GraphDefs and frozen
  configs), so two trainers with equal models and configs share the
  compiled `update_step`.
  """

  actor_def: nnx.GraphDef
  actor_optim: OptimConfig
  critic_def: nnx.GraphDef | None = None
  critic_optim: OptimConfig | None = None
  compute: ComputeConfig = ComputeConfig()


def init_state(
    actor: nnx.Module,
    actor_optim: OptimConfig,
    critic: nnx.Module | None = None,
    critic_optim: OptimConfig | None = None,
    compute: ComputeConfig = ComputeConfig(),
) -> tuple[Models, TrainState]:
  """Splits the models into (static Models, TrainState with fresh optimizer state).

  The parameters stay in the dtype they come in (fp32 master weights);
  `compute` says how the step's forward passes run.
  """
  actor_def, actor_params = nnx.split(actor, nnx.Param)
  models = Models(actor_def, actor_optim, compute=compute)
  state = TrainState(
      step=jnp.zeros((), jnp.int32),
      actor=actor_params,
      actor_opt=jax.jit(make_optimizer(actor_optim).init)(actor_params),
  )
  if critic is not None:
    if critic_optim is None:
      raise ValueError("init_state got a critic but no critic_optim; pass its OptimConfig.")
    critic_def, critic_params = nnx.split(critic, nnx.Param)
    models = dataclasses.replace(models, critic_def=critic_def, critic_optim=critic_optim)
    state = state.replace(
        critic=critic_params, critic_opt=jax.jit(make_optimizer(critic_optim).init)(critic_params)
    )
  return models, state


def _actor_loss(params, graphdef, batch, cfg: LossConfig, compute: ComputeConfig):
  model = nnx.merge(graphdef, params)
  logp, entropy = next_token_logprobs(model, batch["tokens_bt"], cfg.temperature, compute)
  logp, entropy = logp[:, :-1], entropy[:, :-1]
  mask = batch["mask_bt"][:, :-1]
  old_logp = batch["old_logp_bt"][:, :-1]
  is_w = rl.rollout_correction_weights(
      old_logp,
      batch["gen_logp_bt"][:, :-1],
      mask,
      cfg.rollout_correction,
      is_cap=cfg.is_cap,
      mis_threshold=cfg.mis_threshold,
      level=cfg.is_level,
  )
  agg = dict(agg=cfg.agg, norm_constant=cfg.norm_constant)
  loss, metrics = rl.ppo_policy_loss(
      logp,
      old_logp,
      batch["advantages_bt"][:, :-1],
      mask,
      clip_low=cfg.clip_low,
      clip_high=cfg.clip_high,
      dual_clip=cfg.dual_clip,
      is_weights_bt=is_w,
      **agg,
  )
  ent = rl.aggregate(entropy, mask, mode=cfg.agg, norm_constant=cfg.norm_constant)
  loss = loss - cfg.entropy_coef * ent
  metrics["entropy"] = ent
  if cfg.kl_in_loss and cfg.kl_coef:
    kl, _ = rl.kl_loss(logp, batch["ref_logp_bt"][:, :-1], mask, estimator=cfg.kl_estimator, **agg)
    loss = loss + cfg.kl_coef * kl
    metrics["kl_loss"] = kl
  return loss, metrics


def _critic_loss(params, graphdef, batch, cfg: LossConfig, compute: ComputeConfig):
  model = nnx.merge(graphdef, params)
  values = model(batch["tokens_bt"], compute=compute)[:, :-1]
  return rl.value_loss(
      values,
      batch["old_values_bt"][:, :-1],
      batch["returns_bt"][:, :-1],
      batch["mask_bt"][:, :-1],
      clip=cfg.vf_clip,
      agg=cfg.agg,
      norm_constant=cfg.norm_constant,
  )


def micro_batch_weights(mask_bt: jax.Array, num_micro: int, agg: str) -> jax.Array:
  """Weights w_k with sum_k w_k · aggregate(micro-batch k) = aggregate(batch).

  Every mode divides a sum over tokens by a count that adds up over
  micro-batches, so w_k is micro-batch k's share of that count: valid tokens
  (token_mean), sequences with at least one valid token (seq_mean_*) or rows
  (token_sum_norm, whose per-row constant is fixed). The weights depend on
  the mask only, so the weighted gradients add up to the full-batch gradient
  too. The weights sum to 1, or are all 0 when a count is 0 everywhere.

  Args:
    mask_bt: [b, t] the loss mask; b divisible by num_micro.
    num_micro: micro-batches, consecutive blocks of b / num_micro rows.
    agg: one of `rl.AGG_MODES` (static).
  Returns:
    [num_micro] weights.
  """
  m = (jnp.asarray(mask_bt) != 0).astype(jnp.float32)
  m = m.reshape((num_micro, -1) + m.shape[1:])
  if agg == "token_mean":
    count_k = m.sum((1, 2))
  elif agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
    count_k = (m.sum(2) > 0).sum(1).astype(jnp.float32)
  elif agg == "token_sum_norm":
    count_k = jnp.full((num_micro,), m.shape[1], jnp.float32)
  else:
    raise ValueError(f"Unknown loss aggregation {agg!r}; use one of {list(rl.AGG_MODES)}.")
  return count_k / jnp.maximum(count_k.sum(), 1.0)


def combine_micro_metrics(metrics: dict, weights_k: jax.Array) -> dict:
  """[num_micro] metrics -> scalars: the max for "*_max" keys, else sum_k w_k · x_k."""
  return {k: v.max() if k.endswith("_max") else jnp.sum(weights_k * v) for k, v in metrics.items()}


def _weighted_grad(loss_fn, graphdef, cfg, compute):
  """(params, micro-batch, weight) -> ((weight * loss, metrics), gradient)."""

  def weighted_loss(p, mb, w):
    loss, metrics = loss_fn(p, graphdef, mb, cfg, compute)
    return w * loss, metrics

  return jax.value_and_grad(weighted_loss, has_aux=True)


def _optimizer_step(state: TrainState, grads: dict, models: Models) -> tuple[TrainState, dict]:
  """AdamW on {"actor": grads[, "critic": grads]}; returns the new state and
  the gradient norms."""
  actor_tx = make_optimizer(models.actor_optim)
  updates, actor_opt = actor_tx.update(grads["actor"], state.actor_opt, state.actor)
  state = state.replace(
      step=state.step + 1, actor=optax.apply_updates(state.actor, updates), actor_opt=actor_opt
  )
  norms = {"actor_grad_norm": optax.global_norm(grads["actor"])}
  if "critic" in grads:
    critic_tx = make_optimizer(models.critic_optim)
    updates, critic_opt = critic_tx.update(grads["critic"], state.critic_opt, state.critic)
    state = state.replace(critic=optax.apply_updates(state.critic, updates), critic_opt=critic_opt)
    norms["critic_grad_norm"] = optax.global_norm(grads["critic"])
  return state, norms


def _accumulate(loss_fn, params, graphdef, batch, num_micro, cfg, compute):
  """Loss and gradient of a mini-batch, summed over micro-batches with lax.scan.

  Micro-batch k's loss is scaled by `micro_batch_weights`, so the result equals
  the full-batch loss and gradient in every aggregation mode.
  """
  micro = jax.tree.map(lambda x: x.reshape((num_micro, -1) + x.shape[1:]), batch)
  weights_k = micro_batch_weights(batch["mask_bt"][:, :-1], num_micro, cfg.agg)
  grad_fn = _weighted_grad(loss_fn, graphdef, cfg, compute)

  def body(carry, xs):
    grads, loss_sum = carry
    (loss, metrics), g = grad_fn(params, *xs)
    return (jax.tree.map(jnp.add, grads, g), loss_sum + loss), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), metrics = jax.lax.scan(body, (zeros, jnp.zeros(())), (micro, weights_k))
  return loss, grads, combine_micro_metrics(metrics, weights_k)


@functools.partial(jax.jit, static_argnames=("models", "cfg", "num_micro"), donate_argnums=(0,))
def update_step(
    state: TrainState, batch: dict, *, models: Models, cfg: LossConfig, num_micro: int = 1
) -> tuple[TrainState, dict]:
  """One optimizer step of the actor (and critic) on one mini-batch."""
  loss, grads, metrics = _accumulate(
      _actor_loss, state.actor, models.actor_def, batch, num_micro, cfg, models.compute
  )
  grads, metrics = {"actor": grads}, dict(metrics, actor_loss=loss)
  if models.critic_def is not None:
    vloss, vgrads, vmetrics = _accumulate(
        _critic_loss, state.critic, models.critic_def, batch, num_micro, cfg, models.compute
    )
    grads["critic"] = vgrads
    metrics.update(vmetrics, critic_loss=vloss)
  state, norms = _optimizer_step(state, grads, models)
  return state, dict(metrics, **norms)


# ---------------------------------------------------- ragged micro-batches
# A long-tailed batch padded to its longest row is mostly padding. The
# trainer can instead pad each micro-batch of a length-sorted mini-batch to
# its own length: `micro_grads` runs once per micro-batch (one compile per
# distinct length bucket) and `apply_grads` takes the optimizer step on their
# sum, with the same weights as `update_step`'s scan, so the step is the same.


@functools.partial(jax.jit, static_argnames=("models", "cfg"))
def micro_grads(
    state: TrainState, micro: dict, weight: jax.Array, *, models: Models, cfg: LossConfig
):
  """Weighted loss, gradient and metrics of one micro-batch, for the actor
  and (when there is one) the critic: ({"actor": grads[, "critic": grads]},
  {"actor": loss[, "critic": loss]}, metrics)."""

  grad_fn = functools.partial(_weighted_grad, cfg=cfg, compute=models.compute)
  (loss, metrics), grads = grad_fn(_actor_loss, models.actor_def)(state.actor, micro, weight)
  grads, losses = {"actor": grads}, {"actor": loss}
  if models.critic_def is not None:
    (vloss, vmetrics), vgrads = grad_fn(_critic_loss, models.critic_def)(
        state.critic, micro, weight
    )
    grads["critic"], losses["critic"] = vgrads, vloss
    metrics = dict(metrics, **vmetrics)
  return grads, losses, metrics


# The optimizer step of `update_step` on gradients accumulated outside it.
apply_grads = jax.jit(_optimizer_step, static_argnames=("models",), donate_argnums=(0,))


def ragged_update(
    state: TrainState, micros: list[dict], weights_k, *, models: Models, cfg: LossConfig
) -> tuple[TrainState, dict]:
  """`update_step` on micro-batches of different lengths (`weights_k` from
  `micro_batch_weights` of the whole mini-batch's mask)."""
  grads = losses = None
  metrics = []
  for micro, w in zip(micros, weights_k):
    g, l, m = micro_grads(state, micro, w, models=models, cfg=cfg)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    losses = l if losses is None else jax.tree.map(jnp.add, losses, l)
    metrics.append(m)
  state, norms = apply_grads(state, grads, models=models)
  stacked = {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}
  out = combine_micro_metrics(stacked, jnp.asarray(weights_k))
  out.update(norms, actor_loss=losses["actor"])
  if "critic" in losses:
    out["critic_loss"] = losses["critic"]
  return state, out


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "compute"))
def policy_logprobs(
    params, tokens_bt, *, graphdef, temperature: float = 1.0, compute=ComputeConfig()
):
  """[b, t] logprobs (column t scores token t + 1; last column 0) and entropies.

  fp32, chunked over time as the loss is (`compute.logprob_chunk`), so
  scoring never holds [b, t, v] logits either.
  """
  return next_token_logprobs(nnx.merge(graphdef, params), tokens_bt, temperature, compute)


@functools.partial(jax.jit, static_argnames=("graphdef", "compute"))
def critic_values(params, tokens_bt, *, graphdef, compute=ComputeConfig()):
  """The model's output on tokens_bt: [b, t] values for a Critic."""
  return nnx.merge(graphdef, params)(tokens_bt, compute=compute)
