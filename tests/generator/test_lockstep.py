"""Two tiny vLLM engines in one process on the lockstep clock
(streamrl/generator/lockstep.py), under fixed lists and a shared pool."""

import collections

import pytest

from streamrl.generator import lockstep, pooled
from streamrl.generator.config import Sampling
from streamrl.models import config as model_config
from streamrl.models import tiny
from streamrl.scheduling.pool import WorkPool
from streamrl.scheduling.request import Request

pytestmark = [pytest.mark.engine]

SAMPLING = Sampling(temperature=1.0, max_tokens=40)
SEED = 3


@pytest.fixture(scope="module")
def gens(tmp_path_factory):
  from streamrl.generator.vllm_engine import GeneratorInstance  # pylint: disable=g-import-not-at-top

  path = tiny.build_tiny_model_dir(
      str(tmp_path_factory.mktemp("tiny")), model_config.tiny_qwen2(64), seed=3
  )
  engines = [
      GeneratorInstance(path, instance_id=i, max_num_seqs=8, max_model_len=64) for i in range(2)
  ]
  yield engines
  for g in engines:
    g.close()


def requests(n):
  return [
      Request(i, (1,) + tuple(4 + (7 * i + j) % 50 for j in range(2 + i % 3))) for i in range(n)
  ]


def rnd(reqs, caps, **kw):
  return pooled.PooledRound(WorkPool(reqs), caps, max_tokens=SAMPLING.max_tokens, **kw)


def test_fixed_and_pooled_runs_give_the_same_tokens_and_clocks_advance(gens):
  reqs = requests(12)
  fixed = lockstep.run_fixed(gens, [reqs[:6], reqs[6:]], [4, 4], SAMPLING, seed=SEED)
  assert sorted(fixed.samples) == list(range(12)) and fixed.moves == 0
  assert fixed.makespan_s == pytest.approx(max(fixed.finished_at.values()))
  assert all(c > 0 for c in fixed.clocks)
  shared = lockstep.run_pooled(gens, rnd(reqs, {0: 4, 1: 4}, migrate=False), SAMPLING, seed=SEED)
  assert {i: s.token_ids for i, s in shared.samples.items()} == {
      i: s.token_ids for i, s in fixed.samples.items()
  }
  # One instance with nothing to do: the round ends on the other's clock.
  alone = lockstep.run_fixed(gens, [reqs, []], [4, 4], SAMPLING, seed=SEED)
  assert alone.clocks[1] < 0.05 * alone.clocks[0]


def test_migration_and_stragglers_move_work_and_answer_each_once(gens):
  # Instance 0 takes all 8 requests, so instance 1 is idle with the pool
  # empty from the start: it takes over running work whatever the lengths.
  reqs = requests(8)
  res = lockstep.run_pooled(gens, rnd(reqs, {0: 8, 1: 8}, migrate=True), SAMPLING, seed=SEED)
  assert res.moves >= 1 and sorted(res.samples) == list(range(8))
  for i, s in res.samples.items():
    assert s.prompt_token_ids == reqs[i].prompt and 0 < len(s.token_ids) <= 40
  reqs = requests(10)
  r = rnd(reqs, {0: 8, 1: 8}, migrate=False, straggler_tokens=6, long_instances=(1,))
  res = lockstep.run_pooled(gens, r, SAMPLING, seed=SEED)
  assert sorted(res.samples) == list(range(10)) and res.moves >= 1
  by_instance = collections.Counter(s.instance_id for s in res.samples.values())
  assert by_instance[1] >= 1
