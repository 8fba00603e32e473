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
import numpy as np
import optax
from flax import nnx

from streamrl import rl
from streamrl.models import lora as lora_lib
from streamrl.models.config import ComputeConfig
from streamrl.models.transformer import next_token_logprobs, read_dtype_cast
from streamrl.generator.config import Sampling
from streamrl.rl.config import Kl, Loss
from streamrl.trainer import sharding
from streamrl.trainer.config import Optimizer

# The jitted step reads the run's own parts, which are frozen dataclasses and
# hash by value: `loss` (streamrl/rl/config.py; `rollout_correction` resolved
# by `Loss.resolved`), `kl` (its coef counts in the loss only when
# `kl.in_reward` is False; PPO puts the penalty in the reward instead) and
# `sampling` (streamrl/generator/config.py: the generators' temperature,
# which divides the logits as in `policy_logprobs`, and `max_tokens`, the
# fixed divisor of loss.agg="token_sum_norm", Dr. GRPO's).
_KL, _SAMPLING = Kl(), Sampling()


def check_loss(loss: Loss) -> None:
  """Refuses a loss the step cannot run (a ValueError naming the fix)."""
  if loss.agg not in rl.AGG_MODES:
    raise ValueError(
        f"Unknown loss aggregation {loss.agg!r}; set loss.agg to one of {list(rl.AGG_MODES)}."
    )
  if loss.rollout_correction not in rl.ROLLOUT_CORRECTIONS:
    raise ValueError(
        f"loss.rollout_correction={loss.rollout_correction!r} cannot reach the train step; "
        f"resolve 'auto' with Loss.resolved(mode) or use one of {list(rl.ROLLOUT_CORRECTIONS)}."
    )


