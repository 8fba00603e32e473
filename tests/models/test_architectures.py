"""Qwen3, Llama 3.1 RoPE scaling and Mistral against transformers, and the
architectures we refuse by name.

Measured max |ours - transformers| on the logits (the tiny configs, norm
scales randomised, 40 tokens, logits up to ~1.2):
  fp32 checkpoint:                      qwen3 2.4e-7, llama3 6.0e-7, mistral 3.7e-7;
  bf16 checkpoint, both sides in fp32:  qwen3 2.4e-7, llama3 7.8e-7, mistral 3.3e-7;
  bf16 checkpoint, transformers in bf16: qwen3 5.0e-3, llama3 7.2e-3, mistral 5.2e-3
    (its bf16 activations; bound 2e-2).
"""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from streamrl.models import config, hf, transformer
from tests.models.test_hf import save_with_transformers

pytestmark = [pytest.mark.unit]

ARCHITECTURES = {
    "qwen3": config.tiny_qwen3,
    "llama3": config.tiny_llama3,
    "mistral": config.tiny_mistral,
}
# Long enough that the llama3 scaling (pre-training context 64) shows.
TOKENS = np.array([[1] + [(7 * i + 3) % 61 + 3 for i in range(39)]])
# Jitted: one compile per config (the eager forward compiles op by op, ~5 s).
_logits = nnx.jit(lambda model, tokens: model(tokens))


def _torch_logits(model_dir, torch_dtype) -> np.ndarray:
  """transformers' own logits of TOKENS, the checkpoint loaded in `torch_dtype`."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype)
  with torch.no_grad():
    return ref.eval()(torch.tensor(TOKENS)).logits.float().numpy()


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpoint_saved_by_transformers_loads_bit_exactly_and_matches_torch(
    name, dtype, tmp_path
):
  torch = pytest.importorskip("torch")
  cfg = ARCHITECTURES[name](64)
  ref = save_with_transformers(cfg, tmp_path, getattr(torch, dtype), randomize_norms=True)
  loaded_cfg, model = hf.load_hf(str(tmp_path))
  assert loaded_cfg == cfg, (tmp_path / "config.json").read_text()
  assert cfg.num_params == sum(p.numel() for p in ref.parameters())
  # Every tensor we export is the file's, bit for bit.
  theirs = hf.load_hf_tensors(str(tmp_path))
  ours = hf.to_hf_tensors(model, dtype)
  assert set(theirs) == set(ours)
  for k, v in theirs.items():
    assert v.dtype == ours[k].dtype and np.array_equal(v.view(np.uint8), ours[k].view(np.uint8)), k
  if cfg.qk_norm:
    assert ours["model.layers.1.self_attn.k_norm.weight"].shape == (cfg.head_dim,)
  got = np.asarray(_logits(model, TOKENS))
  # The same weights in fp32 on both sides: only the op order differs.
  err32 = np.abs(got - _torch_logits(tmp_path, torch.float32)).max()
  assert err32 < 1e-4, err32
  if dtype == "bfloat16":
    # Against transformers' own bf16 forward: bf16 activations on its side.
    err16 = np.abs(got - _torch_logits(tmp_path, torch.bfloat16)).max()
    assert err16 < 2e-2, err16


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_export_loads_in_transformers_as_the_same_model(name, tmp_path):
  """Our config.json + weights -> transformers: the same architecture, RoPE
  scaling and q/k norms, hence the same logits."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = ARCHITECTURES[name](64)
  # Random weights with non-trivial norm scales, as a Flax model.
  save_with_transformers(cfg, tmp_path / "src", torch.float32, randomize_norms=True)
  _, model = hf.load_hf(str(tmp_path / "src"))
  hf.save_hf(model, str(tmp_path / "ours"))
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype="float32")
  assert type(ref).__name__ == hf.hf_config_dict(cfg)["architectures"][0]
  rope = ref.config.rope_parameters
  assert rope["rope_type"] == (cfg.rope_scaling.rope_type if cfg.rope_scaling else "default")
  assert rope["rope_theta"] == cfg.rope_theta
  assert getattr(ref.config, "sliding_window", None) is None
  assert hf.load_hf(str(tmp_path / "ours"))[0] == cfg
  with torch.no_grad():
    want = ref.eval()(torch.tensor(TOKENS)).logits.numpy()
  np.testing.assert_allclose(np.asarray(_logits(model, TOKENS)), want, atol=1e-4)


