"""LoRA delivery: vLLM runs the base it loaded at start plus the adapter the
trainer sends for each version, and its logprobs are the trainer's."""

import dataclasses

import numpy as np
import pytest

from streamrl.config import settings
from streamrl.generator.vllm_engine import GeneratorInstance
from streamrl.models import config, hf, lora, tiny
from streamrl.trainer import rl_trainer
from tests.generator.test_vllm_engine import max_logprob_error
from tests.trainer.test_rl_trainer import samples

pytestmark = [pytest.mark.engine]


def lora_settings(rank):
  s = settings.Settings()
  return s.replace(
      trainer=dataclasses.replace(
          s.trainer, mini_batch_size=4, micro_batch_size=4, lora_rank=rank, lora_alpha=2.0 * rank
      ),
      optimizer=dataclasses.replace(s.optimizer, lr=3e-2, warmup_steps=0),
      advantage=dataclasses.replace(s.advantage, estimator="grpo", use_critic=False, group_size=4),
  )


@pytest.mark.parametrize("rank", [4])
def test_base_plus_adapter_on_vllm_scores_as_the_trainer_after_two_updates(rank, tmp_path):
  cfg = config.tiny_qwen2(64)
  path = tiny.build_tiny_model_dir(str(tmp_path / "m"), cfg, seed=7)
  _, policy = hf.load_hf(path)
  trainer = rl_trainer.RLTrainer.from_settings(policy, lora_settings(rank))
  gen = GeneratorInstance(path, max_num_seqs=8, max_model_len=128, seed=0, lora_rank=rank)
  try:
    err0, _ = max_logprob_error(gen, trainer.policy())
    assert err0 < 1e-3
    base = hf.to_hf_tensors(trainer.policy())
    for version in (1, 2):
      minis, _ = trainer.prepare(samples(), [1.0, 0.0, 0.5, 0.25], trainer.snapshot())
      for m in minis:
        trainer.update(m)
      update = trainer.export_weights()
      assert lora.is_adapter(update)
      assert sum(x.nbytes for x in update.values()) < sum(x.nbytes for x in base.values()) / 4
      assert gen.update_weights(update, version) == version
      err, out = max_logprob_error(gen, trainer.policy(), seed=version)
      assert err < 1e-3, (version, err)
      assert {s.weight_version for s in out} == {version}
    # The adapter moved the policy: the base alone no longer scores like it.
    _, base_model = hf.load_hf(path)
    moved, _ = max_logprob_error(gen, base_model, seed=3)
    assert moved > 1e-2
  finally:
    gen.close()