def lr_schedule(opt: Optimizer, *, lr: float, decay_steps: int) -> optax.Schedule:
  """Linear warmup over `optimizer.warmup_steps`, then cosine decay to
  lr * `optimizer.min_lr_ratio` at `decay_steps` optimizer steps."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0 if opt.warmup_steps else lr,
      peak_value=lr,
      warmup_steps=opt.warmup_steps,
      decay_steps=max(decay_steps, opt.warmup_steps + 1),
      end_value=lr * opt.min_lr_ratio,
  )


def make_optimizer(opt: Optimizer, *, lr: float, decay_steps: int) -> optax.GradientTransformation:
  """AdamW on `lr_schedule` with global-norm clipping (`optimizer.*`; the
  actor's lr is `opt.lr`, the critic's `opt.critic_lr`)."""
  schedule = lr_schedule(opt, lr=lr, decay_steps=decay_steps)
  return optax.chain(
      optax.clip_by_global_norm(opt.grad_clip),
      optax.adamw(
          schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay, mu_dtype=opt.mu_dtype
      ),
  )


@flax.struct.dataclass
class TrainState:
  """What the step updates. With LoRA (`Models.lora`) `actor` is the adapter
  (`streamrl.models.lora`), the only trained actor state, and `actor_base`
  the frozen policy it adapts, stored in the dtypes the forward pass reads."""

  step: jax.Array
  actor: Any
  actor_opt: Any
  critic: Any = None
  critic_opt: Any = None
  actor_base: Any = None


@dataclasses.dataclass(frozen=True)
class Models:
  """The static half of the train state: graph definitions, the optimizer
  (`optimizer.*`, decaying over `decay_steps`; the critic trains with
  `optimizer.critic_lr`) and how the forward passes run (`compute`: dtype,
  remat, logprob chunks).

  Every field compares and hashes by value (nnx GraphDefs and frozen
  configs), so two trainers with equal models and configs share the
  compiled `update_step`.
  """

  actor_def: nnx.GraphDef
  optimizer: Optimizer
  decay_steps: int
  critic_def: nnx.GraphDef | None = None
  compute: ComputeConfig = ComputeConfig()
  lora: lora_lib.LoraSpec | None = None

  def __hash__(self) -> int:
    # jit hashes its static arguments on every call, and a GraphDef's hash
    # walks the whole graph: hashed once per Models, not per dispatch.
    h = self.__dict__.get("_hash")
    if h is None:
      h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
      object.__setattr__(self, "_hash", h)
    return h

  def __getstate__(self) -> dict:  # str hashes differ between processes
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}

  def actor_tx(self) -> optax.GradientTransformation:
    return make_optimizer(self.optimizer, lr=self.optimizer.lr, decay_steps=self.decay_steps)

  def critic_tx(self) -> optax.GradientTransformation:
    return make_optimizer(self.optimizer, lr=self.optimizer.critic_lr, decay_steps=self.decay_steps)


# `read_dtype_cast` as one program for the whole tree (eager, it would be a
# program per parameter shape and dtype).
frozen_copy = jax.jit(read_dtype_cast, static_argnums=(1, 2))


def init_state(
    actor: nnx.Module,
    optimizer: Optimizer,
    decay_steps: int,
    critic: nnx.Module | None = None,
    compute: ComputeConfig = ComputeConfig(),
    lora: lora_lib.LoraSpec | None = None,
    seed: int = 0,
) -> tuple[Models, TrainState]:
  """Splits the models into (static Models, TrainState with fresh optimizer state).

  The parameters stay in the dtype they come in (fp32 master weights);
  `compute` says how the step's forward passes run. With `lora` the actor's
  weights become the frozen `actor_base` (in the read dtypes) and a fresh
  adapter (seeded by `seed`) is what trains: the optimizer holds its state only.
  """
  actor_def, actor_params = nnx.split(actor, nnx.Param)
  models = Models(actor_def, optimizer, decay_steps, compute=compute, lora=lora)
  base = None
  if lora is not None:
    base = frozen_copy(actor_params, actor.cfg, compute)
    adapters = lora_lib.init_adapters(
        actor_params, actor.cfg.num_layers, lora, jax.random.key(seed)
    )
    actor_params = sharding.adapter_shardings(adapters, actor_params)
  state = TrainState(
      step=jnp.zeros((), jnp.int32),
      actor=actor_params,
      actor_opt=jax.jit(models.actor_tx().init)(actor_params),
      actor_base=base,
  )
  if critic is not None:
    critic_def, critic_params = nnx.split(critic, nnx.Param)
    models = dataclasses.replace(models, critic_def=critic_def)
    state = state.replace(
        critic=critic_params, critic_opt=jax.jit(models.critic_tx().init)(critic_params)
    )
  return models, state


def actor_params(params, base, lora: lora_lib.LoraSpec | None):
  """The actor's full parameters: `params` itself, or with LoRA the frozen
  `base` with the adapter `params` merged in (for exports; the step never merges)."""
  return params if lora is None else lora_lib.merged(base, params, lora)


def actor_model(params, graphdef, base, lora: lora_lib.LoraSpec | None):
  """(model, adapters) for `next_token_logprobs`: the model of `params`, or
  with LoRA the frozen `base`'s model and the adapter `params` by layer,
  applied beside each weight unmerged (traceable)."""
  if lora is None:
    return nnx.merge(graphdef, params), None
  model = nnx.merge(graphdef, base)
  return model, lora_lib.by_layer(params, lora, model.cfg.num_layers)


def _actor_loss(
    params,
    graphdef,
    batch,
    compute: ComputeConfig,
    loss: Loss,
    kl: Kl,
    sampling: Sampling,
    base=None,
    lora=None,
):
  model, adapters = actor_model(params, graphdef, base, lora)
  logp, entropy = next_token_logprobs(
      model, batch["tokens_bt"], sampling.temperature, compute, adapters
  )
  logp, entropy = logp[:, :-1], entropy[:, :-1]
  mask = batch["mask_bt"][:, :-1]
  old_logp = batch["old_logp_bt"][:, :-1]
  is_w = rl.rollout_correction_weights(
      old_logp,
      batch["gen_logp_bt"][:, :-1],
      mask,
      loss.rollout_correction,
      is_cap=loss.is_cap,
      mis_threshold=loss.mis_threshold,
      level=loss.is_level,
  )
  agg = dict(agg=loss.agg, norm_constant=float(sampling.max_tokens))
  value, metrics = rl.ppo_policy_loss(
      logp,
      old_logp,
      batch["advantages_bt"][:, :-1],
      mask,
      clip_low=loss.clip_low,
      clip_high=loss.clip_high,
      dual_clip=loss.dual_clip or None,
      is_weights_bt=is_w,
      **agg,
  )
  if not loss.entropy_coef:  # a metric only: no gradient through the vocabulary-wide entropy
    entropy = jax.lax.stop_gradient(entropy)
  ent = rl.aggregate(entropy, mask, mode=loss.agg, norm_constant=agg["norm_constant"])
  if loss.entropy_coef:
    value = value - loss.entropy_coef * ent
  metrics["entropy"] = ent
  if kl.loss_coef:
    kl_term, _ = rl.kl_loss(logp, batch["ref_logp_bt"][:, :-1], mask, estimator=kl.estimator, **agg)
    value = value + kl.loss_coef * kl_term
    metrics["kl_loss"] = kl_term
  return value, metrics


def _critic_loss(
    params, graphdef, batch, compute: ComputeConfig, loss: Loss, kl: Kl, sampling: Sampling
):
  del kl  # The critic's loss reads the policy loss's aggregation and value clip only.
  model = nnx.merge(graphdef, params)
  values = model(batch["tokens_bt"], compute=compute)[:, :-1]
  return rl.value_loss(
      values,
      batch["old_values_bt"][:, :-1],
      batch["returns_bt"][:, :-1],
      batch["mask_bt"][:, :-1],
      clip=loss.vf_clip,
      agg=loss.agg,
      norm_constant=float(sampling.max_tokens),
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
    [num_micro] weights: numpy for a numpy mask (computed on the host, no
    device program), else a jax array.
  """
  xp = np if isinstance(mask_bt, np.ndarray) else jnp
  m = (xp.asarray(mask_bt) != 0).astype(xp.float32)
  m = m.reshape((num_micro, -1) + m.shape[1:])
  if agg == "token_mean":
    count_k = m.sum((1, 2))
  elif agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
    count_k = (m.sum(2) > 0).sum(1).astype(xp.float32)
  elif agg == "token_sum_norm":
    count_k = xp.full((num_micro,), m.shape[1], xp.float32)
  else:
    raise ValueError(f"Unknown loss aggregation {agg!r}; use one of {list(rl.AGG_MODES)}.")
  return count_k / xp.maximum(count_k.sum(), 1.0)