@pytest.mark.parametrize(
    "scaling",
    [
        config.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        config.RopeScaling("llama3", 32.0, 1.0, 4.0, 64),
        config.RopeScaling("llama3", 4.0, 2.0, 3.0, 100),
        config.RopeScaling("linear", 4.0),
    ],
)
@pytest.mark.parametrize("theta, head_dim", [(500000.0, 128), (10000.0, 32)])
def test_rope_inv_freq_equals_transformers(scaling, theta, head_dim):
  transformers = pytest.importorskip("transformers")
  from transformers import modeling_rope_utils  # pylint: disable=g-import-not-at-top

  params = {"rope_theta": theta, **scaling.hf_dict()}
  hf_cfg = transformers.LlamaConfig(
      hidden_size=2 * head_dim,
      num_attention_heads=2,
      head_dim=head_dim,
      max_position_embeddings=1 << 16,
      rope_parameters=params,
  )
  want, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS[scaling.rope_type](hf_cfg, "cpu")
  got = np.asarray(transformer.rope_inv_freq(head_dim, theta, scaling))
  # fp32 pow and divisions in XLA vs torch: a few ulp apart (measured <= 7e-6).
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-5)
  assert not np.allclose(got, np.asarray(transformer.rope_inv_freq(head_dim, theta)))


def test_configs_are_hashable_static_jit_arguments():
  cfgs = [make(64) for make in ARCHITECTURES.values()]
  assert len({hash(c) for c in cfgs}) == 3
  assert config.tiny_llama3(64) == config.tiny_llama3(64)


_DROP = object()  # a key to leave out of config.json


def _hf_config(name: str, **changes) -> dict:
  out = hf.hf_config_dict(ARCHITECTURES[name](64))
  out.update(changes)
  return {k: v for k, v in out.items() if v is not _DROP}


@pytest.mark.parametrize(
    "base, changes, match",
    [
        ("mistral", {"architectures": ["Gemma2ForCausalLM"]}, r"Gemma 2 \(Gemma2ForCausalLM\)"),
        ("mistral", {"architectures": ["Phi3ForCausalLM"]}, r"Phi-3 \(Phi3ForCausalLM\)"),
        ("llama3", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ("llama3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ("qwen3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
        ("mistral", {"sliding_window": 4096}, r"MistralForCausalLM, sliding_window=4096"),
        ("mistral", {"sliding_window": _DROP}, "sliding_window=4096"),  # transformers' default
        ("qwen3", {"sliding_window": 4096, "use_sliding_window": True}, "Sliding-window"),
        ("qwen3", {"attention_bias": True}, "Qwen3 checkpoints with attention_bias"),
        ("llama3", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq"),
        ("llama3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_variants_are_refused_by_name(base, changes, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(_hf_config(base, **changes))


def test_qwen_sliding_window_that_is_switched_off_still_loads():
  cfg = hf.config_from_hf(_hf_config("qwen3", sliding_window=4096, use_sliding_window=False))
  assert cfg == config.tiny_qwen3(64)
  qwen2 = hf.hf_config_dict(config.tiny_qwen2(64))
  assert hf.config_from_hf({**qwen2, "sliding_window": 131072}) == config.tiny_qwen2(64)


def test_transformers5_rope_parameters_are_read():
  """rope_theta inside rope_parameters (transformers 5), no top-level key."""
  cfg = config.tiny_llama3(64)
  changes = {"rope_theta": _DROP, "rope_scaling": _DROP}
  changes["rope_parameters"] = {"rope_theta": cfg.rope_theta, **cfg.rope_scaling.hf_dict()}
  assert hf.config_from_hf(_hf_config("llama3", **changes)) == cfg
  linear = {"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 1e4}}
  got = hf.config_from_hf(_hf_config("mistral", rope_theta=_DROP, **linear))
  assert got.rope_scaling == config.RopeScaling("linear", 2.0) and got.rope_theta == 1e4


def test_model_config_refuses_flags_its_family_cannot_export():
  with pytest.raises(ValueError, match="qk_norm"):
    dataclasses.replace(config.tiny_qwen3(64), qk_norm=False)
  with pytest.raises(ValueError, match="qk_norm"):
    dataclasses.replace(config.tiny_llama(64), qk_norm=True)
  with pytest.raises(ValueError, match="no q/k/v bias"):
    dataclasses.replace(config.tiny_mistral(64), qkv_bias=True)
  with pytest.raises(ValueError, match="'yarn' is not implemented"):
    config.RopeScaling("yarn", 4.0)
