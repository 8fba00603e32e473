"""The trainer's memory plan against XLA's own accounting, and its verdicts on the GPU recipes."""

import dataclasses

import jax
import numpy as np
import pytest

from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.models import transformer
from streamrl.models.config import ComputeConfig, ModelConfig
from streamrl.models.lora import LoraSpec, parse_targets
from streamrl.rl.config import Loss
from streamrl.trainer import memory_plan, sharding, step
from streamrl.trainer.config import Optimizer
from streamrl.trainer.rl_trainer import critic_from_policy

pytestmark = [pytest.mark.unit]

SMALL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    tie_embeddings=True,
    qkv_bias=True,
)
GPU = int(0.9 * 80 * 2**30)  # an 80 GB GPU at the trainer's memory fraction


def _compiled_step_bytes(cfg, compute, rows, seq_len, num_micro, critic, lora=None) -> int:
  """Arguments + outputs not aliased to them + temporaries of the compiled train step."""
  mesh = sharding.make_mesh({"fsdp": 1})
  policy = sharding.random_init(
      lambda r: transformer.Transformer(cfg, rngs=r), mesh, 0, transformer.initializer
  )
  models, state = step.init_state(
      policy,
      Optimizer(lr=1e-5, warmup_steps=0),
      100,
      critic_from_policy(policy, mesh) if critic else None,
      compute=compute,
      lora=lora,
  )
  rng = np.random.default_rng(0)
  batch = {
      k: np.zeros((rows, seq_len), np.float32)
      for k in ("mask_bt", "old_logp_bt", "gen_logp_bt", "ref_logp_bt", "advantages_bt")
  }
  batch.update(returns_bt=batch["mask_bt"], old_values_bt=batch["mask_bt"])
  batch["tokens_bt"] = rng.integers(0, cfg.vocab_size, (rows, seq_len)).astype(np.int32)
  loss = Loss(rollout_correction="none")
  m = (
      step.update_step.lower(state, batch, models=models, loss=loss, num_micro=num_micro)
      .compile()
      .memory_analysis()
  )
  return (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      - m.alias_size_in_bytes
      + m.temp_size_in_bytes
  )


# The 0.5B recipe's width and compute (configs/grpo_qwen0_5b_cpu.py), on fewer layers.
WIDE = dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_heads=14)
RECIPE = dict(dtype="bfloat16", fp32_lm_head=False, logprob_chunk=64)


@pytest.mark.parametrize(
    "over,rows,seq_len,num_micro,critic,lora,compute",
    [
        (dict(), 8, 128, 2, False, False, {}),
        (dict(num_layers=8), 4, 256, 1, False, False, {}),
        (dict(vocab_size=16384, tie_embeddings=False), 8, 128, 1, True, False, {}),
        # LoRA under bf16 compute: the adapter beside a bf16 base, whose dots XLA's CPU
        # backend runs without fp32 copies of the weights.
        (dict(vocab_size=32000), 8, 128, 2, False, True, dict(dtype="bfloat16")),
        (dict(WIDE, num_kv_heads=2), 4, 160, 2, False, True, RECIPE),
    ],
)
def test_the_plan_of_a_train_step_is_within_20_percent_of_xlas_own(
    over, rows, seq_len, num_micro, critic, lora, compute
):
  cfg = ModelConfig(**dict(SMALL, **over))
  compute = ComputeConfig(**compute)
  spec = LoraSpec(rank=16, alpha=32.0, targets=parse_targets("all")) if lora else None
  want = _compiled_step_bytes(cfg, compute, rows, seq_len, num_micro, critic, spec)
  t = memory_plan.Trainee(
      cfg,
      compute,
      micro_batch_size=rows // num_micro,
      seq_len=seq_len,
      lora_params=memory_plan.lora_params(cfg, spec) if lora else 0,
      critic=critic,
      snapshot=False,
      platform=jax.devices()[0].platform,
  )
  got = memory_plan.plan(t, 1 << 40, "cpu", 1).total
  assert abs(got / want - 1) <= 0.2, (got, want)


def _gpu_trainee(name: str, **changes):
  from experiments import trainer_workload  # pylint: disable=g-import-not-at-top

  s = settings.from_config(config_lib.load_config(f"configs/{name}.py"), check_files=False)
  model = {"ppo_qwen2_5_7b": "qwen2_5_7b", "ppo_qwen2_5_1_5b": "qwen2_1_5b"}[name]
  t = memory_plan.trainee(s, trainer_workload.model_config(model), "gpu")
  return dataclasses.replace(t, **changes)


@pytest.mark.parametrize("name", ["ppo_qwen2_5_7b", "ppo_qwen2_5_1_5b"])
def test_the_shipped_gpu_recipes_fit_their_gpus(name):
  t = _gpu_trainee(name)
  p = memory_plan.plan(t, GPU, "H100", t.fsdp)
  assert p.fits, p.table()
  p.check()


def test_a_7b_ppo_with_a_critic_on_four_gpus_is_refused_in_one_sentence():
  t = _gpu_trainee("ppo_qwen2_5_7b", critic=True)
  p = memory_plan.plan(t, GPU, "H100", 4)
  assert not p.fits
  fix = memory_plan.advice(t, GPU, "H100", 4)
  assert "GRPO without a critic" in fix
  with pytest.raises(UserError) as e:
    p.check(fix)
  text = str(e.value)
  assert text.count(". ") == 0 and text.endswith(".") and "GiB per device" in text
  assert "critic" in text
  # Less memory per GPU: the plan names the next cheapest change that fits, or more GPUs.
  small = memory_plan.advice(t, 24 * 2**30, "L4", 4)
  assert "more trainer devices" in small or "LoRA" in small


def test_remat_auto_is_resolved_before_the_trainer_is_built():
  from experiments import trainer_workload  # pylint: disable=g-import-not-at-top

  s = settings.from_config(config_lib.load_config("configs/ppo.py"), check_files=False)
  assert s.trainer.remat == "auto"
  cfg = trainer_workload.model_config("smoke_small")
  # On CPU remat saves nothing (XLA's CPU compiler drops it): "auto" is "none".
  assert memory_plan.resolve_remat(s, cfg).trainer.remat == "none"
  chosen = s.replace(trainer=dataclasses.replace(s.trainer, remat="dots"))
  assert memory_plan.resolve_remat(chosen, cfg).trainer.remat == "dots"


def test_measured_memory_counts_the_live_arrays_and_the_process():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  before = memory_plan.measured()
  x = jnp.ones((64, 2**20), jnp.float32)  # 0.25 GiB
  after = memory_plan.measured()
  assert after["memory/trainer_live_arrays_gb"] - before[
      "memory/trainer_live_arrays_gb"
  ] == pytest.approx(0.25)
  assert after["memory/trainer_peak_rss_gb"] >= after["memory/trainer_rss_gb"] > 0.25
  del x
