"""Weights to Ray generator instances through the checkpoint-transfer service:
published once, verified by each instance's receiver, staged while it may be
generating, loaded between streams; every instance of a host loads one file.
Also the plain Ray path, which writes that one file itself."""

import os
import time

import jax.numpy as jnp
import numpy as np
import pytest
import ray
from flax import nnx

from streamrl.generator.config import Sampling
from streamrl.models import config as model_config
from streamrl.models import hf, tiny, transformer
from streamrl import cluster
from streamrl.config import settings
from streamrl.generator import delivery, service

pytestmark = [pytest.mark.engine, pytest.mark.ray]

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


def _check_generations(svc, model, version):
  samples = list(svc.generate(PROMPTS, Sampling(temperature=1.0, max_tokens=8), seed=3))
  assert sorted(s.prompt_id for s in samples) == list(range(6))
  assert {s.instance_id for s in samples} == {0, 1}
  for s in samples:
    assert s.weight_version == version
    tokens = jnp.asarray([list(s.prompt_token_ids) + list(s.token_ids)])
    logp, _ = transformer.sequence_logprobs(model, tokens)
    ours = np.asarray(logp[0, len(s.prompt_token_ids) - 1 : -1])
    np.testing.assert_allclose(ours, s.logprobs, atol=1e-3)


def _files(svc):
  return [ray.get(svc.actor(i).last_weights_file.remote()) for i in (0, 1)]


def test_versions_arrive_verified_and_generations_use_them(svc):
  assert svc.publisher is not None
  for version, seed in ((1, 11), (2, 12)):
    model = transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(seed))
    # Lazy export, as the trainer's: each tensor converted once, into the published file.
    versions = svc.update(hf.HFTensors(model, "float32"), version).wait()
    assert versions == {0: version, 1: version}
    assert svc.publisher.acked_versions() and not svc.publisher.missing_acks(version)
    # Both instances (on the publisher's host) loaded the publisher's one file in place.
    a, b = _files(svc)
    assert a == b == svc.publisher._newest().path
    assert svc.publisher.copied_bytes(version) == svc.publisher._newest().manifest.total_bytes
    _check_generations(svc, model, version)


def test_a_wrong_shape_is_refused_and_the_old_version_keeps_serving(svc):
  before = svc.versions()
  bad = hf.to_hf_tensors(transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(1)))
  bad["model.norm.weight"] = np.zeros((7,), np.float32)
  with pytest.raises((TimeoutError, ValueError)):
    svc.update(bad, max(before.values()) + 1).delivered(timeout_s=20)
  samples = list(svc.generate(PROMPTS[:2], Sampling(max_tokens=4), seed=1))
  assert {s.weight_version for s in samples} == set(before.values())


@pytest.mark.parametrize("shared_file", [True, False])
def test_ray_path_loads_one_file_per_host_and_removes_it(svc, shared_file):
  version = max(svc.versions().values()) + 1
  model = transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(20 + version))
  # The Ray backend beside this service's transfer one (streamrl/generator/delivery.py).
  ray_delivery = delivery.RayDelivery(
      svc.actor, lambda: svc.live_instances, svc.instances.finish_update
  )
  handle = ray_delivery.push(hf.HFTensors(model, "float32"), version, shared_file=shared_file)
  assert handle.wait() == {0: version, 1: version}
  a, b = _files(svc)
  # One file for both instances; through the object store (other hosts) each writes its own.
  assert (a == b) == shared_file
  # The shared file is removed once loaded; an engine's own (written from the
  # object store's tensors) is kept for its next update (engine.keep_weights_file).
  assert os.path.exists(a) == os.path.exists(b) == (not shared_file)
  _check_generations(svc, model, version)


def test_dev_shm_is_clean_after_close(svc):
  pids = [os.getpid()] + [svc.placement[i]["pid"] for i in (0, 1)]

  def ours():
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(f"srl_{p}_") for p in pids)]

  assert ours()  # the publisher's files (and the receivers' mappings) exist while it runs
  svc.close()
  deadline = time.monotonic() + 20  # a killed actor's files go with its resource tracker
  while ours() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert ours() == []
