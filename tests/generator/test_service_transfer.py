"""Weights to Ray generator instances through the checkpoint-transfer service:
published once, verified by each instance's receiver, staged while it may be
generating, loaded between streams."""

import jax.numpy as jnp
import numpy as np
import pytest
import ray
from flax import nnx

from streamrl.generator.vllm_engine import SamplingConfig
from streamrl.models import config as model_config
from streamrl.models import hf, tiny, transformer
from streamrl import cluster, settings
from streamrl.generator import service

PROMPTS = [(i, [1] + [4 + (5 * i + j) % 40 for j in range(3 + i % 4)]) for i in range(6)]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
  cfg = model_config.tiny_qwen2(64)
  path = tiny.build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")), cfg, seed=5)
  engine = settings.Engine(max_num_seqs=8, max_model_len=64, kv_cache_gib=1.0, num_instances=2)
  transfer = settings.Transfer(
      enabled=True,
      chunk_bytes=1 << 16,
      topology="tree",
      fanout=1,
      use_shm=True,
      delta_cross_dc=False,
  )
  info = cluster.init_ray(None, generator_cpus=1, trainer_cpus=1)
  s = service.StreamGenerationService(
      path, engine, dtype="float32", seed=0, cluster=info, stall_timeout_s=300.0, transfer=transfer
  )
  s.model_cfg = cfg
  yield s
  s.close()
  ray.shutdown()


def test_versions_arrive_verified_and_generations_use_them(svc):
  assert svc.publisher is not None
  for version, seed in ((1, 11), (2, 12)):
    model = transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(seed))
    versions = svc.update(hf.to_hf_tensors(model), version).wait()
    assert versions == {0: version, 1: version}
    assert svc.publisher.acked_versions() and not svc.publisher.missing_acks(version)
    samples = list(svc.generate(PROMPTS, SamplingConfig(temperature=1.0, max_tokens=8, seed=3)))
    assert sorted(s.prompt_id for s in samples) == list(range(6))
    assert {s.instance_id for s in samples} == {0, 1}
    for s in samples:
      assert s.weight_version == version
      tokens = jnp.asarray([list(s.prompt_token_ids) + list(s.token_ids)])
      logp, _ = transformer.sequence_logprobs(model, tokens)
      ours = np.asarray(logp[0, len(s.prompt_token_ids) - 1 : -1])
      np.testing.assert_allclose(ours, s.logprobs, atol=1e-3)


def test_a_wrong_shape_is_refused_and_the_old_version_keeps_serving(svc):
  before = svc.versions()
  bad = hf.to_hf_tensors(transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(1)))
  bad["model.norm.weight"] = np.zeros((7,), np.float32)
  with pytest.raises((TimeoutError, ValueError)):
    svc.update(bad, max(before.values()) + 1).delivered(timeout_s=20)
  samples = list(svc.generate(PROMPTS[:2], SamplingConfig(max_tokens=4, seed=1)))
  assert {s.weight_version for s in samples} == set(before.values())