def combine_micro_metrics(metrics: dict, weights_k: jax.Array) -> dict:
  """[num_micro] metrics -> scalars: the max for "*_max" keys, else sum_k w_k · x_k."""
  return {k: v.max() if k.endswith("_max") else jnp.sum(weights_k * v) for k, v in metrics.items()}


def _weighted_grad(loss_fn, graphdef, compute, parts):
  """(params, micro-batch, weight) -> ((weight * loss, metrics), gradient);
  `parts` = (loss, kl, sampling)."""

  def weighted_loss(p, mb, w):
    value, metrics = loss_fn(p, graphdef, mb, compute, *parts)
    return w * value, metrics

  return jax.value_and_grad(weighted_loss, has_aux=True)


def _optimizer_step(state: TrainState, grads: dict, models: Models) -> tuple[TrainState, dict]:
  """AdamW on {"actor": grads[, "critic": grads]}; returns the new state and
  the gradient norms."""
  actor_tx = models.actor_tx()
  updates, actor_opt = actor_tx.update(grads["actor"], state.actor_opt, state.actor)
  state = state.replace(
      step=state.step + 1, actor=optax.apply_updates(state.actor, updates), actor_opt=actor_opt
  )
  norms = {"actor_grad_norm": optax.global_norm(grads["actor"])}
  if "critic" in grads:
    critic_tx = models.critic_tx()
    updates, critic_opt = critic_tx.update(grads["critic"], state.critic_opt, state.critic)
    state = state.replace(critic=optax.apply_updates(state.critic, updates), critic_opt=critic_opt)
    norms["critic_grad_norm"] = optax.global_norm(grads["critic"])
  return state, norms


