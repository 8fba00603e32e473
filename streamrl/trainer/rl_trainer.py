"""The RL trainer: owns the mesh, the actor / critic / reference and their state.

Called by the one loop in `streamrl/train.py`, the same in every pipeline
mode:

  old = trainer.snapshot()                      # the iteration's old policy
  minis, metrics = trainer.prepare(samples, rewards, old)   # score + advantages
  step_metrics = trainer.update(minis[j])       # one optimizer step
  tensors = trainer.export_weights()            # HF-named, for the generators

`prepare` groups samples of similar length into mini-batches (each padded to
its own bucket), which on CPU is several times cheaper than padding all to
the longest, and measures the trainer/generator mismatch (`mismatch/*`).

Memory: the actor and critic train with fp32 master weights and optimizer
state and compute as `trainer.compute(model.dtype)` says (bf16 when the
generators run bf16). The frozen copies -- the reference model and the iteration's old
policy -- are stored in the dtypes the forward pass reads (bf16 matmul
weights under bf16 compute; `transformer.read_dtype_cast`), half the bytes of
an fp32 copy with identical log-probabilities. The critic is created
directly in its sharding.
"""

from __future__ import annotations

import typing

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from streamrl import rl
from streamrl.models import hf, lora as lora_lib
from streamrl.generator.config import Sampling
from streamrl.rl.config import Advantage, Kl, Loss
from streamrl.trainer.config import Optimizer, Trainer
from streamrl.models.transformer import Critic, Transformer
from streamrl.trainer import experience, multihost, sharding, step as step_lib

if typing.TYPE_CHECKING:  # The run's settings are read here, never imported at run time.
  from streamrl.config import settings as settings_lib

log = logging.getLogger(__name__)


# One program per padded length (eager, every op of it would be one).
_mismatch_metrics = jax.jit(rl.mismatch_metrics)

# `prepare` pads each scored block to its own bucket from this length (16,
# 24, then `bucket_length`'s 32, 48, ...): on a task of short responses most
# blocks fit in 16 or 24 tokens, and a mini-batch of such blocks keeps that
# length through its updates. Two more shapes per program than from 32.
SCORE_SMALLEST_BUCKET = 16


def _abstract(x):
  """An array (or a compiled program's output) as the abstract value jit keys on."""
  if x is None:
    return None
  return jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, "sharding", None), weak_type=x.weak_type
  )


def _jit_key(x) -> tuple:
  """What of an abstract array tells jit's compiled programs apart: shape,
  dtype, weak type and sharding (`P()` and `P(None, None)` spell one
  placement on a mesh, as an update's output and its input spell it)."""
  s = x.sharding
  if isinstance(s, NamedSharding):
    spec = tuple(s.spec)
    while spec and spec[-1] is None:
      spec = spec[:-1]
    s = (s.mesh, spec, s.memory_kind)
  return (x.shape, x.dtype, x.weak_type, s)


def _add_new(todo: list, done: list, tree) -> None:
  """Appends the abstract `tree` to `todo` unless it or one with the same
  `_jit_key`s is in `todo` or `done` already."""
  key = jax.tree.structure(tree), [_jit_key(x) for x in jax.tree.leaves(tree)]
  for other in todo + done:
    if key == (jax.tree.structure(other), [_jit_key(x) for x in jax.tree.leaves(other)]):
      return
  todo.append(tree)


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """The parameters that score an iteration's samples as "old" (PPO ratio)."""

  actor: object
  critic: object


