"""The train step: one pure, jitted update of actor (and critic) on a mini-batch.

Batches are dicts of [b, t] arrays aligned with `sequence_logprobs`: column t
describes the prediction of token t + 1.

  tokens_bt      int32   prompt + response, right-padded
  mask_bt        float32 1 where token t + 1 is a response token
  old_logp_bt    trainer logprobs before this iteration's updates
  gen_logp_bt    the generator's sampled-token logprobs
  ref_logp_bt    reference-model logprobs (zeros when there is no KL term)
  advantages_bt, returns_bt, old_values_bt
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
from streamrl.models.transformer import token_logprobs


@dataclasses.dataclass(frozen=True)
class LossConfig:
  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float | None = None
  agg: str = "token_mean"
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  kl_in_loss: bool = False  # GRPO style; PPO puts the KL penalty in the reward
  vf_clip: float = 0.2
  is_cap: float = 2.0       # truncated IS weights generator -> trainer; 0 = off
  is_level: str = "token"
  temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 1e-4
  warmup_steps: int = 0
  decay_steps: int = 1000
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  b1: float = 0.9
  b2: float = 0.95


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  """AdamW with linear warmup, cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0 if cfg.warmup_steps else cfg.lr, peak_value=cfg.lr,
      warmup_steps=cfg.warmup_steps,
      decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1),
      end_value=cfg.lr * cfg.min_lr_ratio)
  return optax.chain(
      optax.clip_by_global_norm(cfg.grad_clip),
      optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  actor: Any
  actor_opt: Any
  critic: Any = None
  critic_opt: Any = None


@dataclasses.dataclass(frozen=True)
class Models:
  """Static halves of the models (graph definitions) and their optimizers."""
  actor_def: Any
  actor_tx: optax.GradientTransformation
  critic_def: Any = None
  critic_tx: optax.GradientTransformation | None = None


def init_state(actor: nnx.Module, actor_tx, critic: nnx.Module | None = None,
               critic_tx=None) -> tuple[Models, TrainState]:
  actor_def, actor_params = nnx.split(actor, nnx.Param)
  models = Models(actor_def, actor_tx)
  state = TrainState(step=jnp.zeros((), jnp.int32), actor=actor_params,
                     actor_opt=jax.jit(actor_tx.init)(actor_params))
  if critic is not None:
    critic_def, critic_params = nnx.split(critic, nnx.Param)
    models = dataclasses.replace(models, critic_def=critic_def, critic_tx=critic_tx)
    state = state.replace(critic=critic_params,
                          critic_opt=jax.jit(critic_tx.init)(critic_params))
  return models, state


def _actor_loss(params, graphdef, batch, norm, cfg: LossConfig):
  model = nnx.merge(graphdef, params)
  logits = model(batch["tokens_bt"])[:, :-1]
  targets = batch["tokens_bt"][:, 1:]
  logp, entropy = token_logprobs(logits, targets, cfg.temperature)
  mask = batch["mask_bt"][:, :-1]
  old_logp = batch["old_logp_bt"][:, :-1]
  is_w = None
  if cfg.is_cap > 0:
    is_w = rl.truncated_is_weights(old_logp, batch["gen_logp_bt"][:, :-1], mask,
                                   cap=cfg.is_cap, level=cfg.is_level)
  agg = dict(agg=cfg.agg, norm_constant=norm if cfg.agg == "token_sum_norm" else None)
  loss, metrics = rl.ppo_policy_loss(
      logp, old_logp, batch["advantages_bt"][:, :-1], mask,
      clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
      is_weights_bt=is_w, **agg)
  ent = rl.aggregate(entropy, mask, mode=cfg.agg, norm_constant=agg["norm_constant"])
  loss = loss - cfg.entropy_coef * ent
  metrics["entropy"] = ent
  if cfg.kl_in_loss and cfg.kl_coef:
    kl, _ = rl.kl_loss(logp, batch["ref_logp_bt"][:, :-1], mask,
                       estimator=cfg.kl_estimator, **agg)
    loss = loss + cfg.kl_coef * kl
    metrics["kl_loss"] = kl
  return loss, metrics


def _critic_loss(params, graphdef, batch, norm, cfg: LossConfig):
  model = nnx.merge(graphdef, params)
  values = model(batch["tokens_bt"])[:, :-1]
  agg = dict(agg=cfg.agg, norm_constant=norm if cfg.agg == "token_sum_norm" else None)
  return rl.value_loss(values, batch["old_values_bt"][:, :-1], batch["returns_bt"][:, :-1],
                       batch["mask_bt"][:, :-1], clip=cfg.vf_clip, **agg)


def _accumulate(loss_fn, params, graphdef, batch, num_micro, cfg):
  """Sums gradients over `num_micro` equal micro-batches with lax.scan.

  Token-mean losses are normalised by the token count of the whole
  mini-batch, so the sum of micro-batch gradients equals the full-batch
  gradient exactly; other aggregations average micro-batch means.
  """
  micro = jax.tree.map(lambda x: x.reshape((num_micro, -1) + x.shape[1:]), batch)
  micro_b = batch["tokens_bt"].shape[0] // num_micro
  total_tokens = jnp.maximum(batch["mask_bt"][:, :-1].sum(), 1.0)
  exact = cfg.agg == "token_mean"
  sub_cfg = dataclasses.replace(cfg, agg="token_sum_norm") if exact else cfg
  norm = total_tokens / micro_b  # token_sum_norm divides by micro_b * norm
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def body(carry, mb):
    grads, loss_sum = carry
    (loss, metrics), g = grad_fn(params, graphdef, mb, norm, sub_cfg)
    grads = jax.tree.map(jnp.add, grads, g)
    return (grads, loss_sum + loss), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), metrics = jax.lax.scan(body, (zeros, jnp.zeros(())), micro)
  scale = 1.0 if exact else 1.0 / num_micro
  grads = jax.tree.map(lambda g: g * scale, grads)
  metrics = jax.tree.map(jnp.mean, metrics)
  return loss * scale, grads, metrics