def _accumulate(loss_fn, params, graphdef, batch, num_micro, compute, parts):
  """Loss and gradient of a mini-batch, summed over micro-batches with lax.scan.

  Micro-batch k's loss is scaled by `micro_batch_weights`, so the result equals
  the full-batch loss and gradient in every aggregation mode.
  """
  micro = jax.tree.map(lambda x: x.reshape((num_micro, -1) + x.shape[1:]), batch)
  weights_k = micro_batch_weights(batch["mask_bt"][:, :-1], num_micro, parts[0].agg)
  grad_fn = _weighted_grad(loss_fn, graphdef, compute, parts)

  def body(carry, xs):
    grads, loss_sum = carry
    (loss, metrics), g = grad_fn(params, *xs)
    return (jax.tree.map(jnp.add, grads, g), loss_sum + loss), metrics

  zeros = jax.tree.map(jnp.zeros_like, params)
  (grads, loss), metrics = jax.lax.scan(body, (zeros, jnp.zeros(())), (micro, weights_k))
  return loss, grads, combine_micro_metrics(metrics, weights_k)


@functools.partial(
    jax.jit, static_argnames=("models", "loss", "kl", "sampling", "num_micro"), donate_argnums=(0,)
)
def update_step(
    state: TrainState,
    batch: dict,
    *,
    models: Models,
    loss: Loss,
    kl: Kl = _KL,
    sampling: Sampling = _SAMPLING,
    num_micro: int = 1,
) -> tuple[TrainState, dict]:
  """One optimizer step of the actor (and critic) on one mini-batch."""
  check_loss(loss)
  parts = (loss, kl, sampling)
  actor_loss = functools.partial(_actor_loss, base=state.actor_base, lora=models.lora)
  value, grads, metrics = _accumulate(
      actor_loss, state.actor, models.actor_def, batch, num_micro, models.compute, parts
  )
  grads, metrics = {"actor": grads}, dict(metrics, actor_loss=value)
  if models.critic_def is not None:
    vloss, vgrads, vmetrics = _accumulate(
        _critic_loss, state.critic, models.critic_def, batch, num_micro, models.compute, parts
    )
    grads["critic"] = vgrads
    metrics.update(vmetrics, critic_loss=vloss)
  state, norms = _optimizer_step(state, grads, models)
  return state, dict(metrics, **norms)


# ---------------------------------------------------- ragged micro-batches
# A long-tailed batch padded to its longest row is mostly padding. The
# trainer can instead pad each micro-batch of a length-sorted mini-batch to
# its own length: `accumulate_micro` runs once per micro-batch (one compile per
# distinct length bucket), adding its weighted gradient into one accumulator
# that it donates (so one gradient buffer is alive, as in `update_step`'s
# scan), and `apply_grads` takes the optimizer step on the sum, with the same
# weights as `update_step`'s scan, so the step is the same. Everything runs
# inside jitted programs whose inputs are global arrays or host numpy values
# that every process holds alike: with a multi-process trainer, an eager op on
# a process-local array (the old per-micro-batch `jnp.add` outside jit, fed a
# weight computed on the process's own device) is a computation the processes
# do not agree on.


def _micro_grads(state: TrainState, micro: dict, weight, models: Models, parts):
  grad_fn = functools.partial(_weighted_grad, compute=models.compute, parts=parts)
  actor_loss = functools.partial(_actor_loss, base=state.actor_base, lora=models.lora)
  (loss, metrics), grads = grad_fn(actor_loss, models.actor_def)(state.actor, micro, weight)
  grads, losses = {"actor": grads}, {"actor": loss}
  if models.critic_def is not None:
    (vloss, vmetrics), vgrads = grad_fn(_critic_loss, models.critic_def)(
        state.critic, micro, weight
    )
    grads["critic"], losses["critic"] = vgrads, vloss
    metrics = dict(metrics, **vmetrics)
  return grads, losses, metrics


@functools.partial(jax.jit, static_argnames=("with_critic",))
def zero_accumulator(state: TrainState, with_critic: bool):
  """The (grads, losses) accumulator of `accumulate_micro`, all zeros."""
  acc = ({"actor": jax.tree.map(jnp.zeros_like, state.actor)}, {"actor": jnp.zeros(())})
  if with_critic:
    acc[0]["critic"] = jax.tree.map(jnp.zeros_like, state.critic)
    acc[1]["critic"] = jnp.zeros(())
  return acc


