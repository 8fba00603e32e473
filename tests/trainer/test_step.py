"""One real `update_step` on a tiny model against the loss worked out by hand.

The batch has ragged responses, an empty row, and micro-batches (rows 0-1 |
rows 2-3) holding different numbers of tokens (7 | 8) and of sequences
(2 | 1), so any aggregation that averaged micro-batch losses naively would be
off. old_logp is computed at the sampling temperature, so the PPO ratio is
exactly 1 before the update.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl import rl
from streamrl.generator.config import Sampling
from streamrl.models.config import ComputeConfig, tiny_qwen2
from streamrl.models.transformer import Transformer
from streamrl.rl.config import Kl, Loss
from streamrl.trainer import step
from streamrl.trainer.config import Optimizer

pytestmark = [pytest.mark.unit]

VOCAB, B, T = 16, 4, 12
TEMPERATURE = 0.7
NORM = 10  # token_sum_norm's constant (sampling.max_tokens), != tokens / rows
OPTIM = Optimizer(lr=1e-3, warmup_steps=0)
DECAY = 1000  # optimizer steps the learning rate decays over
KL = Kl(coef=0.1, estimator="k3", in_reward=False)  # a loss term, GRPO style
SAMPLING = Sampling(temperature=TEMPERATURE, max_tokens=NORM)
# (first column, length) of each row's response in mask_bt.
RESPONSES = ((2, 5), (2, 2), (0, 0), (3, 8))


def loss_config(agg: str) -> Loss:
  return Loss(agg=agg, entropy_coef=0.05, rollout_correction="tis", is_cap=1.2)


def parts(cfg: Loss) -> dict:
  """The step's static run parts for loss `cfg`."""
  return dict(loss=cfg, kl=KL, sampling=SAMPLING)


def make_model(seed: int = 0) -> Transformer:
  return Transformer(tiny_qwen2(VOCAB), rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=None)
