"""Training, online refresh, prediction and checkpoints of the length ranker.

`RankerTrainer` owns the model parameters, the optax state and (optionally) a
workdir with Orbax checkpoints and TensorBoard logs:

  trainer = RankerTrainer(config, vocab_size=64, tokenizer_fingerprint=fp, workdir=wd)
  trainer.fit(train_pairs, steps=2000, eval_pairs=eval_pairs)   # offline
  lengths = trainer.predict([prompt_ids, ...])                  # [P] float
  trainer.update(recent_pairs)                                  # each RL iteration
  trainer.save()
  trainer = RankerTrainer.restore(wd, vocab_size=64, tokenizer_fingerprint=fp)

Shapes never depend on the data beyond a few buckets: prompts are padded to
the smallest of `config.buckets` that fits and prediction batches are cut
into chunks of `config.predict_batch`, a quarter and a sixteenth of it rows
(`_row_chunks`: 70 prompts score as 64 + 16 rows of 256-row config, not 256),
so XLA compiles a handful of programs once.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from streamrl.ranker import data as ranker_data
from streamrl.ranker.losses import LOSSES, ranker_loss
from streamrl.ranker.metrics import ranking_metrics
from streamrl.ranker.model import LengthRanker

_log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
_TB_DIR = "tb"


def _row_sizes(batch: int) -> tuple[int, ...]:
  """The scorer's row counts, largest first: `batch`, a quarter and a sixteenth of it."""
  return tuple(sorted({batch, max(1, batch // 4), max(1, batch // 16)}, reverse=True))


def _row_chunks(n: int, batch: int) -> list[int]:
  """Row counts of the scorer calls that predict `n` prompts: as many
  `batch`-row calls as fill, then `batch // 4`, then `batch // 16` rows (the
  last one padded), so a round of a few dozen prompts does not pay for a full
  `batch` of padding."""
  sizes = _row_sizes(batch)
  out = []
  for size in sizes:
    while n >= size:
      out.append(size)
      n -= size
  if n > 0:
    out.append(sizes[-1])
  return out


def _buckets(config: ml_collections.ConfigDict) -> tuple[int, ...]:
  max_len = int(config.model.max_len)
  return tuple(sorted({int(b) for b in config.buckets if 0 < int(b) < max_len} | {max_len}))


def _make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  # Constant after warmup (no decay): the ranker keeps learning online during
  # RL, and a schedule that decays to zero would freeze it.
  lr = optax.warmup_constant_schedule(0.0, config.optim.lr, max(1, config.optim.warmup_steps))
  return optax.chain(
      optax.clip_by_global_norm(config.optim.clip),
      optax.adamw(lr, weight_decay=config.optim.weight_decay),
  )


class RankerTrainer:
  """Length ranker + optimizer + bookkeeping. See the module docstring."""

  def __init__(
      self,
      config: ml_collections.ConfigDict,
      *,
      vocab_size: int,
      tokenizer_fingerprint: str,
      workdir: str | None = None,
  ):
    if config.loss not in LOSSES:
      raise ValueError(f"config.loss must be one of {LOSSES}, got {config.loss!r}.")
    self.config = config
    self.vocab_size = int(vocab_size)
    self.tokenizer_fingerprint = str(tokenizer_fingerprint)
    self.workdir = workdir
    self.step = 0
    self._buckets = _buckets(config)
    # Prediction also pads to half the smallest bucket: prompts are often
    # much shorter than it, and the scorer's time grows with the padded length.
    half = self._buckets[0] // 2
    self._predict_buckets = ((half,) if half >= 8 else ()) + self._buckets
    m = config.model
    build = lambda key: LengthRanker(
        self.vocab_size,
        int(m.max_len),
        d_model=m.d_model,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        mlp_dim=m.mlp_dim,
        rngs=nnx.Rngs(key),
    )
    key = jax.random.key(config.seed)
    # One compiled program each for the initial weights and the optimizer state
    # (eager, every parameter shape's initializer would be one).
    self._graphdef = nnx.split(nnx.eval_shape(build, key))[0]
    self.params = jax.jit(lambda k: nnx.state(build(k)))(key)
    self._tx = _make_optimizer(config)
    self.opt_state = jax.jit(self._tx.init)(self.params)
    self._train_step = self._build_train_step()
    self._score = jax.jit(
        lambda params, tokens_bt, mask_bt: nnx.merge(self._graphdef, params)(tokens_bt, mask_bt)
    )
    self._writer = None
    self._ckpt = None

  # ---------------------------------------------------------------- internals

  def _build_train_step(self):
    graphdef, tx = self._graphdef, self._tx
    kind, pair_weight = self.config.loss, float(self.config.pair_weight)

    def train_step(params, opt_state, tokens_bt, mask_bt, length_b, weight_b):
      """One optimizer step; returns new (params, opt_state) and scalar metrics."""

      def loss_fn(p):
        score_b = nnx.merge(graphdef, p)(tokens_bt, mask_bt)
        return ranker_loss(score_b, length_b, weight_b, kind, pair_weight)

      (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), **terms}

    return jax.jit(train_step, donate_argnums=(0, 1))

  def _pad(
      self, prompts: Sequence[Sequence[int]], rows: int | None = None, buckets=None
  ) -> tuple[np.ndarray, np.ndarray]:
    """[rows, bucket] int32 tokens and bool mask, bucket the smallest of
    `buckets` (default: the training ones) that fits; prompts longer than
    max_len keep their head."""
    buckets = buckets or self._buckets
    max_len = buckets[-1]
    lens = [min(len(p), max_len) for p in prompts]
    need = max(lens, default=1)
    bucket = next(b for b in buckets if b >= need)
    rows = len(prompts) if rows is None else rows
    tokens = np.zeros((rows, bucket), np.int32)
    mask = np.zeros((rows, bucket), bool)
    mask[: len(lens)] = np.arange(bucket) < np.asarray(lens, np.int64)[:, None]
    flat = np.fromiter(
        itertools.chain.from_iterable(p[:n] for p, n in zip(prompts, lens)), np.int64, sum(lens)
    )
    if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
      bad = (flat < 0) | (flat >= self.vocab_size)
      i = int(np.searchsorted(np.cumsum(lens), np.argmax(bad), side="right"))
      raise ValueError(
          f"prompt {i} has token ids outside [0, {self.vocab_size}); the ranker was built for "
          f"a vocabulary of {self.vocab_size} — use a ranker trained with the policy's tokenizer."
      )
    tokens[mask] = flat  # row by row, as `flat` holds them
    return tokens, mask

  def _writer_or_none(self):
    if self._writer is None and self.workdir:
      from tensorboardX import SummaryWriter  # Only when logging is wanted.

      self._writer = SummaryWriter(os.path.join(self.workdir, _TB_DIR))
    return self._writer

  def log_scalars(self, prefix: str, metrics: dict[str, float], step: int | None = None) -> None:
    """Writes metrics to TensorBoard under `prefix/` (no-op without a workdir)."""
    writer = self._writer_or_none()
    if writer is None:
      return
    for k, v in metrics.items():
      if v is not None and math.isfinite(float(v)):
        writer.add_scalar(f"{prefix}/{k}", float(v), self.step if step is None else step)
    writer.flush()

  # ------------------------------------------------------------------ public

  def fit(
      self,
      pairs: Sequence[ranker_data.Pair],
      steps: int,
      *,
      eval_pairs: Sequence[ranker_data.Pair] = (),
      log_every: int | None = None,
      eval_every: int | None = None,
      prefix: str = "train",
  ) -> dict[str, float]:
    """Trains `steps` steps on minibatches drawn uniformly from `pairs`.

    Returns the mean training metrics over the last `log_every` steps, plus
    eval metrics (prefixed "eval_") when `eval_pairs` is given.
    """
    if not pairs:
      raise ValueError("no (prompt, length) pairs to train the ranker on; generate some first.")
    log_every = log_every or self.config.log_every
    eval_every = eval_every or self.config.eval_every
    prompts = [p for p, _ in pairs]
    lengths = np.asarray([n for _, n in pairs], np.float32)
    bsz = int(self.config.batch_size)
    weight = np.ones((bsz,), np.float32)
    window: list[dict] = []
    out: dict[str, float] = {}
    # Seeded by (seed, step) so a restored trainer draws the same minibatches
    # as the one that saved it.
    rng = np.random.default_rng([int(self.config.seed), self.step])
    for _ in range(steps):
      idx = rng.integers(len(pairs), size=bsz)
      tokens, mask = self._pad([prompts[i] for i in idx])
      self.params, self.opt_state, m = self._train_step(
          self.params, self.opt_state, tokens, mask, lengths[idx], weight
      )
      self.step += 1
      window.append(m)
      if self.step % log_every == 0 or _ == steps - 1:
        out = {k: float(np.mean([float(w[k]) for w in window])) for k in window[0]}
        self.log_scalars(prefix, out)
        window = []
      if eval_pairs and (self.step % eval_every == 0 or _ == steps - 1):
        ev = self.evaluate(eval_pairs)
        self.log_scalars("eval", ev)
        out.update({f"eval_{k}": v for k, v in ev.items()})
    return out

  def compile_all(self, train: bool = True) -> None:
    """Compiles the scorer (and with `train` the train step) for every prompt
    bucket now, on dummy inputs (parameters, optimizer state and step stay as
    they are), so no refresh or prediction of a run pays a compile. A ranker
    beside the generators (`RankerActor`) shares their cores: a compile there
    stalled the first rounds' generation by 10 s or more
    (experiments/bench_modes.py)."""
    bsz, batch = int(self.config.batch_size), int(self.config.predict_batch)
    ones = np.ones((bsz,), np.float32)
    for b in self._predict_buckets:
      if train and b in self._buckets:
        params, opt_state = jax.tree.map(jnp.copy, (self.params, self.opt_state))
        out = self._train_step(
            params, opt_state, np.zeros((bsz, b), np.int32), np.ones((bsz, b), bool), ones, ones
        )
        jax.block_until_ready(out)
      for rows in _row_sizes(batch):
        jax.block_until_ready(
            self._score(self.params, np.zeros((rows, b), np.int32), np.ones((rows, b), bool))
        )

  def param_leaves(self) -> list[np.ndarray]:
    """The parameters as host arrays (leaf order of the pytree): what a
    ranker of the same config needs to predict as this one does
    (`set_param_leaves`)."""
    return [np.asarray(x) for x in jax.tree.leaves(self.params)]

  def set_param_leaves(self, leaves: Sequence[np.ndarray]) -> None:
    """Takes `param_leaves()` of a ranker of the same config (prediction only:
    the optimizer state stays as it is)."""
    old = jax.tree.leaves(self.params)
    if len(leaves) != len(old) or any(np.shape(a) != b.shape for a, b in zip(leaves, old)):
      raise ValueError("parameters of a ranker of another config; build both from one config.")
    self.params = jax.tree.unflatten(
        jax.tree.structure(self.params), [jnp.asarray(a, b.dtype) for a, b in zip(leaves, old)]
    )

  def update(self, pairs: Sequence[ranker_data.Pair], steps: int | None = None) -> dict[str, float]:
    """Online refresh: fine-tunes on the most recent `config.online.window` pairs.

    Called by the RL loop once per iteration with that iteration's (prompt,
    generated length) pairs appended to the history. Before training, the
    current model is scored on the newest pairs (the "pre_" metrics): they
    were not seen yet, so this is an honest held-out measure of how well the
    ranker tracked the drifting policy.
    """
    recent = list(pairs)[-int(self.config.online.window) :]
    if not recent:
      return {}
    out = {}
    newest = recent[-int(self.config.online.eval_newest) :]
    if len(newest) >= 20:
      out.update({f"pre_{k}": v for k, v in self.evaluate(newest).items()})
      self.log_scalars("online", {k: v for k, v in out.items()})
    steps = int(self.config.online.steps if steps is None else steps)
    if steps > 0:
      out.update(self.fit(recent, steps, log_every=steps, prefix="online"))
    return out

  def predict(self, prompt_ids_list: Sequence[Sequence[int]]) -> np.ndarray:
    """Predicted output lengths [P] (float64) for a list of prompts' token ids.

    With config.loss="mse" these are lengths in tokens; with "pairwise" only
    their order is meaningful (which is all the dispatcher uses).
    """
    n = len(prompt_ids_list)
    scores = np.zeros((n,), np.float64)
    # Shortest first, so that short prompts share calls padded to a short bucket.
    by_len = sorted(range(n), key=lambda i: len(prompt_ids_list[i]))
    outs = []
    s = 0
    for rows in _row_chunks(n, int(self.config.predict_batch)):  # A few row counts per bucket.
      part = by_len[s : s + rows]
      tokens, mask = self._pad(
          [prompt_ids_list[i] for i in part], rows=rows, buckets=self._predict_buckets
      )
      outs.append((part, self._score(self.params, tokens, mask)))  # dispatched, not waited for
      s += len(part)
    for part, out in outs:
      scores[part] = np.asarray(out)[: len(part)]
    return np.expm1(scores)

  def evaluate(self, pairs: Sequence[ranker_data.Pair]) -> dict[str, float]:
    """Recall of the longest 20/10/5 %, Spearman rho and log-MSE (not for "pairwise") on `pairs`."""
    pred = self.predict([p for p, _ in pairs])
    true = np.asarray([n for _, n in pairs], np.float64)
    out = ranking_metrics(pred, true)
    # Pairwise-trained scores are not lengths, so their log-error means nothing.
    out["log_mse"] = (
        math.nan
        if self.config.loss == "pairwise"
        else float(np.mean((np.log1p(pred) - np.log1p(true)) ** 2))
    )
    return out

  # ------------------------------------------------------------- checkpoints

  def _manager(self) -> ocp.CheckpointManager:
    if not self.workdir:
      raise ValueError("this RankerTrainer has no workdir; pass workdir=... to save checkpoints.")
    if self._ckpt is None:
      self._ckpt = ocp.CheckpointManager(
          os.path.abspath(os.path.join(self.workdir, CHECKPOINT_DIR)),
          options=ocp.CheckpointManagerOptions(
              max_to_keep=int(self.config.max_to_keep), create=True
          ),
      )
    return self._ckpt

  def save(self) -> str:
    """Saves params, optimizer state, step, config and tokenizer identity; returns the path."""
    mngr = self._manager()
    meta = {
        "step": self.step,
        "vocab_size": self.vocab_size,
        "tokenizer_fingerprint": self.tokenizer_fingerprint,
        "config": json.loads(self.config.to_json()),
    }
    state = {"params": self.params, "opt_state": self.opt_state}
    mngr.save(
        self.step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_np_tree(state)), meta=ocp.args.JsonSave(meta)
        ),
        force=True,
    )
    mngr.wait_until_finished()
    return os.path.join(mngr.directory, str(self.step))

  @classmethod
  def restore(
      cls, workdir: str, *, vocab_size: int, tokenizer_fingerprint: str, step: int | None = None
  ) -> "RankerTrainer":
    """Rebuilds a trainer from `workdir`'s latest (or given) checkpoint.

    Refuses (ValueError) a checkpoint trained for a different tokenizer or
    vocabulary size than the policy's: its token embeddings would index
    different strings and its predictions would be meaningless.
    """
    ckpt_dir = os.path.abspath(os.path.join(workdir, CHECKPOINT_DIR))
    if not os.path.isdir(ckpt_dir):
      raise FileNotFoundError(
          f"no ranker checkpoints under {ckpt_dir}; train one with "
          "launch/train_ranker.py --workdir=... first."
      )
    with ocp.CheckpointManager(ckpt_dir) as mngr:
      step = mngr.latest_step() if step is None else step
      if step is None:
        raise FileNotFoundError(f"no ranker checkpoints under {ckpt_dir}; train one first.")
      meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      if (
          int(meta["vocab_size"]) != int(vocab_size)
          or meta["tokenizer_fingerprint"] != tokenizer_fingerprint
      ):
        raise ValueError(
            f"ranker checkpoint {ckpt_dir}/{step} was trained for a tokenizer with vocab size "
            f"{meta['vocab_size']} (fingerprint {meta['tokenizer_fingerprint']}), but the policy's has "
            f"{vocab_size} ({tokenizer_fingerprint}); retrain the ranker on this policy's tokenizer "
            "(launch/train_ranker.py) or point at the matching checkpoint."
        )
      trainer = cls(
          ml_collections.ConfigDict(meta["config"]),
          vocab_size=vocab_size,
          tokenizer_fingerprint=tokenizer_fingerprint,
          workdir=workdir,
      )
      target = _np_tree({"params": trainer.params, "opt_state": trainer.opt_state})
      state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))[
          "state"
      ]
    trainer.params = jax.tree.map(jnp.asarray, state["params"])
    trainer.opt_state = jax.tree.map(jnp.asarray, state["opt_state"])
    trainer.step = int(meta["step"])
    return trainer

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None
    if self._ckpt is not None:
      self._ckpt.close()
      self._ckpt = None


