"""The RL trainer: owns the mesh, the actor / critic / reference and their state.

`prepare` does the trainer-side work on finished samples (old and reference
logprobs, values, advantages) and `train` runs the PPO epochs over
mini-batches; the pipelines in `streamrl/pipeline` call these in different
orders. Mini-batches group samples of similar length (each padded to its own
bucket), which on CPU is several times cheaper than padding all to the
longest; their order is shuffled every epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from streamrl.models import hf
from streamrl.models.transformer import Critic, Transformer
from streamrl.trainer import experience, sharding, step as step_lib


def loss_config(algo) -> step_lib.LossConfig:
  return step_lib.LossConfig(
      clip_low=algo.clip_low, clip_high=algo.clip_high,
      dual_clip=algo.dual_clip or None, agg=algo.loss_agg,
      entropy_coef=algo.entropy_coef, kl_coef=algo.kl_coef,
      kl_estimator=algo.kl_estimator, kl_in_loss=not algo.kl_in_reward,
      vf_clip=algo.vf_clip, is_cap=algo.is_cap)


def advantage_config(algo) -> experience.AdvantageConfig:
  return experience.AdvantageConfig(
      estimator=algo.advantage, gamma=algo.gamma, lam=algo.lam,
      group_size=algo.group_size, kl_coef=algo.kl_coef if algo.use_reference else 0.0,
      kl_estimator=algo.kl_estimator, kl_in_reward=algo.kl_in_reward,
      whiten=algo.whiten_advantages)


def critic_from_policy(policy: Transformer, seed: int) -> Critic:
  """A critic whose trunk starts as a copy of the policy's; zero value head."""
  critic = Critic(policy.cfg, rngs=nnx.Rngs(seed))
  trunk = nnx.state(policy.trunk, nnx.Param)
  nnx.update(critic.trunk, jax.tree.map(jnp.copy, trunk))
  return critic