def critic_from_policy(
    policy: Transformer, mesh: jax.sharding.Mesh, rules=sharding.DEFAULT_RULES
) -> Critic:
  """A critic whose trunk starts as a copy of the policy's; zero value head.

  Created in its sharding on `mesh` (`sharding.init_sharded`): the trunk is
  copied shard by shard from the (sharded) policy, and no device ever holds
  a whole critic. No random numbers: the critic's structure comes from
  `nnx.eval_shape`, its trunk from the policy, its head is zeros.
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Critic(policy.cfg, rngs=nnx.Rngs(0))))

  def build(trunk):
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    critic = nnx.merge(graphdef, zeros)
    nnx.update(critic.trunk, trunk)
    return critic

  return sharding.init_sharded(build, mesh, nnx.state(policy.trunk, nnx.Param), rules=rules)


class RLTrainer:
  """Actor (+ critic, + frozen reference) on a mesh, updated with PPO steps.

  The reference model lives here, on the trainer's mesh, stored in the
  compute dtype (`read_dtype_cast`: bf16 matmul weights, fp32 norms and LM
  head under bf16 compute; an fp32 copy under fp32 compute). Scoring it on
  the generators instead would need a second set of weights in every engine
  and would mix the engine/trainer mismatch into the KL term (nonzero KL
  before any update); stored like this it costs half an fp32 copy and gives
  exactly the log-probabilities the initial policy has in the trainer.

  Every option comes from the run's own parts (streamrl/config/settings.py lists
  them; `from_settings` passes a run's):

  Args:
    policy: the actor, unsharded.
    loss: the policy / value loss (`loss.*`), with rollout_correction resolved
      (`Loss.resolved(mode)`).
    kl: the KL to the reference (`kl.*`): a reward penalty or a loss term; a
      frozen reference is kept when `kl.use_reference`.
    advantage: the estimator (`advantage.*`); `use_critic` adds a critic.
    sampling: the generators' sampling (`sampling.*`): the trainer scores at
      their temperature and token_sum_norm divides by their max_tokens.
    optimizer: AdamW for actor (`lr`) and critic (`critic_lr`), decaying over
      `optimizer_steps`.
    trainer: mini / micro batch sizes and how the forward passes run
      (`Trainer.compute`; parameters and optimizer state stay fp32).
    export_dtype: the generators' dtype (`model.dtype`), in which
      `export_weights` hands weights over; compute_dtype="auto" follows it.
    mesh: the device mesh (default: `mesh_axes` over all devices).
  """

  def __init__(
      self,
      policy: Transformer,
      *,
      loss: Loss,
      kl: Kl,
      advantage: Advantage,
      sampling: Sampling,
      optimizer: Optimizer,
      trainer: Trainer,
      optimizer_steps: int,
      seed: int = 0,
      mesh: jax.sharding.Mesh | None = None,
      mesh_axes: dict | None = None,
      export_dtype: str = "float32",
  ):
    step_lib.check_loss(loss)
    self.export_dtype = export_dtype
    self.compute = trainer.compute(export_dtype)
    self.model_cfg = policy.cfg
    self.mesh = mesh or sharding.make_mesh(dict(mesh_axes or {"fsdp": -1}))
    self.loss, self.kl, self.advantage, self.sampling = loss, kl, advantage, sampling
    self.mini_batch_size = trainer.mini_batch_size
    self.num_micro = trainer.mini_batch_size // trainer.micro_batch_size
    policy = sharding.shard_module(policy, self.mesh)
    critic = None
    if advantage.use_critic:
      critic = critic_from_policy(policy, self.mesh)
    self.lora = trainer.lora_spec()
    self.models, state = step_lib.init_state(
        policy, optimizer, optimizer_steps, critic, compute=self.compute, lora=self.lora, seed=seed
    )
    # Scalars (step, optimizer counts) default to one device; replicate them on
    # the mesh so a restored (committed) state has one consistent device set.
    replicated = NamedSharding(self.mesh, P())
    self.state = jax.tree.map(
        lambda x: x
        if isinstance(getattr(x, "sharding", None), NamedSharding)
        else jax.device_put(x, replicated),
        state,
    )
    # With LoRA the reference is the frozen base itself (the adapter off).
    self.ref = self._frozen(self.state.actor) if kl.use_reference and not self.lora else None
    self.ref_is_base = bool(kl.use_reference and self.lora)
    self._warming: concurrent.futures.Future | None = None  # `start_warm_up`'s

  @classmethod
  def from_settings(
      cls, policy: Transformer, s: settings_lib.Settings, mesh: jax.sharding.Mesh | None = None
  ) -> "RLTrainer":
    """The trainer of run settings `s`: each part passed as it is."""
    return cls(
        policy,
        loss=s.loss.resolved(s.pipeline.mode),
        kl=s.kl,
        advantage=s.advantage,
        sampling=s.sampling,
        optimizer=s.optimizer,
        trainer=s.trainer,
        optimizer_steps=s.optimizer_steps,
        seed=s.seed,
        mesh=mesh,
        mesh_axes=s.mesh.axes(),
        export_dtype=s.model.dtype,
    )

  # ------------------------------------------------------------ per-sample work
  def _put(self, x: np.ndarray) -> jax.Array:
    # Each process transfers only the rows its devices hold (multihost.py).
    return multihost.global_array(x, sharding.batch_sharding(self.mesh, x.ndim, shape=x.shape))

  def _put_all(self, arrays: dict) -> dict:
    """`_put` of each array; in one process, one transfer for them all."""
    if jax.process_count() > 1:
      return {k: self._put(v) for k, v in arrays.items()}
    shardings = {
        k: sharding.batch_sharding(self.mesh, v.ndim, shape=v.shape) for k, v in arrays.items()
    }
    return jax.device_put(arrays, shardings)

  def _frozen(self, params):
    """A copy of actor or critic params for scoring only, in the dtypes the
    forward pass reads (`read_dtype_cast`): same results, half the bytes
    under bf16 compute."""
    if params is None:
      return None
    copy = step_lib.frozen_copy(params, self.model_cfg, self.compute)
    # In the live parameters' shardings (spelled alike), so scoring with the copy and
    # with the live parameters is one compiled program, not two.
    return jax.tree.map(lambda c, p: jax.device_put(c, p.sharding), copy, params)

  def snapshot(self, copy: bool = True) -> Snapshot:
    """The current actor and critic as the old policy of an iteration.

    The copy is stored in the read dtypes (see `_frozen`), so it scores
    exactly as the live parameters do. `copy=False` is for callers that
    score every sample before the first update (the step donates its input
    state, so a plain reference would not survive an update).
    """
    if not copy:
      return Snapshot(self.state.actor, self.state.critic)
    if self.lora:  # An adapter is small: an fp32 copy scores exactly as the live one.
      actor = jax.tree.map(jnp.copy, self.state.actor)
    else:
      actor = self._frozen(self.state.actor)
    return Snapshot(actor, self._frozen(self.state.critic))

  def score(self, samples: Sequence, old: Snapshot) -> dict:
    """Old / reference logprobs and values of samples (one padded batch)."""
    return self._fetch(self._dispatch_score(samples, old))

  def _dispatch_score(self, samples: Sequence, old: Snapshot) -> tuple[dict, dict]:
    """Starts scoring `samples` on the devices: (host batch, device results)."""
    batch = experience.pad_samples(samples, smallest=SCORE_SMALLEST_BUCKET)
    out = step_lib.score_batch(
        self._put(batch["tokens_bt"]),
        old.actor,
        old.critic,
        self.ref,
        self.state.actor_base,
        models=self.models,
        temperature=self.sampling.temperature,
        ref_is_base=self.ref_is_base,
    )
    return batch, out

  @staticmethod
  def _fetch(scored: tuple[dict, dict]) -> dict:
    batch, out = scored
    if jax.process_count() == 1:
      batch.update(jax.device_get(out))  # one transfer for all outputs
    else:
      batch.update({k: multihost.host_array(v) for k, v in out.items()})
    if "ref_logp_bt" not in batch:
      batch["ref_logp_bt"] = np.zeros_like(batch["old_logp_bt"])
    return batch

  def length_chunks(self, samples: Sequence) -> list[list[int]]:
    """Indices grouped into mini-batches of similar total length."""
    order = sorted(
        range(len(samples)),
        key=lambda i: len(samples[i].prompt_token_ids) + len(samples[i].token_ids),
    )
    m = self.mini_batch_size
    return [order[i : i + m] for i in range(0, len(order), m)]

  def prepare(
      self, samples: Sequence, rewards: Sequence[float], old: Snapshot
  ) -> tuple[list[dict], dict]:
    """Scores samples with `old`, computes advantages over all of them.

    Returns the mini-batches (numpy dicts, each padded to its own length) and
    metrics: KL to the reference, advantage and value means, and the
    trainer/generator mismatch on the sampled tokens (`mismatch/*`).
    """
    self.wait_warm_up()
    if len(samples) % self.mini_batch_size:
      raise ValueError(
          f"{len(samples)} samples don't split into mini-batches of " f"{self.mini_batch_size}."
      )
    chunks = self.length_chunks(samples)
    # Scored in micro-batch-sized blocks of the same order, each padded to
    # its own length (a long-tailed mini-batch is mostly padding otherwise).
    size = self.mini_batch_size // self.num_micro
    blocks = [c[i : i + size] for c in chunks for i in range(0, len(c), size)]
    # Every block is dispatched before any result is read: one wait, not one per block.
    scored = [self._dispatch_score([samples[i] for i in c], old) for c in blocks]
    parts = [self._fetch(x) for x in scored]
    full_len = max(p["tokens_bt"].shape[1] for p in parts)
    full = {k: np.zeros((len(samples), full_len), v.dtype) for k, v in parts[0].items()}
    block_len = {}
    for c, p in zip(blocks, parts):
      block_len[c[0]] = p["tokens_bt"].shape[1]
      for k, v in p.items():
        full[k][c, : v.shape[1]] = v
    adv = experience.compute_advantages(
        full, np.asarray(rewards, np.float32), advantage=self.advantage, kl=self.kl
    )
    for k, v in adv.items():
      full[k] = np.asarray(v)
    if self.loss.mask_truncated:
      # DAPO: a response cut at the length limit keeps its reward in its
      # group's baseline (above) but none of its tokens is in the loss.
      cut = [i for i, x in enumerate(samples) if x.finish_reason == "length"]
      full["mask_bt"][cut] = 0
    minis = []
    for c in chunks:
      length = max(block_len[c[i]] for i in range(0, len(c), size))
      minis.append({k: v[c, :length] for k, v in full.items() if k != "kl_bt"})
    mask = full["mask_bt"]
    ntok = max(mask.sum(), 1.0)
    metrics = {
        "kl_ref": float(((full["old_logp_bt"] - full["ref_logp_bt"]) * mask).sum() / ntok),
        "advantage_mean": float((full["advantages_bt"] * mask).sum() / ntok),
    }
    if "old_values_bt" in full:
      metrics["value_mean"] = float((full["old_values_bt"] * mask).sum() / ntok)
    device = {"": _mismatch_metrics(full["old_logp_bt"], full["gen_logp_bt"], mask)}
    if any(x.token_versions is not None for x in samples):
      # Partial rollouts: the same per weight version that sampled the tokens
      # (train.iteration_scalars names them by version gap).
      versions = np.full(mask.shape, -1, np.int64)
      for i, x in enumerate(samples):
        p, r = len(x.prompt_token_ids), len(x.token_ids)
        versions[i, p - 1 : p + r - 1] = x.token_versions or x.weight_version
      for v in np.unique(versions[mask > 0]):
        device[f"{v}/"] = _mismatch_metrics(
            full["old_logp_bt"], full["gen_logp_bt"], mask * (versions == v)
        )
    # Fetched once, not once per scalar.
    for prefix, part in jax.device_get(device).items():
      group = "mismatch_by_version/" if prefix else "mismatch/"
      metrics.update({f"{group}{prefix}{k}": float(x) for k, x in part.items()})
    return minis, metrics

  # ----------------------------------------------------------------- updates
  def _step_parts(self) -> dict:
    """The jitted step's static arguments: the models and the run's parts."""
    return dict(models=self.models, loss=self.loss, kl=self.kl, sampling=self.sampling)

  def update(self, mini: dict) -> dict:
    """One optimizer step on a mini-batch; returns its metrics (device arrays).

    The rows of a mini-batch from `prepare` are sorted by length. With
    several micro-batches of different lengths each is padded to its own
    length only (`step.ragged_update`); else one jitted scan does the step."""
    self.wait_warm_up()
    micros = self.ragged_micros(mini)
    if micros is None:
      batch = self._put_all(mini)
      self.state, metrics = step_lib.update_step(
          self.state, batch, num_micro=self.num_micro, **self._step_parts()
      )
      return dict(metrics, ragged_micro_batches=np.float32(0))
    weights = step_lib.micro_batch_weights(mini["mask_bt"][:, :-1], self.num_micro, self.loss.agg)
    micros = [self._put_all(m) for m in micros]
    weights = np.asarray(weights, np.float32)  # host values, the same on every process
    self.state, metrics = step_lib.ragged_update(self.state, micros, weights, **self._step_parts())
    # How many micro-batches were cut to their own length (0: one scanned step).
    return dict(metrics, ragged_micro_batches=np.float32(len(micros)))

  def ragged_micros(self, mini: dict) -> list[dict] | None:
    """The mini-batch's micro-batches, each cut to its own bucketed length;
    None when there is one micro-batch or all would keep the same length."""
    if self.num_micro == 1:
      return None
    mask = np.asarray(mini["mask_bt"])
    b, t = mask.shape
    size = b // self.num_micro
    # Column t scores token t + 1: a row whose last scored column is c has c + 2 tokens.
    last = np.where(mask.any(1), t - 1 - np.argmax(mask[:, ::-1] != 0, axis=1), 0)
    lengths = [
        min(experience.bucket_length(int(last[k * size : (k + 1) * size].max()) + 2), t)
        for k in range(self.num_micro)
    ]
    if min(lengths) == t:
      return None
    return [
        {key: np.asarray(v)[k * size : (k + 1) * size, :n] for key, v in mini.items()}
        for k, n in enumerate(lengths)
    ]

  # ----------------------------------------------------------------- warm-up
  @staticmethod
  def warm_up_args(s: settings_lib.Settings, longest_prompt: int) -> dict:
    """`warm_up`'s arguments for a run of settings `s` whose longest prompt
    has `longest_prompt` tokens: samples of at most that plus
    `sampling.max_tokens` (a multi-turn environment's trajectory: at most
    `engine.max_model_len`), in the chunks and with the snapshot the mode
    gives `prepare` (stream: mini-batches, scored by a copy; the others:
    the whole batch, by the live parameters)."""
    stream = s.pipeline.mode == "stream"
    longest = longest_prompt + s.sampling.max_tokens
    return dict(
        max_length=s.engine.max_model_len if s.env.name else min(longest, s.engine.max_model_len),
        chunk_sizes=(s.trainer.mini_batch_size if stream else s.samples_per_iteration,),
        snapshot_copies=(stream,),
    )

  def start_warm_up(self, max_length: int, **kwargs) -> None:
    """`warm_up` in a background thread (XLA compiles outside the GIL, so
    the caller goes on: starting the generators, a first evaluation, the
    first round). `prepare` and `update` wait for it to end, so a program is
    never compiled twice at once; `wait_warm_up` re-raises its error."""
    self._warming = concurrent.futures.Future()

    def work():
      try:
        self._warming.set_result(self.warm_up(max_length, **kwargs))
      except BaseException as e:  # pylint: disable=broad-exception-caught
        self._warming.set_exception(e)

    threading.Thread(target=work, name="streamrl-warm-up", daemon=True).start()

  def wait_warm_up(self) -> None:
    """Waits for `start_warm_up`'s thread (nothing when none runs)."""
    if self._warming is not None:
      warming, self._warming = self._warming, None
      warming.result()

  def warm_up(
      self,
      max_length: int,
      *,
      chunk_sizes: Sequence[int] = (),
      snapshot_copies: Sequence[bool] = (True, False),
  ) -> int:
    """Compiles every program `prepare` and `update` can run on samples of
    at most `max_length` tokens (prompt + response), before any exists.

    Each jitted program is lowered on abstract arguments (the shapes, dtypes
    and shardings the real calls give it) and compiled, which fills the jit
    caches the later calls read: nothing runs, and the state, its RNG and
    every array are left as they were. For each padded length L of
    `prepare`'s buckets (from `SCORE_SMALLEST_BUCKET` up to `max_length`'s):
    scoring one micro-batch's rows with the old policy (a copied snapshot
    or the live parameters, as `snapshot_copies` lists), the advantages and
    mismatch metrics of a chunk of n samples for each n of `chunk_sizes`
    (default: one mini-batch), the update step of a mini-batch and, with
    several micro-batches, the ragged step's parts (each micro-batch at its
    own length). The state an update returns gets the same programs when
    its shardings place it otherwise than the state it got. Returns how many
    programs it lowered (those jit had compiled already cost a lookup).
    """
    t0 = time.perf_counter()
    top = experience.bucket_length(max_length, SCORE_SMALLEST_BUCKET)
    lengths = sorted(
        {experience.bucket_length(n, SCORE_SMALLEST_BUCKET) for n in range(1, top + 1)}
    )
    size = self.mini_batch_size // self.num_micro
    count = 0

    def compiled(fn, *args, **kwargs):
      nonlocal count
      count += 1
      return jax.tree.map(_abstract, fn.lower(*args, **kwargs).compile().out_info)

    def on_mesh(shape, dtype):  # a host array as `_put` places it
      return jax.ShapeDtypeStruct(
          shape, dtype, sharding=sharding.batch_sharding(self.mesh, len(shape), shape=shape)
      )

    def frozen(params):  # `_frozen`: the read dtypes, in the live shardings
      if params is None:
        return None
      out = compiled(step_lib.frozen_copy, params, self.model_cfg, self.compute)
      return jax.tree.map(
          lambda c, p: jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=p.sharding), out, params
      )

    ref = jax.tree.map(_abstract, self.ref)
    host = None  # {key: dtype} of a scored and advantaged chunk
    zeros = None
    states, seen = [jax.tree.map(_abstract, self.state)], []
    while states:
      state = states.pop()
      seen.append(state)
      for copy in snapshot_copies:
        if copy:  # `snapshot(copy=True)`
          old = Snapshot(state.actor if self.lora else frozen(state.actor), frozen(state.critic))
        else:
          old = Snapshot(state.actor, state.critic)
        for length in lengths:
          scored = compiled(
              step_lib.score_batch,
              on_mesh((size, length), np.int32),
              old.actor,
              old.critic,
              ref,
              state.actor_base,
              models=self.models,
              temperature=self.sampling.temperature,
              ref_is_base=self.ref_is_base,
          )
      if host is None:
        host = {"tokens_bt": np.int32, "mask_bt": np.float32, "gen_logp_bt": np.float32}
        host.update({k: v.dtype for k, v in scored.items()})
        host.setdefault("ref_logp_bt", host["old_logp_bt"])
        for n in chunk_sizes or (self.mini_batch_size,):
          for length in lengths:
            full = {k: jax.ShapeDtypeStruct((n, length), v) for k, v in host.items()}
            adv = compiled(
                experience.compute_advantages,
                full,
                jax.ShapeDtypeStruct((n,), np.float32),
                advantage=self.advantage,
                kl=self.kl,
            )
            logp, mask = full["old_logp_bt"], full["mask_bt"]
            compiled(_mismatch_metrics, logp, full["gen_logp_bt"], mask)
        host.update({k: v.dtype for k, v in adv.items() if k != "kl_bt"})
      returned = []
      for length in lengths:
        mini = {k: on_mesh((self.mini_batch_size, length), v) for k, v in host.items()}
        out = compiled(
            step_lib.update_step, state, mini, num_micro=self.num_micro, **self._step_parts()
        )
        returned.append(out[0])
      if self.num_micro > 1:  # `step.ragged_update`'s programs
        # The first micro-batch adds into zeros, the others into the sum so
        # far. The zeros are made for real (and dropped after): a call types
        # them as uncommitted arrays, which no abstract value spells.
        with_critic = self.models.critic_def is not None
        compiled(step_lib.zero_accumulator, state, with_critic)
        if zeros is None:
          zeros = step_lib.zero_accumulator(self.state, with_critic)
        accs, done = [zeros], []
        while accs:
          acc = accs.pop()
          done.append(acc)
          for length in lengths:
            micro = {k: on_mesh((size, length), v) for k, v in host.items()}
            weight = jax.ShapeDtypeStruct((), np.float32)
            acc_out, metrics = compiled(
                step_lib.accumulate_micro, state, acc, micro, weight, **self._step_parts()
            )
            _add_new(accs, done, acc_out)
        weights = jax.ShapeDtypeStruct((self.num_micro,), np.float32)
        combine = step_lib._combine  # pylint: disable=protected-access
        compiled(combine, [metrics] * self.num_micro, weights)
        for acc in done[1:]:  # the sum of every micro-batch
          acc = jax.tree.map(_abstract, acc)
          returned.append(compiled(step_lib.apply_grads, state, acc[0], models=self.models)[0])
      for new in returned:
        _add_new(states, seen, new)
    log.info(
        "Compiled %d trainer programs for lengths up to %d in %.1f s",
        count,
        top,
        time.perf_counter() - t0,
    )
    return count

  # ------------------------------------------------------------------ export
  def policy(self) -> Transformer:
    """The actor as a Transformer (with LoRA: the base with the adapter merged)."""
    params = step_lib.actor_params(self.state.actor, self.state.actor_base, self.lora)
    return nnx.merge(self.models.actor_def, params)

  def export_weights(self, dtype=None):
    """What the generators load for a new version, in their dtype.

    Full fine-tuning: the actor as HF-named tensors, converted as read (lazy,
    `hf.HFTensors`: a consumer that walks `items()` holds one converted
    tensor at a time, never a full fp32 host copy). LoRA: only the adapter,
    PEFT-named (`lora.peft_tensors`), which the generators apply to the base
    they loaded at start.
    """
    if self.lora:
      return lora_lib.peft_tensors(self.state.actor, self.lora, dtype or self.export_dtype)
    return hf.HFTensors(self.policy(), dtype or self.export_dtype)

  def checkpoint_arrays(self) -> dict:
    """What a checkpoint holds: the train state (with LoRA without the frozen
    base, which the policy directory holds already)."""
    return {"state": self.state.replace(actor_base=None)}

  def load_checkpoint_arrays(self, arrays: dict) -> None:
    self.state = arrays["state"].replace(actor_base=self.state.actor_base)