@functools.partial(
    jax.jit, static_argnames=("models", "loss", "kl", "sampling"), donate_argnums=(1,)
)
def accumulate_micro(
    state: TrainState,
    acc,
    micro: dict,
    weight,
    *,
    models: Models,
    loss: Loss,
    kl: Kl = _KL,
    sampling: Sampling = _SAMPLING,
):
  """`acc` (grads, losses; from `zero_accumulator`) plus micro-batch
  `micro`'s weighted gradient and loss; `acc` is donated. Returns the new
  accumulator and the micro-batch's metrics."""
  check_loss(loss)
  grads, losses, metrics = _micro_grads(state, micro, weight, models, (loss, kl, sampling))
  return jax.tree.map(jnp.add, acc, (grads, losses)), metrics


# The optimizer step of `update_step` on gradients accumulated outside it.
apply_grads = jax.jit(_optimizer_step, static_argnames=("models",), donate_argnums=(0,))


@jax.jit
def _combine(metrics: list, weights_k):
  stacked = {k: jnp.stack([m[k] for m in metrics]) for k in metrics[0]}
  return combine_micro_metrics(stacked, weights_k)


def ragged_update(
    state: TrainState,
    micros: list[dict],
    weights_k,
    *,
    models: Models,
    loss: Loss,
    kl: Kl = _KL,
    sampling: Sampling = _SAMPLING,
) -> tuple[TrainState, dict]:
  """`update_step` on micro-batches of different lengths (`weights_k`: host
  numpy weights from `micro_batch_weights` of the whole mini-batch's mask)."""
  weights_k = np.asarray(weights_k, np.float32)
  acc, metrics = zero_accumulator(state, models.critic_def is not None), []
  for micro, w in zip(micros, weights_k):
    acc, m = accumulate_micro(
        state, acc, micro, w, models=models, loss=loss, kl=kl, sampling=sampling
    )
    metrics.append(m)
  grads, losses = acc
  state, norms = apply_grads(state, grads, models=models)
  out = dict(_combine(metrics, weights_k))
  out.update(norms, actor_loss=losses["actor"])
  if "critic" in losses:
    out["critic_loss"] = losses["critic"]
  return state, out


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "compute", "lora"))
def policy_logprobs(
    params,
    tokens_bt,
    *,
    graphdef,
    temperature: float = 1.0,
    compute=ComputeConfig(),
    base=None,
    lora=None,
):
  """[b, t] logprobs (column t scores token t + 1; last column 0) and entropies.

  fp32, chunked over time as the loss is (`compute.logprob_chunk`), so
  scoring never holds [b, t, v] logits either. With `lora`, `params` is an
  adapter on `base` (see `actor_model`).
  """
  model, adapters = actor_model(params, graphdef, base, lora)
  return next_token_logprobs(model, tokens_bt, temperature, compute, adapters)


@functools.partial(jax.jit, static_argnames=("models", "temperature", "ref_is_base"))
def score_batch(
    tokens_bt,
    old_actor,
    old_critic=None,
    ref=None,
    base=None,
    *,
    models: Models,
    temperature: float = 1.0,
    ref_is_base: bool = False,
) -> dict:
  """Everything `RLTrainer.prepare` scores on one padded batch, in one program:

    old_logp_bt    [b, t] the old policy's logprobs (`old_actor`, an adapter
                   on `base` under `models.lora`)
    ref_logp_bt    [b, t] the reference's, when `ref` is given (or, with
                   `ref_is_base`, the frozen `base` itself)
    old_values_bt  [b, t] the old critic's values, when `models` has a critic

  The same functions as `policy_logprobs` and `critic_values` (the same
  values), one dispatch and one transfer instead of one per model, and no
  entropies (scoring never reads them).
  """
  score = dict(graphdef=models.actor_def, temperature=temperature, compute=models.compute)
  old_logp, _ = policy_logprobs(old_actor, tokens_bt, base=base, lora=models.lora, **score)
  out = {"old_logp_bt": old_logp}
  if ref_is_base or ref is not None:
    out["ref_logp_bt"], _ = policy_logprobs(base if ref_is_base else ref, tokens_bt, **score)
  if models.critic_def is not None:
    out["old_values_bt"] = critic_values(
        old_critic, tokens_bt, graphdef=models.critic_def, compute=models.compute
    )
  return out


@functools.partial(jax.jit, static_argnames=("graphdef", "compute"))
def critic_values(params, tokens_bt, *, graphdef, compute=ComputeConfig()):
  """The model's output on tokens_bt: [b, t] values for a Critic."""
  return nnx.merge(graphdef, params)(tokens_bt, compute=compute)