class RLTrainer:
  """Actor (+ critic, + frozen reference) on a mesh, updated with PPO steps."""

  def __init__(self, config, policy: Transformer, mesh: jax.sharding.Mesh | None = None):
    self.config = config
    algo, tr = config.algo, config.trainer
    self.mesh = mesh or sharding.make_mesh(dict(config.mesh))
    self.loss_cfg = loss_config(algo)
    self.adv_cfg = advantage_config(algo)
    self.mini_batch_size = tr.mini_batch_size
    self.num_micro = tr.mini_batch_size // tr.micro_batch_size
    self.ppo_epochs = tr.ppo_epochs
    self.temperature = config.generation.temperature
    total_steps = tr.num_iterations * tr.ppo_epochs * max(
        1, tr.prompts_per_iteration * algo.group_size // tr.mini_batch_size)
    actor_tx = step_lib.make_optimizer(step_lib.OptimConfig(
        lr=tr.lr, warmup_steps=tr.warmup_steps, decay_steps=total_steps,
        weight_decay=tr.weight_decay, grad_clip=tr.grad_clip))
    policy = sharding.shard_module(policy, self.mesh)
    critic, critic_tx = None, None
    if algo.use_critic:
      critic = sharding.shard_module(critic_from_policy(policy, config.seed), self.mesh)
      critic_tx = step_lib.make_optimizer(step_lib.OptimConfig(
          lr=tr.critic_lr, warmup_steps=tr.warmup_steps, decay_steps=total_steps,
          weight_decay=tr.weight_decay, grad_clip=tr.grad_clip))
    self.models, state = step_lib.init_state(policy, actor_tx, critic, critic_tx)
    # Scalars (step, optimizer counts) default to one device; replicate them on
    # the mesh so a restored (committed) state has one consistent device set.
    replicated = NamedSharding(self.mesh, P())
    self.state = jax.tree.map(
        lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
        else jax.device_put(x, replicated), state)
    self.ref = (jax.tree.map(jnp.copy, self.state.actor) if algo.use_reference else None)

  # ------------------------------------------------------------ per-sample work
  def _put(self, x: np.ndarray) -> jax.Array:
    return jax.device_put(x, sharding.batch_sharding(self.mesh, x.ndim, shape=x.shape))

  def begin_iteration(self, snapshot: bool) -> None:
    """Fixes the parameters that score() uses as "old" for this iteration.

    Sync scores every sample before the first update, so the live parameters
    are the old ones. Stream scores samples as they arrive, possibly after
    some updates: it snapshots actor and critic first, so every sample's
    ratio is taken against the same policy, as in sync.
    """
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    self._old = ((copy(self.state.actor), copy(self.state.critic)) if snapshot else None)

  def _old_params(self):
    old = getattr(self, "_old", None)
    return old if old is not None else (self.state.actor, self.state.critic)

  def score(self, samples: Sequence) -> dict:
    """Old / reference logprobs and values of samples (one padded batch)."""
    batch = experience.pad_samples(samples)
    tokens = self._put(batch["tokens_bt"])
    old_actor, old_critic = self._old_params()
    old, _ = step_lib.policy_logprobs(old_actor, tokens, graphdef=self.models.actor_def,
                                      temperature=self.temperature)
    batch["old_logp_bt"] = np.asarray(old)
    if self.ref is not None:
      ref, _ = step_lib.policy_logprobs(self.ref, tokens, graphdef=self.models.actor_def,
                                        temperature=self.temperature)
      batch["ref_logp_bt"] = np.asarray(ref)
    else:
      batch["ref_logp_bt"] = np.zeros_like(batch["old_logp_bt"])
    if self.models.critic_def is not None:
      batch["old_values_bt"] = np.asarray(step_lib.critic_values(
          old_critic, tokens, graphdef=self.models.critic_def))
    return batch

  def length_chunks(self, samples: Sequence) -> list[list[int]]:
    """Indices grouped into mini-batches of similar total length."""
    order = sorted(range(len(samples)),
                   key=lambda i: len(samples[i].prompt_token_ids) + len(samples[i].token_ids))
    m = self.mini_batch_size
    return [order[i:i + m] for i in range(0, len(order), m)]

  def prepare(self, samples: Sequence, scores: Sequence[float]) -> tuple[list[dict], dict]:
    """Scores every sample, computes advantages over the whole batch.

    Returns the mini-batches (numpy dicts, each padded to its own length) and
    batch-level metrics (KL to the reference, value statistics).
    """
    if len(samples) % self.mini_batch_size:
      raise ValueError(f"{len(samples)} samples don't split into mini-batches of "
                       f"{self.mini_batch_size}.")
    chunks = self.length_chunks(samples)
    parts = [self.score([samples[i] for i in c]) for c in chunks]
    full_len = max(p["tokens_bt"].shape[1] for p in parts)
    full = {k: np.zeros((len(samples), full_len), v.dtype) for k, v in parts[0].items()}
    for c, p in zip(chunks, parts):
      for k, v in p.items():
        full[k][c, :v.shape[1]] = v
    adv = experience.compute_advantages(full, np.asarray(scores, np.float32), cfg=self.adv_cfg)
    for k, v in adv.items():
      full[k] = np.asarray(v)
    minis = []
    for c, p in zip(chunks, parts):
      length = p["tokens_bt"].shape[1]
      minis.append({k: v[c, :length] for k, v in full.items() if k != "kl_bt"})
    mask = full["mask_bt"]
    ntok = max(mask.sum(), 1.0)
    metrics = {"kl_ref": float(((full["old_logp_bt"] - full["ref_logp_bt"]) * mask).sum() / ntok),
               "advantage_mean": float((full["advantages_bt"] * mask).sum() / ntok)}
    if "old_values_bt" in full:
      metrics["value_mean"] = float((full["old_values_bt"] * mask).sum() / ntok)
    return minis, metrics

  # ----------------------------------------------------------------- updates
  def train_minibatch(self, mini: dict) -> dict:
    batch = {k: self._put(v) for k, v in mini.items()}
    self.state, metrics = step_lib.update_step(
        self.state, batch, models=self.models, cfg=self.loss_cfg, num_micro=self.num_micro)
    return metrics

  def train(self, minis: list[dict], rng: np.random.Generator) -> dict:
    """PPO epochs over the mini-batches (order shuffled every epoch)."""
    collected = []
    for _ in range(self.ppo_epochs):
      for j in rng.permutation(len(minis)):
        collected.append(self.train_minibatch(minis[j]))
    return {k: float(np.mean([float(m[k]) for m in collected])) for k in collected[0]}

  # ------------------------------------------------------------------ export
  def policy(self) -> Transformer:
    return nnx.merge(self.models.actor_def, self.state.actor)

  def hf_tensors(self) -> dict[str, np.ndarray]:
    return hf.to_hf_tensors(self.policy())

  def checkpoint_arrays(self) -> dict:
    return {"state": self.state}

  def load_checkpoint_arrays(self, arrays: dict) -> None:
    self.state = arrays["state"]
