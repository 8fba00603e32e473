"""RLTrainer precision and placement: compute dtype from settings, the critic
created in its sharding, frozen copies (reference, old policy) stored in the
dtypes the forward pass reads, and one real update under bf16 + remat +
chunked logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl.config import settings
from streamrl.generator.rollout import Sample
from streamrl.models import config as model_config
from streamrl.models import transformer
from streamrl.trainer import rl_trainer, sharding

pytestmark = [pytest.mark.unit]

MESH = {"data": 1, "fsdp": 2, "tensor": 4}


def make_settings(**trainer) -> settings.Settings:
  s = settings.Settings()
  return s.replace(
      trainer=dataclasses.replace(s.trainer, mini_batch_size=4, micro_batch_size=2, **trainer),
      mesh=settings.Mesh(**MESH),
  )


def samples(n=4, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = tuple(int(x) for x in rng.integers(3, 64, 4 + i))
    resp = tuple(int(x) for x in rng.integers(3, 64, 6 + 2 * i))
    logp = tuple(float(x) for x in -rng.uniform(2, 5, len(resp)))
    out.append(Sample(i, prompt, resp, logp, "length", 0, 0))
  return out


def policy(seed=1):
  return transformer.Transformer(model_config.tiny_qwen2(64), rngs=nnx.Rngs(seed))


@pytest.mark.parametrize(
    "model_dtype,compute_dtype,want",
    [
        ("float32", "auto", "float32"),
        ("bfloat16", "auto", "bfloat16"),
        ("float16", "auto", "float32"),  # fp16 training would need loss scaling
        ("float32", "bfloat16", "bfloat16"),
        ("bfloat16", "float32", "float32"),
    ],
)
def test_compute_dtype_auto_follows_the_generators(model_dtype, compute_dtype, want):
  s = make_settings(compute_dtype=compute_dtype, remat="dots", logprob_chunk=64)
  s = s.replace(model=dataclasses.replace(s.model, dtype=model_dtype))
  c = s.trainer.compute(s.model.dtype)
  assert c == model_config.ComputeConfig(want, True, "dots", 64)


def test_the_critic_is_created_in_its_sharding(monkeypatch):
  """Every critic parameter comes out sharded by its logical axes, and the
  critic's constructor only ever runs under tracing (eval_shape, jit): no
  concrete unsharded critic exists on any device."""
  concrete = []
  real_param = transformer._param

  def spy(rngs, init, shape, axes, dtype=jnp.float32):
    p = real_param(rngs, init, shape, axes, dtype)
    concrete.append(not isinstance(p[...], jax.core.Tracer))
    return p

  model = policy()
  monkeypatch.setattr(transformer, "_param", spy)
  trainer = rl_trainer.RLTrainer.from_settings(model, make_settings())
  monkeypatch.undo()
  assert concrete and not any(concrete)
  mesh = trainer.mesh
  state = nnx.state(nnx.merge(trainer.models.critic_def, trainer.state.critic), nnx.Param)
  sharded = 0
  for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
    axes = var.get_metadata().get("logical_axes") or ()
    value = var[...]
    want = sharding.logical_to_spec(axes, sharding.DEFAULT_RULES, mesh, value.shape)
    assert value.sharding.spec == want
    sharded += any(want)
  assert sharded > 10
  # The trunk starts as the policy's; the value head at zero.
  np.testing.assert_array_equal(
      trainer.state.critic["trunk"]["embedding_vd"][...],
      trainer.state.actor["trunk"]["embedding_vd"][...],
  )
  assert not np.any(np.asarray(trainer.state.critic["w_value_d"][...]))


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_frozen_copies_are_stored_in_the_read_dtypes_and_score_as_the_live_params(
    compute_dtype,
):
  s = make_settings(compute_dtype=compute_dtype)
  trainer = rl_trainer.RLTrainer.from_settings(policy(), s)
  ref = {
      jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(trainer.ref)[0]
  }
  mm = jnp.bfloat16 if compute_dtype == "bfloat16" else jnp.float32
  assert ref["['trunk']['blocks'][0]['attn']['w_q_dhn'].value"].dtype == mm
  assert ref["['trunk']['blocks'][1]['mlp']['w_down_fd'].value"].dtype == mm
  # fp32 LM head (tied: the embedding) and norm scales stay fp32.
  assert ref["['trunk']['embedding_vd'].value"].dtype == jnp.float32
  assert ref["['trunk']['final_norm']['scale'].value"].dtype == jnp.float32
  # The master weights stay fp32.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.state.actor))
  opt = [x for x in jax.tree.leaves(trainer.state.actor_opt) if x.dtype != jnp.int32]
  assert opt and all(x.dtype == jnp.float32 for x in opt)
  old = trainer.snapshot()
  assert jax.tree.leaves(old.actor)[3].dtype == mm
  batch = trainer.score(samples(), old)
  live = trainer.score(samples(), trainer.snapshot(copy=False))
  # Reference = old = live before any update: exactly, not just closely.
  np.testing.assert_array_equal(batch["ref_logp_bt"], batch["old_logp_bt"])
  np.testing.assert_array_equal(batch["old_logp_bt"], live["old_logp_bt"])
  np.testing.assert_array_equal(batch["old_values_bt"], live["old_values_bt"])


def test_a_bf16_remat_chunked_update_matches_fp32_closely():
  """prepare + update under bf16 compute, remat and chunked logprobs against
  the fp32 defaults: same batch (up to bf16 scoring), similar loss, finite
  gradients, parameters still fp32."""
  out = {}
  for name, kw in {
      "fp32": dict(compute_dtype="float32", logprob_chunk=0),
      "bf16": dict(compute_dtype="bfloat16", remat="full", logprob_chunk=8),
  }.items():
    trainer = rl_trainer.RLTrainer.from_settings(policy(), make_settings(**kw))
    rewards = [1.0, 0.0, 0.5, 0.25]
    minis, metrics = trainer.prepare(samples(), rewards, trainer.snapshot(copy=False))
    assert metrics["kl_ref"] == 0.0
    step_metrics = {k: float(v) for k, v in trainer.update(minis[0]).items()}
    assert all(np.isfinite(v) for v in step_metrics.values())
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.state.actor))
    out[name] = step_metrics
  assert out["bf16"]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
  assert out["bf16"]["actor_loss"] == pytest.approx(out["fp32"]["actor_loss"], abs=2e-2)
  assert out["bf16"]["critic_loss"] == pytest.approx(out["fp32"]["critic_loss"], rel=5e-2)


def long_tailed_samples(lengths, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(lengths):
    prompt = tuple(int(x) for x in rng.integers(3, 64, 5))
    resp = tuple(int(x) for x in rng.integers(3, 64, n))
    logp = tuple(float(x) for x in -rng.uniform(2, 5, n))
    out.append(Sample(i, prompt, resp, logp, "stop", 0, 0))
  return out


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_padded_to_their_own_length_take_the_same_step(monkeypatch, agg):
  """A long-tailed mini-batch: the short micro-batch is cut to its own length
  (and scored so), and the step, its losses and metrics equal those of the
  mini-batch padded to its longest row in one scan."""
  lengths = [3, 90, 5, 8]  # Sorted into micro-batches [3, 5] and [8, 90].
  rewards = [1.0, 0.0, 0.5, 0.25]
  out = {}
  for name in ("ragged", "padded"):
    s = make_settings()
    s = s.replace(loss=dataclasses.replace(s.loss, agg=agg))
    trainer = rl_trainer.RLTrainer.from_settings(policy(), s)
    if name == "padded":
      monkeypatch.setattr(trainer, "ragged_micros", lambda mini: None)
    minis, _ = trainer.prepare(long_tailed_samples(lengths), rewards, trainer.snapshot())
    (mini,) = minis
    if name == "ragged":
      micros = trainer.ragged_micros(mini)
      assert [m["tokens_bt"].shape for m in micros] == [(2, 32), (2, 96)]
      assert mini["tokens_bt"].shape == (4, 96)
    metrics = {k: float(v) for k, v in trainer.update(mini).items()}
    out[name] = (metrics, jax.tree.map(np.asarray, trainer.state.actor))
  (m_r, p_r), (m_p, p_p) = out["ragged"], out["padded"]
  assert m_r.keys() == m_p.keys()
  assert (m_r.pop("ragged_micro_batches"), m_p.pop("ragged_micro_batches")) == (2, 0)
  for k in m_p:
    assert m_r[k] == pytest.approx(m_p[k], rel=1e-4, abs=1e-6), k
  for a, b in zip(jax.tree.leaves(p_r), jax.tree.leaves(p_p)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_mask_truncated_keeps_the_reward_in_the_baseline_and_drops_the_tokens():
  s = make_settings()
  s = s.replace(
      advantage=dataclasses.replace(
          s.advantage, estimator="grpo", group_size=4, use_critic=False, whiten=False
      ),
  )
  cut = [
      dataclasses.replace(x, finish_reason="stop" if x.prompt_id % 2 else "length")
      for x in samples()
  ]
  rewards = [1.0, 0.0, 0.5, 0.25]
  out = {}
  for flag in (False, True):
    t = rl_trainer.RLTrainer.from_settings(
        policy(), s.replace(loss=dataclasses.replace(s.loss, mask_truncated=flag))
    )
    minis, _ = t.prepare(cut, rewards, t.snapshot(copy=False))
    out[flag] = {
        k: np.concatenate([m[k].sum(1) for m in minis]) for k in ("mask_bt", "advantages_bt")
    }
  on, off = out[True], out[False]
  # Truncated responses (0 and 2, wherever the length sort put them) have no tokens in the loss...
  assert (on["mask_bt"] == 0).sum() == 2 and (off["mask_bt"] == 0).sum() == 0
  # ...and every advantage is the one computed with all four rewards in the group.
  np.testing.assert_allclose(on["advantages_bt"], off["advantages_bt"])
  assert np.abs(off["advantages_bt"]).sum() > 0
