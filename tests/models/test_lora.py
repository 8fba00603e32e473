"""LoRA adapters applied unmerged in the projections equal the merged weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl.models import config, lora, transformer

pytestmark = [pytest.mark.unit]


def _model_and_adapter(cfg, targets="all"):
  model = transformer.Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  spec = lora.LoraSpec(4, 8.0, lora.parse_targets(targets))
  adapters = lora.init_adapters(params, cfg.num_layers, spec, jax.random.key(1))
  # A trained adapter: b is no longer zero.
  keys = iter(jax.random.split(jax.random.key(2), len(adapters)))
  adapters = {
      k: {"a": ab["a"], "b": 0.05 * jax.random.normal(next(keys), ab["b"].shape)}
      for k, ab in adapters.items()
  }
  return graphdef, params, spec, adapters


def _logprobs(graphdef, params, tokens, adapters=None, spec=None):
  model = nnx.merge(graphdef, params)
  layers = lora.by_layer(adapters, spec, model.cfg.num_layers) if adapters else None
  return transformer.next_token_logprobs(model, tokens, adapters=layers)[0]


@pytest.mark.parametrize(
    "make,targets",
    [(config.tiny_qwen2, "all"), (config.tiny_llama, "all"), (config.tiny_qwen3, "q,o,down")],
)
def test_the_unmerged_forward_and_gradients_equal_the_merged_ones(make, targets):
  cfg = make(64)
  graphdef, params, spec, adapters = _model_and_adapter(cfg, targets)
  tokens = jax.random.randint(jax.random.key(3), (2, 10), 0, 64)

  def merged_loss(ad):
    return _logprobs(graphdef, lora.merged(params, ad, spec), tokens).sum()

  def unmerged_loss(ad):
    return _logprobs(graphdef, params, tokens, ad, spec).sum()

  np.testing.assert_allclose(
      _logprobs(graphdef, params, tokens, adapters, spec),
      _logprobs(graphdef, lora.merged(params, adapters, spec), tokens),
      atol=2e-5,
  )
  assert (
      abs(float(unmerged_loss(adapters)) - float(_logprobs(graphdef, params, tokens).sum())) > 1e-2
  )
  g_merged, g_unmerged = jax.grad(merged_loss)(adapters), jax.grad(unmerged_loss)(adapters)
  for key in adapters:
    for part in ("a", "b"):
      np.testing.assert_allclose(
          g_unmerged[key][part], g_merged[key][part], rtol=1e-4, atol=1e-5, err_msg=key
      )


def test_by_layer_folds_the_scale_into_b():
  cfg = config.tiny_qwen2(64)
  _, params, spec, adapters = _model_and_adapter(cfg, "q,down")
  layers = lora.by_layer(adapters, spec, cfg.num_layers)
  assert len(layers) == cfg.num_layers and set(layers[1]) == {"q", "down"}
  np.testing.assert_allclose(layers[1]["down"]["b"], spec.scale * adapters["1.down"]["b"])
  np.testing.assert_array_equal(layers[0]["q"]["a"], adapters["0.q"]["a"])
  assert jnp.shape(layers[0]["q"]["b"])[1] == cfg.num_heads * cfg.head_dim
  del params