def make_batch() -> dict:
  """Batch (numpy) for the seed-0 model; old logprobs at TEMPERATURE."""
  rng = np.random.default_rng(0)
  graphdef, params = nnx.split(make_model(), nnx.Param)
  tokens = rng.integers(1, VOCAB, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i, (start, n) in enumerate(RESPONSES):
    mask[i, start : start + n] = 1.0
  old, _ = step.policy_logprobs(params, tokens, graphdef=graphdef, temperature=TEMPERATURE)
  old = np.asarray(old)
  noise = lambda scale: (scale * rng.normal(size=(B, T))).astype(np.float32)
  return {
      "tokens_bt": tokens,
      "mask_bt": mask,
      "old_logp_bt": old,
      # Generator logprobs differ, so some TIS weights are capped at 1.2.
      "gen_logp_bt": np.where(mask > 0, old + noise(0.3), 0.0).astype(np.float32),
      "ref_logp_bt": old + noise(0.2),
      "advantages_bt": noise(1.0) * mask,
      "returns_bt": np.zeros((B, T), np.float32),
      "old_values_bt": np.zeros((B, T), np.float32),
  }


def numpy_aggregate(x, mask, agg):
  """The four aggregation modes over the whole batch, in float64."""
  x = np.where(mask > 0, x, 0.0)
  n_b = mask.sum(1)
  if agg == "token_mean":
    return x.sum() / mask.sum()
  if agg == "seq_mean_token_mean":
    return np.mean([x[i].sum() / n_b[i] for i in range(len(x)) if n_b[i]])
  if agg == "seq_mean_token_sum":
    return np.mean([x[i].sum() for i in range(len(x)) if n_b[i]])
  assert agg == "token_sum_norm"
  return x.sum() / (len(x) * NORM)


def numpy_loss(logits_btv, batch, cfg: Loss) -> float:
  """The actor loss of the whole batch, by hand, from the model's logits."""
  z = np.asarray(logits_btv, np.float64)[:, :-1] / TEMPERATURE
  z = z - z.max(-1, keepdims=True)
  logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
  logp = np.take_along_axis(logp_all, batch["tokens_bt"][:, 1:, None], -1)[..., 0]
  entropy = -(np.exp(logp_all) * logp_all).sum(-1)
  mask = batch["mask_bt"][:, :-1]
  old, gen, ref = (
      batch[k][:, :-1].astype(np.float64) for k in ("old_logp_bt", "gen_logp_bt", "ref_logp_bt")
  )
  adv = batch["advantages_bt"][:, :-1]
  ratio = np.exp(np.where(mask > 0, logp - old, 0.0))
  weight = np.minimum(np.exp(np.where(mask > 0, old - gen, 0.0)), cfg.is_cap)
  clipped = np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
  policy = np.maximum(-adv * ratio, -adv * clipped) * weight
  d = ref - logp
  k3 = np.exp(d) - 1 - d
  agg = functools.partial(numpy_aggregate, mask=mask, agg=cfg.agg)
  return agg(policy) - cfg.entropy_coef * agg(entropy) + KL.coef * agg(k3)


@functools.lru_cache(maxsize=None)
def reference_grads(agg: str):
  """Gradient of the whole-batch loss built from `streamrl.rl` functions."""
  cfg, batch = loss_config(agg), make_batch()
  graphdef, params = nnx.split(make_model(), nnx.Param)
  mask = batch["mask_bt"][:, :-1]
  old, gen, ref = (batch[k][:, :-1] for k in ("old_logp_bt", "gen_logp_bt", "ref_logp_bt"))

  def loss_fn(p):
    logits = nnx.merge(graphdef, p)(batch["tokens_bt"])[:, :-1] / TEMPERATURE
    logp_all = jax.nn.log_softmax(logits, -1)
    logp = jnp.take_along_axis(logp_all, batch["tokens_bt"][:, 1:, None], -1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, -1)
    w = rl.rollout_correction_weights(old, gen, mask, "tis", is_cap=cfg.is_cap)
    kw = dict(agg=agg, norm_constant=NORM)
    policy, _ = rl.ppo_policy_loss(
        logp, old, batch["advantages_bt"][:, :-1], mask, is_weights_bt=w, **kw
    )
    kl, _ = rl.kl_loss(logp, ref, mask, estimator="k3", **kw)
    ent = rl.aggregate(entropy, mask, agg, NORM)
    return policy - cfg.entropy_coef * ent + KL.coef * kl

  return jax.jit(jax.grad(loss_fn))(params)


@functools.lru_cache(maxsize=None)
def initial_logits() -> np.ndarray:
  """[b, t, v] logits of the seed-0 model on the batch."""
  graphdef, params = nnx.split(make_model(), nnx.Param)
  return np.asarray(step.critic_values(params, make_batch()["tokens_bt"], graphdef=graphdef))


def run_update_step(cfg: Loss, num_micro: int, compute=ComputeConfig()):
  """(logits, params before, params after, metrics) of one update_step."""
  logits = initial_logits()
  models, state = step.init_state(make_model(), OPTIM, DECAY, compute=compute)
  before = jax.tree.map(np.asarray, state.actor)  # the step donates the state
  batch = {k: jnp.asarray(v) for k, v in make_batch().items()}
  state, metrics = step.update_step(state, batch, models=models, num_micro=num_micro, **parts(cfg))
  after = jax.tree.map(np.asarray, state.actor)
  return logits, before, after, {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("num_micro", [1, 2])
@pytest.mark.parametrize("agg", rl.AGG_MODES)
def test_update_step_matches_loss_and_gradient_by_hand(agg, num_micro):
  cfg = loss_config(agg)
  logits, before, after, metrics = run_update_step(cfg, num_micro)

  # Ratio exactly 1 before the update: old logprobs at the same temperature.
  assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
  assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-5)
  assert metrics["clip_frac"] == 0.0

  expected = numpy_loss(logits, make_batch(), cfg)
  assert metrics["actor_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)

  grads = reference_grads(agg)
  grad_norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads))))
  assert metrics["actor_grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
  # The parameters move as the optimizer moves them for the reference gradient.
  # Adam's first step is about lr · sign(gradient); weights whose gradient is
  # within float noise of 0 (update well below lr) are left out.
  tx = step.make_optimizer(OPTIM, lr=OPTIM.lr, decay_steps=DECAY)
  updates, _ = tx.update(grads, tx.init(grads), grads)
  checked = total = 0
  for b, a, u in zip(jax.tree.leaves(before), jax.tree.leaves(after), jax.tree.leaves(updates)):
    u = np.asarray(u)
    clear = np.abs(u) > 0.5 * OPTIM.lr
    np.testing.assert_allclose((a - b)[clear], u[clear], atol=OPTIM.lr * 0.02)
    checked, total = checked + clear.sum(), total + u.size
  assert checked > 0.99 * total


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_and_logprob_chunks_leave_the_update_unchanged(remat):
  """Rematerialised blocks and chunked logprobs (T=12 in chunks of 5, the
  last one padded) give the same loss, metrics and new parameters."""
  cfg = loss_config("seq_mean_token_mean")
  _, _, plain_after, plain = run_update_step(cfg, 2)
  _, _, after, metrics = run_update_step(cfg, 2, ComputeConfig(remat=remat, logprob_chunk=5))
  assert metrics.keys() == plain.keys()
  for k, v in plain.items():
    assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
  # One Adam step moves a weight by lr * g / (|g| + eps_adam): about lr * sign(g)
  # wherever the gradient is clear of zero, so there the two updates agree to a
  # small fraction of lr. A gradient within fp32 summation error of zero
  # (each entry sums B*T positions pairwise: ceil(log2(B*T)) * eps * the
  # entry's magnitude scale) may change sign between two orders of the same
  # sums; such a weight can move anywhere within Adam's bound of lr either way.
  grads = reference_grads("seq_mean_token_mean")
  eps = np.finfo(np.float32).eps
  for a, b, g in zip(jax.tree.leaves(plain_after), jax.tree.leaves(after), jax.tree.leaves(grads)):
    g = np.abs(np.asarray(g))
    noise = np.ceil(np.log2(B * T)) * eps * max(g.max(), 1e-30) * B * T
    clear = g > noise
    np.testing.assert_allclose(b[clear], a[clear], atol=OPTIM.lr * 1e-2)
    np.testing.assert_array_less(np.abs(b - a)[~clear], 2 * OPTIM.lr * (1 + 1e-3))
    assert clear.mean() > 0.5  # The bound leaves most weights to the tight check.


def test_bf16_compute_update_is_close_and_keeps_fp32_state():
  """bf16 compute: same step within bf16 noise; params, optimizer state and
  gradients stay fp32 (a bf16 update of 1e-3 to weights ~0.02 would round)."""
  cfg = loss_config("token_mean")
  _, before, plain_after, plain = run_update_step(cfg, 1)
  models, state = step.init_state(
      make_model(), OPTIM, DECAY, compute=ComputeConfig(dtype="bfloat16")
  )
  batch = {k: jnp.asarray(v) for k, v in make_batch().items()}
  state, metrics = step.update_step(state, batch, models=models, **parts(cfg))
  floats = [x for x in jax.tree.leaves((state.actor, state.actor_opt)) if x.dtype != jnp.int32]
  assert floats and all(x.dtype == jnp.float32 for x in floats)
  assert float(metrics["actor_loss"]) == pytest.approx(plain["actor_loss"], abs=1e-2)
  assert float(metrics["actor_grad_norm"]) == pytest.approx(plain["actor_grad_norm"], rel=5e-2)
  leaves = zip(jax.tree.leaves(state.actor), jax.tree.leaves(before))
  moved = [np.abs(np.asarray(a) - b).max() for a, b in leaves]
  assert min(moved) > 0


def test_old_token_mean_normaliser_would_differ():
  # Guards the test above: with token_sum_norm the expected loss really
  # differs from the batch's token mean (what the step used to compute).
  batch = make_batch()
  mask = batch["mask_bt"][:, :-1]
  assert mask.sum() != B * NORM
  logits = initial_logits()
  sum_norm = numpy_loss(logits, batch, loss_config("token_sum_norm"))
  token_mean = numpy_loss(logits, batch, loss_config("token_mean"))
  assert sum_norm == pytest.approx(token_mean * mask.sum() / (B * NORM), rel=1e-9)
  assert sum_norm != pytest.approx(token_mean, rel=1e-2)


@pytest.mark.parametrize("agg", rl.AGG_MODES)
def test_micro_batch_weights_reproduce_the_whole_batch(agg):
  # Pure numpy check of the weights against numpy_aggregate.
  rng = np.random.default_rng(1)
  mask = make_batch()["mask_bt"][:, :-1]
  x = rng.normal(size=mask.shape)
  w = np.asarray(step.micro_batch_weights(mask, 2, agg))
  assert w.sum() == pytest.approx(1.0)
  parts = []
  for k, rows in enumerate((slice(0, 2), slice(2, 4))):
    if agg == "token_sum_norm":
      part = np.where(mask[rows] > 0, x[rows], 0).sum() / (2 * NORM)
    else:
      part = numpy_aggregate(x[rows], mask[rows], agg)
    parts.append(w[k] * part)
  assert sum(parts) == pytest.approx(numpy_aggregate(x, mask, agg), rel=1e-6)
  np.testing.assert_array_equal(
      step.micro_batch_weights(np.zeros((4, 3)), 2, agg), 0.0 if agg != "token_sum_norm" else 0.5
  )


def test_the_step_refuses_a_loss_it_cannot_run():
  with pytest.raises(ValueError, match="loss aggregation"):
    step.check_loss(Loss(agg="mean"))
  with pytest.raises(ValueError, match="Loss.resolved"):
    step.check_loss(Loss(rollout_correction="auto"))
  step.check_loss(Loss().resolved("async"))


def test_equal_models_and_configs_share_the_compiled_step():
  batch = {k: jnp.asarray(v) for k, v in make_batch().items()}
  cfg = loss_config("token_mean")
  built = [
      step.init_state(make_model(seed), Optimizer(lr=1e-3, warmup_steps=0), DECAY)
      for seed in (0, 1)
  ]
  (models_a, state_a), (models_b, state_b) = built
  assert models_a == models_b and hash(models_a) == hash(models_b)
  assert models_a != step.Models(models_a.actor_def, Optimizer(lr=2e-3, warmup_steps=0), DECAY)
  step.update_step(state_a, batch, models=models_a, **parts(cfg))
  compiled = step.update_step._cache_size()
  step.update_step(state_b, batch, models=models_b, **parts(cfg))
  assert step.update_step._cache_size() == compiled


def test_the_trainer_scores_at_the_sampling_temperature():
  # The loss must score tokens at the temperature the generators sampled
  # with, or the PPO ratio is not 1 even before the first update; and
  # token_sum_norm divides by the generators' max_tokens.
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top
  from streamrl.trainer import rl_trainer  # pylint: disable=g-import-not-at-top

  s = settings.Settings().replace(
      sampling=settings.Sampling(temperature=TEMPERATURE, max_tokens=40),
      loss=settings.Loss(agg="token_sum_norm"),
  )
  trainer = rl_trainer.RLTrainer.from_settings(make_model(), s)
  parts = trainer._step_parts()  # pylint: disable=protected-access
  assert parts["sampling"].temperature == TEMPERATURE
  assert parts["sampling"].max_tokens == 40
  assert parts["loss"].agg == "token_sum_norm"
  assert parts["loss"].rollout_correction == "none"  # auto, resolved for sync mode
