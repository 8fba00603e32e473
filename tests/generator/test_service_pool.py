"""A shared work pool over two tiny vLLM instances on a local Ray
(streamrl/generator/pooled.py): every request answered once, stragglers
moved to an idle instance and joined, a stop, a killed instance."""

import collections

import pytest
import ray

from streamrl import cluster
from streamrl.config import settings
from streamrl.generator import service
from streamrl.generator.config import Sampling
from streamrl.generator.rollout import PARTIAL
from streamrl.models import config as model_config
from streamrl.models import tiny
from streamrl.scheduling.pool import WorkPool
from streamrl.scheduling.request import Request

pytestmark = [pytest.mark.engine, pytest.mark.ray]

LONG = Sampling(temperature=1.0, max_tokens=48)
SEED = 5
ENGINE = settings.Engine(max_num_seqs=8, max_model_len=64, kv_cache_gib=1.0, num_instances=2)


def requests(n):
  return [
      Request(i, (1,) + tuple(4 + (5 * i + j) % 50 for j in range(2 + i % 3))) for i in range(n)
  ]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
  path = tiny.build_tiny_model_dir(
      str(tmp_path_factory.mktemp("tiny")), model_config.tiny_qwen2(64), seed=3
  )
  info = cluster.init_ray(None, generator_cpus=1, trainer_cpus=1)
  s = service.StreamGenerationService(
      path, ENGINE, dtype="float32", seed=0, cluster=info, stall_timeout_s=300.0, pooled=True
  )
  yield s
  s.close()
  ray.shutdown()


def check_answers(samples, reqs, max_tokens):
  assert collections.Counter(s.prompt_id for s in samples) == collections.Counter(
      r.id for r in reqs
  )
  prompt = {r.id: r.prompt for r in reqs}
  for s in samples:
    assert s.prompt_token_ids == prompt[s.prompt_id]
    assert 0 < len(s.token_ids) <= max_tokens and len(s.logprobs) == len(s.token_ids)


def test_pool_moves_stragglers_to_the_idle_instance_and_answers_each_once(svc):
  reqs = requests(13)
  # Instance 1 runs one request at a time and holds three; instance 0 runs
  # eight at once: it empties first and takes one of instance 1's.
  samples = list(
      svc.generate(None, LONG, seed=SEED, pool=WorkPool(reqs), caps=[8, 1], migrate=True)
  )
  check_answers(samples, reqs, LONG.max_tokens)
  assert svc.moves >= 1
  assert {s.instance_id for s in samples} == {0, 1}
  # Without migration nothing moves and the seeded tokens are those of fixed lists.
  moves = svc.moves
  pooled = list(svc.generate(None, LONG, seed=SEED, pool=WorkPool(reqs), caps=[8, 1]))
  assert svc.moves == moves
  fixed = {s.prompt_id: s.token_ids for s in svc.generate(reqs, LONG, seed=SEED)}
  assert all(fixed[s.prompt_id] == s.token_ids for s in pooled)
  with pytest.raises(ValueError, match="a pool or requests"):
    svc.generate(reqs, LONG, pool=WorkPool(reqs))


def test_a_stopped_pool_answers_what_is_unfinished_as_partial(svc):
  reqs = requests(20)
  stream = svc.generate(None, LONG, seed=SEED, pool=WorkPool(reqs), caps=[2, 2], stoppable=True)
  samples = [next(stream)]
  svc.stop_generation()
  samples += list(stream)
  assert collections.Counter(s.prompt_id for s in samples) == collections.Counter(range(20))
  assert sum(s.finish_reason == PARTIAL for s in samples) >= 10


def test_a_killed_instance_work_finishes_on_the_survivor(svc):
  reqs = requests(12)
  ray.get(svc.actor(1).inject_fault.remote("stall", after_samples=1, seconds=120))
  samples, killed = [], False
  for s in svc.generate(None, LONG, seed=SEED, pool=WorkPool(reqs), caps=[2, 2], migrate=True):
    samples.append(s)
    if not killed and any(x.instance_id == 1 for x in samples):
      ray.kill(svc.actor(1))
      killed = True
  check_answers(samples, reqs, LONG.max_tokens)
  assert [d.instance_id for d in svc.dead_instances] == [1]
  assert svc.dead_instances[0].requeued >= 1
