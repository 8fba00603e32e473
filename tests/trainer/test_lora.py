"""LoRA in the trainer: only the adapter trains, the base is the reference,
the PEFT tensors the generators receive rebuild the merged weights, and a
checkpoint holds the adapter and resumes it."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.models import hf, lora
from streamrl.trainer import checkpoint as checkpoint_lib
from streamrl.trainer import rl_trainer
from tests.trainer.test_rl_trainer import make_settings, policy, samples

pytestmark = [pytest.mark.unit]


def lora_trainer(critic=True, **extra):
  s = make_settings(lora_rank=4, lora_alpha=8.0, **extra)
  s = s.replace(
      kl=dataclasses.replace(s.kl, use_reference=True),
      advantage=dataclasses.replace(
          s.advantage, use_critic=critic, estimator="gae" if critic else "grpo", group_size=4
      ),
  )
  return rl_trainer.RLTrainer.from_settings(policy(), s)


def train_twice(t):
  for _ in range(2):
    minis, _ = t.prepare(samples(), [1.0, 0.0, 0.5, 0.25], t.snapshot())
    for m in minis:
      t.update(m)


def test_only_the_adapter_trains_and_the_base_is_the_reference():
  t = lora_trainer()
  base = jax.tree.map(np.asarray, t.state.actor_base)
  before = t.score(samples(), t.snapshot())
  # A fresh adapter is the base exactly: old policy == reference.
  np.testing.assert_array_equal(before["old_logp_bt"], before["ref_logp_bt"])
  train_twice(t)
  # The optimizer holds adapter-shaped state only; the base never moved.
  adapter_shapes = {x.shape for x in jax.tree.leaves(t.state.actor)}
  opt_shapes = {x.shape for x in jax.tree.leaves(t.state.actor_opt) if x.ndim}
  assert opt_shapes <= adapter_shapes and max(np.prod(s) for s in opt_shapes) < 64 * 64
  jax.tree.map(np.testing.assert_array_equal, base, jax.tree.map(np.asarray, t.state.actor_base))
  after = t.score(samples(), t.snapshot())
  assert np.abs(after["old_logp_bt"] - before["old_logp_bt"]).max() > 1e-4
  np.testing.assert_array_equal(after["ref_logp_bt"], before["ref_logp_bt"])


def test_the_peft_tensors_rebuild_the_merged_weights():
  t = lora_trainer(lora_targets="q,o,down")
  train_twice(t)
  base = hf.to_hf_tensors(rl_trainer.nnx.merge(t.models.actor_def, t.state.actor_base), "float32")
  merged = hf.to_hf_tensors(t.policy(), "float32")
  peft = t.export_weights()
  assert lora.is_adapter(peft) and len(peft) == 2 * 3 * t.model_cfg.num_layers
  changed = set()
  for name, w in merged.items():
    module = name.removeprefix("model.layers.").removesuffix(".weight")
    a_name = f"{lora.PEFT_PREFIX}{module}.lora_A.weight"
    want = base[name]
    if a_name in peft:
      want = want + peft[a_name.replace("lora_A", "lora_B")] @ peft[a_name]
      changed.add(name.split(".", 3)[-1])
    np.testing.assert_allclose(w, want, atol=1e-6, err_msg=name)
  assert changed == {"self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"}


def test_a_checkpoint_holds_the_adapter_and_resumes_it(tmp_path):
  t = lora_trainer(critic=False)
  train_twice(t)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ck"), fingerprint={"lora": 4})
  ckpt.save(3, t.checkpoint_arrays(), {})
  arrays_bytes = sum(f.stat().st_size for f in (tmp_path / "ck").rglob("*") if f.is_file())
  u = lora_trainer(critic=False)
  _, arrays, _ = ckpt.restore(u.checkpoint_arrays())
  u.load_checkpoint_arrays(arrays)
  jax.tree.map(np.testing.assert_array_equal, t.state.actor, u.state.actor)
  jax.tree.map(np.testing.assert_array_equal, t.state.actor_opt, u.state.actor_opt)
  a = t.score(samples(), t.snapshot())["old_logp_bt"]
  np.testing.assert_array_equal(a, u.score(samples(), u.snapshot())["old_logp_bt"])
  ckpt.close()
  # The frozen base is not in it: the policy's weights alone are larger.
  base_bytes = sum(x.nbytes for x in jax.tree.leaves(t.state.actor_base))
  assert 0 < arrays_bytes < base_bytes


@pytest.mark.parametrize(
    "key,value,fix",
    [
        ("lora_rank", -1, "lora_rank"),
        ("lora_targets", "q,attn", "lora_targets"),
        ("lora_rank", 1024, "smaller rank"),
    ],
)
def test_bad_lora_settings_name_the_fix(key, value, fix):
  s = settings.Settings()
  with pytest.raises(UserError, match=fix):
    dataclasses.replace(s.trainer, **({"lora_rank": 8} | {key: value})).check()


def test_a_lora_run_pushes_adapters_and_exports_merged_and_adapter_dirs(tmp_path):
  from streamrl import train
  from streamrl import config as config_lib
  from streamrl.generator.fake import FakeRollout
  from streamrl.models import safetensors_io
  from streamrl.trainer import export
  from tests.trainer.conftest import EXPORT_RUN

  pushed, made = [], []

  class Recording(FakeRollout):

    def update(self, tensors, version):
      pushed.append(dict(tensors))
      return super().update(tensors, version)

  class Recorded(train.RLTrainer):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  config = config_lib.apply_overrides(
      config_lib.load_config("configs/ppo.py"), {**EXPORT_RUN, "trainer.lora_rank": 4}
  )
  s = settings.from_config(config)
  workdir = str(tmp_path / "run")
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train, "make_rollout", lambda *args, **kwargs: Recording())
    mp.setattr(train, "RLTrainer", Recorded)
    train.run(s, workdir)
  (trainer,) = made
  # Every version reached the generators as an adapter, megabytes below the model.
  assert pushed and all(lora.is_adapter(p) for p in pushed)
  (model_dir,) = [d for d in (tmp_path / "run").iterdir() if d.name.startswith("warmstart-")]
  want = hf.to_hf_tensors(trainer.policy(), s.model.dtype)
  assert sum(x.nbytes for x in pushed[-1].values()) < sum(x.nbytes for x in want.values()) / 4
  # The run's own exports: merged policy and adapter; launch/export.py's, both ways.
  merged_dir = str(tmp_path / "merged")
  adapter_dir = str(tmp_path / "adapter")
  export.export_checkpoint(workdir, merged_dir)
  export.export_checkpoint(workdir, adapter_dir, merge_lora=False)
  for d in (f"{workdir}/{export.HF_DIR}", merged_dir):
    got = hf.load_hf_tensors(d)
    for name, w in want.items():
      np.testing.assert_allclose(got[name], w, atol=1e-6, err_msg=f"{d} {name}")
  for d in (f"{workdir}/{export.ADAPTER_DIR}", adapter_dir):
    got = safetensors_io.load(f"{d}/{lora.ADAPTER_WEIGHTS}")
    assert got.keys() == pushed[-1].keys()
    for name, w in pushed[-1].items():
      np.testing.assert_array_equal(got[name], w)
  assert export.checkpoint_steps(workdir)
  # Each iteration logs what its update weighed: the adapter's bytes.
  logged = [json.loads(x).get("transfer/update_bytes") for x in open(f"{workdir}/metrics.jsonl")]
  adapter_bytes = sum(x.nbytes for x in pushed[-1].values())
  logged = [b for b in logged if b is not None]
  assert logged and set(logged) == {adapter_bytes}
