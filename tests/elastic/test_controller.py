"""Elastic generation on the real service: an instance added mid-run catches
up to the current weights (verified by the transfer service) before it takes
work, one removed mid-stream drains first, and the run's controller applies
forced changes. Nothing is lost or produced twice."""

import collections
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import ray
from flax import nnx

from streamrl import cluster
from streamrl.config import settings
from streamrl.generator import service
from streamrl.elastic.controller import ElasticGeneration
from streamrl.generator.config import Sampling
from streamrl.models import config as model_config
from streamrl.models import hf, tiny, transformer

pytestmark = [pytest.mark.engine, pytest.mark.ray]

SAMPLING = Sampling(temperature=1.0, max_tokens=8)
SEED = 3


def requests(n):
  return [(i, [1] + [4 + (5 * i + j) % 40 for j in range(3 + i % 4)]) for i in range(n)]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
  if ray.is_initialized():
    ray.shutdown()
  cfg = model_config.tiny_qwen2(64)
  path = tiny.build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")), cfg, seed=5)
  engine = settings.Engine(max_num_seqs=8, max_model_len=64, kv_cache_gib=1.0, num_instances=1)
  transfer = settings.Transfer(enabled=True, chunk_bytes=1 << 16)
  info = cluster.init_ray(None, generator_cpus=1, trainer_cpus=1)
  s = service.StreamGenerationService(
      path,
      engine,
      dtype="float32",
      seed=0,
      cluster=info,
      stall_timeout_s=300.0,
      transfer=transfer,
      max_instances=2,
  )
  s.model_cfg = cfg
  yield s
  s.close()
  ray.shutdown()


def _agree(model, samples):
  for s in samples:
    tokens = jnp.asarray([list(s.prompt_token_ids) + list(s.token_ids)])
    logp, _ = transformer.sequence_logprobs(model, tokens)
    ours = np.asarray(logp[0, len(s.prompt_token_ids) - 1 : -1])
    np.testing.assert_allclose(ours, s.logprobs, atol=1e-3)


def test_an_added_instance_catches_up_and_samples_from_the_current_weights(svc):
  model = transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(11))
  assert svc.update(hf.HFTensors(model, "float32"), 1).wait() == {0: 1}
  i = svc.add_instance("test")
  # Verified and loaded before it counts as live: it serves version 1 from its first sample.
  assert i == 1 and svc.live_instances == [0, 1]
  assert svc.versions() == {0: 1, 1: 1} and svc.query_versions() == {0: 1, 1: 1}
  samples = list(svc.generate(requests(8), SAMPLING, seed=SEED))
  assert collections.Counter(s.prompt_id for s in samples) == collections.Counter(range(8))
  new = [s for s in samples if s.instance_id == 1]
  assert new and all(s.weight_version == 1 for s in samples)
  # Its sampled-token logprobs are the trainer model's, version 1 (fp32).
  _agree(model, new)
  # The next version reaches it like every other instance.
  model2 = transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(12))
  assert svc.update(hf.HFTensors(model2, "float32"), 2).wait() == {0: 2, 1: 2}


def test_an_instance_removed_mid_stream_drains_first(svc):
  assert svc.live_instances == [0, 1]
  out, removed = [], None
  for s in svc.generate(requests(12), SAMPLING, seed=SEED):
    out.append(s)
    if removed is None:
      removed = svc.remove_instance(reason="test")
      # No new work goes to it at once ...
      assert svc.live_instances == [0]
  # ... but what it had was finished and delivered, once.
  assert removed == 1
  assert collections.Counter(s.prompt_id for s in out) == collections.Counter(range(12))
  assert any(s.instance_id == 1 for s in out)
  assert [r[0] for r in svc.retired] == [1] and not svc.dead_instances
  # The publisher no longer waits for the removed one's acks.
  model = transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(13))
  assert svc.update(hf.HFTensors(model, "float32"), 3).wait(timeout_s=120) == {0: 3}
  later = list(svc.generate(requests(4), SAMPLING, seed=SEED))
  assert {s.instance_id for s in later} == {0}


def test_the_controller_applies_a_forced_schedule(svc, tmp_path):
  el = settings.Elastic(enabled=True, min_instances=1, max_instances=2, schedule="0:+1,1:-1")
  ctl = ElasticGeneration(el, svc, pool=cluster.GENERATION_POOL, workdir=str(tmp_path))
  start = len(svc.live_instances)
  ctl.after_iteration(0, generation_s=1.0, training_s=1.0, served_by=start)
  assert len(svc.live_instances) == start + 1
  new = svc.live_instances[-1]
  assert svc.versions()[new] == 3  # caught up to the current version
  ctl.after_iteration(1, generation_s=1.0, training_s=1.0, served_by=start + 1)
  assert len(svc.live_instances) == start
  with open(tmp_path / "elastic.jsonl") as f:
    events = [json.loads(line) for line in f]
  assert [(e["action"], e["instance"]) for e in events] == [("added", new), ("removed", new)]
  assert all("scheduled" in e["reason"] for e in events)


def test_a_dead_instance_is_replaced(svc, tmp_path):
  el = settings.Elastic(enabled=True, min_instances=1, max_instances=2, replace_dead=True)
  svc.add_instance("for this test")
  ctl = ElasticGeneration(el, svc, pool=cluster.GENERATION_POOL, workdir=str(tmp_path))
  victim = svc.live_instances[-1]
  ray.get(svc.actor(victim).inject_fault.remote("crash", after_samples=1))
  out = list(svc.generate(requests(8), SAMPLING, seed=SEED))
  # Its unfinished requests ran on the survivor: each request once.
  assert collections.Counter(s.prompt_id for s in out) == collections.Counter(range(8))
  assert [d.instance_id for d in svc.dead_instances] == [victim]
  ctl.after_iteration(5, generation_s=1.0, training_s=1.0, served_by=2)
  assert len(svc.live_instances) == 2 and victim not in svc.live_instances
  new = svc.live_instances[-1]
  assert svc.versions()[new] == 3
  assert (
      ctl.events[0]["action"] == "added"
      and f"replaces instance {victim}" in ctl.events[0]["reason"]
  )
