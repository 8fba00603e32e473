"""Supervised warm-up: teacher-forced next-token loss on prompt -> answer.

RL from a random policy on the synthetic tasks gets no reward signal at all;
a short warm-up gives a weak but non-trivial starting policy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from streamrl.models.transformer import Transformer, token_logprobs
from streamrl.trainer.experience import bucket_length


def sft_arrays(pairs: Sequence[tuple], seq_len: int) -> dict:
  """(prompt ids incl. BOS, answer ids incl. EOS[, answer mask]) -> tokens and
  the mask of the answer tokens trained (all of them without a mask; a
  trajectory's observations are 0 in its mask: the tool wrote them)."""
  tokens = np.zeros((len(pairs), seq_len), np.int32)
  mask = np.zeros((len(pairs), seq_len), np.float32)
  for i, (p, a, *rest) in enumerate(pairs):
    ids = list(p) + list(a)
    tokens[i, : len(ids)] = ids[:seq_len]
    trained = np.asarray(rest[0] if rest else [1.0] * len(a), np.float32)
    if len(trained) != len(a):
      raise ValueError(f"An answer of {len(a)} tokens has a mask of {len(trained)}.")
    # Position t predicts token t + 1.
    mask[i, len(p) - 1 : len(ids) - 1] = trained[: seq_len - len(p) + 1]
  return {"tokens_bt": tokens, "mask_bt": mask}


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"), donate_argnums=(0, 1))
def sft_step(params, opt_state, batch, *, graphdef, tx):
  def loss_fn(p):
    logits = nnx.merge(graphdef, p)(batch["tokens_bt"])
    logp, _ = token_logprobs(logits[:, :-1], batch["tokens_bt"][:, 1:])
    mask = batch["mask_bt"][:, :-1]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def warm_start(
    model: Transformer,
    pairs,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seq_len: int,
    seed: int = 0,
    log_every: int = 0,
) -> tuple[Transformer, float]:
  """Trains `model` on random batches of `pairs`; returns it and the last loss.

  Each batch is drawn from one length bucket (examples padded to 32, 64, ...
  tokens), so short examples don't pay for the longest one: most of the
  synthetic data is short and this is several times faster on a CPU.
  """
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(
          optax.warmup_cosine_decay_schedule(
              0.0, lr, min(50, steps // 10 + 1), max(steps, 2), lr * 0.1
          )
      ),
  )
  opt_state = tx.init(params)
  rng = np.random.default_rng(seed)
  buckets: dict[int, list[int]] = {}
  for i, (p, a, *_) in enumerate(pairs):
    buckets.setdefault(min(bucket_length(len(p) + len(a)), seq_len), []).append(i)
  sizes = sorted(buckets)
  weights = np.array([len(buckets[k]) for k in sizes], np.float64)
  loss = float("nan")
  for i in range(steps):
    length = sizes[rng.choice(len(sizes), p=weights / weights.sum())]
    idx = rng.choice(buckets[length], batch_size)
    batch = sft_arrays([pairs[j] for j in idx], length)
    params, opt_state, loss = sft_step(params, opt_state, batch, graphdef=graphdef, tx=tx)
    if log_every and (i + 1) % log_every == 0:
      print(f"warm-up step {i + 1}/{steps}: loss {float(loss):.4f}", flush=True)
  return nnx.merge(graphdef, params), float(loss)
