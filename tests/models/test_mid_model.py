"""The benchmark model's preset: its shape, and the settings it needs."""

import pytest

from streamrl.errors import UserError
from streamrl.models import config

pytestmark = [pytest.mark.unit]


def test_the_mid_preset_is_a_qwen2_shape_of_about_41m_parameters():
  cfg = config.mid_qwen2()
  assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == ("qwen2", 32000, 512, 8)
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (8, 2, 64, 1536)
  assert cfg.tie_embeddings and cfg.qkv_bias
  assert cfg.head_dim in config.CPU_SUPPORTED_HEAD_DIMS
  # Tied: the 32,000 x 512 table counts once.
  assert 40.0e6 < cfg.num_params < 42.0e6


def test_the_mid_preset_takes_the_sentencepiece_tokenizer_only():
  config.Model(tiny="qwen2_mid", tokenizer="sentencepiece", dtype="bfloat16").check()
  with pytest.raises(UserError, match="model.tokenizer=sentencepiece"):
    config.Model(tiny="qwen2_mid").check()
  # A directory's own tokenizer wins: the built-in choices are not checked.
  config.Model(path="/some/dir", tiny="qwen2_mid").check()


def test_the_benchmarks_mid_preset_names_a_valid_policy():
  from experiments import harness

  preset = harness.MODEL_PRESETS["mid"]
  fields = {k.split(".", 1)[1]: v for k, v in preset.items() if k.startswith("model.")}
  assert fields == {"tiny": "qwen2_mid", "tokenizer": "sentencepiece", "dtype": "bfloat16"}
  config.Model(**fields).check()
  assert harness.MODEL_PRESETS["tiny"] == {}


@pytest.mark.parametrize(
    "model, expected",
    [("", {}), ("tiny", {}), ("/some/dir", {"model.path": "/some/dir"}), ("mid", None)],
)
def test_model_flag_names_a_preset_or_a_directory(model, expected):
  from absl.testing import flagsaver

  from experiments import harness

  with flagsaver.as_parsed(model=model, override=["model.dtype=float32"]):
    got = harness.overrides()
  if expected is None:
    expected = {k: str(v) for k, v in harness.MODEL_PRESETS["mid"].items()}
  # The command line's overrides win over the preset's.
  assert got == {**expected, "model.dtype": "float32"}