@functools.partial(jax.jit, static_argnames=("models", "cfg", "num_micro"), donate_argnums=(0,))
def update_step(state: TrainState, batch: dict, *, models: Models, cfg: LossConfig,
                num_micro: int = 1) -> tuple[TrainState, dict]:
  """One optimizer step of the actor (and critic) on one mini-batch."""
  loss, grads, metrics = _accumulate(_actor_loss, state.actor, models.actor_def, batch,
                                     num_micro, cfg)
  updates, actor_opt = models.actor_tx.update(grads, state.actor_opt, state.actor)
  actor = optax.apply_updates(state.actor, updates)
  metrics = dict(metrics, actor_loss=loss, actor_grad_norm=optax.global_norm(grads))
  state = state.replace(step=state.step + 1, actor=actor, actor_opt=actor_opt)
  if models.critic_def is not None:
    vloss, vgrads, vmetrics = _accumulate(_critic_loss, state.critic, models.critic_def,
                                          batch, num_micro, cfg)
    updates, critic_opt = models.critic_tx.update(vgrads, state.critic_opt, state.critic)
    state = state.replace(critic=optax.apply_updates(state.critic, updates),
                          critic_opt=critic_opt)
    metrics.update(vmetrics, critic_loss=vloss, critic_grad_norm=optax.global_norm(vgrads))
  return state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def policy_logprobs(params, tokens_bt, *, graphdef, temperature: float = 1.0):
  """[b, t] logprobs (column t scores token t + 1; last column 0) and entropies."""
  logits = nnx.merge(graphdef, params)(tokens_bt)
  logp, ent = token_logprobs(logits[:, :-1], tokens_bt[:, 1:], temperature)
  pad = jnp.zeros_like(logp[:, :1])
  return jnp.concatenate([logp, pad], 1), jnp.concatenate([ent, pad], 1)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def critic_values(params, tokens_bt, *, graphdef):
  return nnx.merge(graphdef, params)(tokens_bt)
