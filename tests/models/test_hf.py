import json

import numpy as np
import pytest
from flax import nnx

from streamrl.models import config, hf, tiny, transformer

pytestmark = [pytest.mark.unit]


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
  cfg = make(64)
  ref = save_with_transformers(cfg, tmp_path, torch.float32)
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


def save_with_transformers(cfg, path, torch_dtype, *, randomize_norms=False):
  """A random model of `cfg`, built from our exported config.json by
  transformers itself and saved by it in `torch_dtype`.

  `randomize_norms` draws every RMSNorm scale from 1 + 0.2 N(0, 1) (HF
  initialises them to ones), so a norm mapped to the wrong place shows.
  """
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf_cfg = hf.hf_config_dict(cfg)
  kwargs = {k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")}
  torch.manual_seed(0)
  ref = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(cfg.family, **kwargs)
  )
  assert type(ref).__name__ == hf_cfg["architectures"][0]
  if randomize_norms:
    with torch.no_grad():
      for name, p in ref.named_parameters():
        if name.endswith("norm.weight"):
          p.copy_(1.0 + 0.2 * torch.randn_like(p))
  ref = ref.to(torch_dtype).eval()
  ref.save_pretrained(str(path), safe_serialization=True)
  return ref


@pytest.mark.parametrize("make", [config.tiny_qwen2, config.tiny_llama])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint_from_transformers_loads_bit_exactly(tmp_path, make, dtype):
  torch = pytest.importorskip("torch")
  cfg = make(64)
  ref = save_with_transformers(cfg, tmp_path, getattr(torch, dtype))
  _, model = hf.load_hf(str(tmp_path))
  # Every weight is the checkpoint's half-precision value, exactly (fp32 holds it).
  ours = hf.to_hf_tensors(model, dtype)
  theirs = {k: v for k, v in ref.state_dict().items() if k in ours}
  assert set(theirs) == set(ours)
  for k, v in theirs.items():
    assert np.array_equal(ours[k].view(np.uint16), v.view(torch.int16).numpy().view(np.uint16)), k
  tokens = np.array([[1, 5, 9, 13, 40, 2, 7, 30]])
  with torch.no_grad():
    # The same half-precision weights computed in fp32: only op order differs.
    want32 = ref.float()(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(model(tokens))
  np.testing.assert_allclose(got, want32, atol=2e-4)


def test_bf16_checkpoint_matches_transformers_bf16_logits(tmp_path):
  """Our fp32 forward on a bf16 checkpoint against transformers' own bf16
  forward: they differ by bf16 rounding of activations only."""
  torch = pytest.importorskip("torch")
  cfg = config.tiny_qwen2(64)
  ref = save_with_transformers(cfg, tmp_path, torch.bfloat16)
  _, model = hf.load_hf(str(tmp_path))
  tokens = np.array([[1, 5, 9, 13, 40, 2, 7, 30]])
  with torch.no_grad():
    want = ref(torch.tensor(tokens)).logits.float().numpy()
  got = np.asarray(model(tokens))
  # bf16 keeps 8 mantissa bits: a relative error of 2^-8 per rounding, a few
  # roundings deep. Measured here: max abs difference 3.5e-3 on logits up to 1.31.
  scale = np.abs(want).max()
  assert np.abs(got - want).max() <= 0.05 * max(scale, 1.0)
  assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_bf16_safetensors_load_without_jax_imported_first(tmp_path):
  """bf16 is in the dtype table by design, not registered by importing JAX."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  import ml_dtypes  # pylint: disable=g-import-not-at-top

  from streamrl.models import safetensors_io  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "w.safetensors")
  values = np.array([1.5, -2.25, 3e-3], np.float32)
  safetensors_io.save(path, {"w": values.astype(ml_dtypes.bfloat16)})
  code = (
      "import sys, numpy as np\n"
      "from streamrl.models import safetensors_io\n"
      f"w = safetensors_io.load({path!r})['w']\n"
      "assert 'jax' not in sys.modules, 'jax was imported'\n"
      "print(w.dtype, w.astype(np.float32).tolist())\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split()[0] == "bfloat16"
  want = values.astype(ml_dtypes.bfloat16).astype(np.float32).tolist()
  assert out.stdout.strip().endswith(str(want))


def test_exported_weights_read_after_their_buffers_were_donated_fail_clearly():
  model = transformer.Transformer(config.tiny_qwen2(64), rngs=nnx.Rngs(0))
  exported = hf.HFTensors(model, "bfloat16")
  first = next(iter(exported))
  assert exported[first].dtype.name == "bfloat16"
  model.trunk.embedding_vd[...].delete()  # what a donating train step does
  with pytest.raises(RuntimeError, match="before the next update"):
    exported["model.embed_tokens.weight"]
