import json

import numpy as np
import pytest
from flax import nnx

from streamrl.models import config, hf, tiny, transformer


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
def test_round_trip_is_bit_exact(tmp_path, make):
  cfg = make(64)
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(3))
  hf.save_hf(model, str(tmp_path))
  cfg2, model2 = hf.load_hf(str(tmp_path))
  assert cfg2 == cfg
  a = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  b = nnx.to_pure_dict(nnx.state(model2, nnx.Param))
  import jax

  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.array_equal(np.asarray(x), np.asarray(y))
  t1, t2 = hf.to_hf_tensors(model), hf.to_hf_tensors(model2)
  assert t1.keys() == t2.keys()
  assert all(np.array_equal(t1[k], t2[k]) for k in t1)
  assert ("lm_head.weight" in t1) == (not cfg.tie_embeddings)
  assert ("model.layers.0.self_attn.q_proj.bias" in t1) == cfg.qkv_bias


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
def test_checkpoint_written_by_transformers_loads_and_matches_torch(tmp_path, make):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = make(64)
  hf_cfg = hf.hf_config_dict(cfg)
  cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}[cfg.family]
  config_cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[cfg.family]
  torch.manual_seed(0)
  ref = cls(config_cls(**{k: v for k, v in hf_cfg.items() if k != "architectures"})).eval()
  ref.save_pretrained(str(tmp_path), safe_serialization=True)
  _, model = hf.load_hf(str(tmp_path))
  tokens = np.array([[1, 5, 9, 13, 40, 2, 7, 30]])
  with torch.no_grad():
    want = ref(torch.tensor(tokens)).logits.float().numpy()
  got = np.asarray(model(tokens))
  np.testing.assert_allclose(got, want, atol=2e-4)


def test_missing_directory_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    hf.load_hf(str(tmp_path / "nope"))


def test_unsupported_architecture_is_refused(tmp_path):
  tiny.build_tiny_model_dir(str(tmp_path))
  path = tmp_path / "config.json"
  data = json.loads(path.read_text())
  data["architectures"] = ["MixtralForCausalLM"]
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="Unsupported architecture"):
    hf.read_config(str(tmp_path))


def test_shape_mismatch_names_the_parameter(tmp_path):
  tiny.build_tiny_model_dir(str(tmp_path))
  path = tmp_path / "config.json"
  data = json.loads(path.read_text())
  data["intermediate_size"] = 100
  path.write_text(json.dumps(data))
  with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
    hf.load_hf(str(tmp_path))
