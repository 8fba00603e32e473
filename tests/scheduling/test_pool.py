"""The shared work pool's bookkeeping (no engines): hand-out order, the
long-tail split, sibling refinement, migration and joining moved responses."""

import pytest

from streamrl.generator.pooled import PooledRound, join
from streamrl.generator.rollout import MOVED, PARTIAL, Sample
from streamrl.scheduling import pool as pool_lib
from streamrl.scheduling.pool import Feed, WorkPool, donor
from streamrl.scheduling.request import Request

pytestmark = [pytest.mark.unit]


def reqs(n, prompt_of=lambda k: (1, 2 + k)):
  return [Request(k, prompt_of(k)) for k in range(n)]


def sample(rid, prompt, tokens, reason="stop", version=0, instance=0):
  return Sample(
      prompt_id=rid,
      prompt_token_ids=tuple(prompt),
      token_ids=tuple(tokens),
      logprobs=tuple(-0.5 for _ in tokens),
      finish_reason=reason,
      weight_version=version,
      instance_id=instance,
  )


def test_pool_hands_out_longest_estimate_first_and_fifo_without_estimates():
  rs = reqs(4)
  assert [WorkPool(rs).take(0).id for _ in range(1)] == [0]
  p = WorkPool(rs, [5.0, 50.0, 20.0, 50.0])
  assert [p.take(0).id for _ in range(4)] == [1, 3, 2, 0]  # ties keep the round's order
  assert p.take(0) is None and not p


def test_finished_siblings_refine_the_estimate_of_their_group():
  # Requests 0, 1 sample one prompt (predicted 10); 2 another (predicted 30).
  rs = reqs(3, prompt_of=lambda k: (1, 2 + k // 2))
  p = WorkPool(rs, [10.0, 10.0, 30.0], groups=[0, 0, 1])
  assert [p.take(0).id, p.take(1).id] == [2, 0]
  p.finished(0, 110)  # a sibling of request 1 ran long: (10 + 110) / 2 = 60 > 30
  p.put(rs[2])
  assert p.estimate(1) == pytest.approx(60.0)
  assert p.take(0).id == 1


def test_long_tail_instances_take_their_side_first_then_steal():
  rs = reqs(4)
  p = WorkPool(rs, [9.0, 8.0, 7.0, 6.0], long_ids=[3], long_instances=[1])
  assert p.take(1).id == 3  # the long instance's own work first
  assert p.take(1).id == 0  # then the other side's, longest first
  assert p.take(0).id == 1


def test_from_parts_interleaves_the_plan_and_keeps_its_split():
  parts = [[Request(0, (1,)), Request(2, (3,))], [Request(1, (2,)), Request(3, (4,))]]
  p = pool_lib.from_parts(parts, [5, 7], n_long=1)
  assert [r.id for r in p] == [0, 1, 2, 3] and p.long_instances == {5}
  assert p.take(5).id == 0 and p.take(7).id == 1
  with pytest.raises(ValueError, match="2 request lists for 1 instances"):
    pool_lib.from_parts(parts, [0])


def test_duplicate_ids_and_mismatched_estimates_are_refused():
  with pytest.raises(ValueError, match="appears more than once"):
    WorkPool([Request(1, (1,)), Request(1, (2,))])
  with pytest.raises(ValueError, match="2 requests but 1 estimates"):
    WorkPool(reqs(2), [1.0])


def test_donor_is_the_busiest_with_at_least_two():
  assert donor({0: 0, 1: 3, 2: 5}, idle=0) == 2
  assert donor({0: 0, 1: 1}, idle=0) is None


def test_feed_orders_and_readiness():
  f = Feed(straggler=8)
  assert f.open and not f.ready
  f.order(requests=[Request(0, (1,))], release=2)
  assert f.ready and f.releases() == 2 and f.releases() == 0
  assert f.popleft().id == 0 and not f.ready
  f.order(stragglers_stay=True, close=True)
  assert f.straggler is None and not f.is_straggler(0, 99) and f.ready and not f.open


def test_join_concatenates_and_marks_versions_only_when_they_differ():
  prompt = (1, 2)
  before = sample(0, prompt, [5, 6], MOVED, version=3)
  rest = sample(0, prompt + (5, 6), [7], "stop", version=3)
  j = join(before, rest, prompt)
  assert j.prompt_token_ids == prompt and j.token_ids == (5, 6, 7) and len(j.logprobs) == 3
  assert j.token_versions is None
  j = join(before, sample(0, prompt + (5, 6), [7], "stop", version=4), prompt)
  assert j.token_versions == (3, 3, 4) and j.weight_version == 4


def test_round_moves_a_straggler_to_the_idle_instance_and_answers_each_once():
  rs = reqs(3)
  rnd = PooledRound(WorkPool(rs), {0: 2, 1: 2}, max_tokens=10, migrate=True)
  assert [r.id for r in rnd.fill(0)] == [0, 1] and [r.id for r in rnd.fill(1)] == [2]
  assert rnd.on_sample(1, sample(2, rs[2].prompt, [9])) is not None
  # Instance 1 is idle and the pool is empty: instance 0 must give one up.
  assert rnd.orders([0, 1]) == [(0, {"release": 1})]
  assert rnd.on_sample(0, sample(1, rs[1].prompt, [4, 4, 4], MOVED)) is None
  ((who, order),) = rnd.orders([0, 1])
  assert who == 1 and order["requests"][0] == Request(1, rs[1].prompt + (4, 4, 4), max_tokens=7)
  out = rnd.on_sample(1, sample(1, rs[1].prompt + (4, 4, 4), [5], instance=1))
  assert out.token_ids == (4, 4, 4, 5) and out.prompt_token_ids == rs[1].prompt
  assert rnd.on_sample(0, sample(0, rs[0].prompt, [1])) is not None
  assert rnd.done and rnd.moves == 1
  assert sorted(rnd.orders([0, 1])) == [(0, {"close": True}), (1, {"close": True})]
  assert rnd.on_sample(0, sample(0, rs[0].prompt, [1])) is None  # a second answer is dropped


def test_dead_instance_work_returns_to_the_pool_and_a_stop_answers_the_rest():
  rs = reqs(3)
  rnd = PooledRound(WorkPool(rs), {0: 2, 1: 1}, max_tokens=10, migrate=False)
  rnd.fill(0), rnd.fill(1)
  rnd.on_sample(0, sample(0, rs[0].prompt, [3, 3], MOVED))
  assert rnd.on_dead(0) == 1  # request 1; request 0's rest is already back in the pool
  left = rnd.unstarted()
  assert sorted(s.prompt_id for s in left) == [0, 1]
  assert all(s.finish_reason == PARTIAL for s in left)
  assert next(s for s in left if s.prompt_id == 0).token_ids == (3, 3)


def test_stragglers_leave_regular_instances_until_the_regular_work_is_out():
  rs = reqs(6)
  rnd = PooledRound(
      WorkPool(rs),
      {0: 2, 1: 2},
      max_tokens=50,
      migrate=False,
      straggler_tokens=4,
      long_instances=(1,),
      long_share=1,
  )
  assert rnd.straggler_limit(0) == 4 and rnd.straggler_limit(1) is None
  assert len(rnd.fill(0)) == 2 and len(rnd.fill(1)) == 1  # the long instance keeps room
  rnd.on_sample(0, sample(0, rs[0].prompt, [7] * 4, MOVED))
  assert rnd.pool.has_long()
  orders = dict(rnd.orders([1]))
  assert orders[1]["requests"][0].id == 0