def _np_tree(tree):
  """The same tree with numpy leaves (what Orbax writes and reads back)."""
  return jax.tree.map(np.asarray, tree)


def tokenizer_identity(spec: str) -> tuple[int, str]:
  """(vocab size, fingerprint) from config.tokenizer: "char" or a policy model directory."""
  if spec == "char":
    return ranker_data.char_tokenizer_fingerprint()
  return ranker_data.fingerprint_tokenizer_dir(spec)


def load_dataset(config: ml_collections.ConfigDict) -> tuple[list, list]:
  """(train, eval) pairs: from config.data.pairs_path, else synthetic tasks."""
  d = config.data
  if d.pairs_path:
    pairs = ranker_data.load_pairs(d.pairs_path)
    return ranker_data.split_pairs(pairs, d.eval_fraction, config.seed)
  task_kwargs = dict(d.task.to_dict()) if d.get("task") else {}
  train = ranker_data.synthetic_pairs(d.num_train, d.seed, **task_kwargs)
  evals = ranker_data.synthetic_pairs(d.num_eval, d.seed + 1, first_id=d.num_train, **task_kwargs)
  return train, evals


def baseline_metrics(
    eval_pairs: Sequence[ranker_data.Pair], seed: int = 0
) -> dict[str, dict[str, float]]:
  """Reference points: a random ranker and "longer prompt, longer answer"."""
  true = np.asarray([n for _, n in eval_pairs], np.float64)
  rand = np.random.default_rng(seed).random(len(eval_pairs))
  plen = np.asarray([len(p) for p, _ in eval_pairs], np.float64)
  return {"random": ranking_metrics(rand, true), "prompt_len": ranking_metrics(plen, true)}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Offline training entry point (launch/train_ranker.py); resumes from workdir.

  Returns the final held-out metrics (recall20/10/5, spearman, log_mse).
  """
  vocab_size, fingerprint = tokenizer_identity(config.tokenizer)
  train, evals = load_dataset(config)
  ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
  if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
    trainer = RankerTrainer.restore(
        workdir, vocab_size=vocab_size, tokenizer_fingerprint=fingerprint
    )
    _log.info("resumed ranker from step %d", trainer.step)
  else:
    trainer = RankerTrainer(
        config, vocab_size=vocab_size, tokenizer_fingerprint=fingerprint, workdir=workdir
    )
  for name, m in baseline_metrics(evals, config.seed).items():
    trainer.log_scalars(f"baseline_{name}", m, step=0)
    _log.info("baseline %s: %s", name, _fmt(m))
  remaining = int(config.steps) - trainer.step
  while remaining > 0:
    # Train in checkpoint-sized chunks so an interrupted run resumes nearby.
    chunk = min(remaining, int(config.checkpoint_every))
    m = trainer.fit(train, chunk, eval_pairs=evals)
    trainer.save()
    remaining -= chunk
    _log.info("step %d: %s", trainer.step, _fmt(m))
  final = trainer.evaluate(evals)
  trainer.log_scalars("eval", final)
  trainer.close()
  return final


def _fmt(m: dict[str, float]) -> str:
  return " ".join(f"{k}={v:.4f}" for k, v in m.items())
