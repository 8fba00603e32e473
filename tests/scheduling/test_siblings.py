"""Group-aware length prediction: the estimate, the admission order, and the
dispatcher keeping a prompt's samples together."""

import numpy as np
import pytest

from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.generator.rollout import Request
from streamrl.pipeline import base
from streamrl.scheduling import LatencyProfile, dispatch
from streamrl.scheduling.scheduler import with_length_hints
from streamrl.scheduling.siblings import LengthHint, SiblingQueue, group_estimate

pytestmark = [pytest.mark.unit]


def test_the_group_estimate_blends_the_prior_with_finished_siblings_and_running_tokens():
  assert group_estimate(10.0, []) == 10.0
  assert group_estimate(10.0, [2.0]) == 6.0  # the prior counts as one sibling
  assert group_estimate(10.0, [2.0, 6.0], prior_weight=2.0) == 7.0
  assert group_estimate(10.0, [2.0], running_max=30.0) == 30.0  # a lower bound wins


def _queue(priors, groups, **kw):
  items = [f"r{k}" for k in range(len(priors))]
  hints = [LengthHint(g, p) for g, p in zip(groups, priors)]
  return SiblingQueue(items, hints, **kw), hints


def test_one_request_per_group_is_admitted_first_then_the_longest_estimate():
  q, h = _queue([10, 10, 5, 5, 1, 1], ["a", "a", "b", "b", "c", "c"])
  assert [q.popleft() for _ in range(3)] == ["r0", "r2", "r4"]  # probes, by prior
  q.finished(h[0], 2)  # a: (10 + 2) / 2 = 6
  q.finished(h[2], 20)  # b: (5 + 20) / 2 = 12.5
  q.finished(h[4], 3)  # c: (1 + 3) / 2 = 2
  assert [q.popleft() for _ in range(3)] == ["r3", "r1", "r5"]
  assert not q and len(q) == 0
  with pytest.raises(IndexError):
    q.popleft()


def test_a_sibling_still_running_raises_its_groups_estimate():
  q, h = _queue([10, 10, 8, 8], ["a", "a", "b", "b"], probe=False)
  assert q.popleft() == "r0"
  q.running(h[2], 40)  # b's first sample (admitted elsewhere) already has 40 tokens
  assert q.estimate(1) == 10 and q.estimate(3) == 40
  assert q.popleft() == "r2"


def test_a_resumed_response_is_ordered_by_what_it_has_left_and_counts_its_earlier_tokens():
  items = ["fresh", "resumed"]
  hints = [LengthHint("a", 10), LengthHint("b", 12, done=9)]
  q = SiblingQueue(items, hints, probe=False)
  assert q.estimate(1) == 3 and q.popleft() == "fresh"
  q.finished(hints[1], 5)  # the resumed response ended at 9 + 5 = 14 tokens
  assert group_estimate(12, [14]) == q.estimate(1) + 9


def test_pending_requests_iterate_in_input_order_and_mismatches_are_refused():
  q, _ = _queue([1, 3, 2], ["a", "b", "c"])
  assert q.popleft() == "r1" and list(q) == ["r0", "r2"]
  q.clear()
  assert not q
  with pytest.raises(ValueError, match="one each"):
    SiblingQueue(["x"], [])
  with pytest.raises(ValueError, match="prior_weight"):
    SiblingQueue(["x"], [LengthHint("a", 1)], prior_weight=0)


def _profile():
  return LatencyProfile(batch_sizes=(1, 8, 32), ptl_s=(0.010, 0.012, 0.02))


def test_dispatch_keeps_each_group_on_one_instance_and_cuts_the_long_tail_at_group_edges():
  rng = np.random.default_rng(0)
  groups = np.repeat(np.arange(16), 4)  # 16 prompts x 4 samples
  pred = np.repeat(rng.uniform(1, 100, 16), 4)
  recent = rng.lognormal(3, 1, 500)
  for latency_model in ("paper", "simulate"):
    plan = dispatch(
        pred,
        4,
        _profile(),
        recent,
        alpha=0.1,
        max_batch_size=8,
        latency_model=latency_model,
        groups=list(groups),
    )
    where = plan.instance_of()
    for g in range(16):
      assert len({where[p] for p in np.flatnonzero(groups == g)}) == 1
    assert sorted(where) == list(range(64)) and len(plan.lengths) == 64
    long_groups = {groups[p] for i in range(plan.n_long_instances) for p in plan.assignments[i]}
    # ceil(0.1 * 64) = 7 prompts reach into 2 groups; both go whole.
    assert len(long_groups) * 4 == sum(
        len(plan.assignments[i]) for i in range(plan.n_long_instances)
    )
  with pytest.raises(ValueError, match="one each"):
    dispatch(pred, 4, _profile(), recent, groups=[0, 1])
  alone = dispatch(pred, 4, _profile(), recent, alpha=0.1, max_batch_size=8)
  assert len({alone.instance_of()[p] for p in range(4)}) > 1  # without groups they spread


def test_requests_carry_their_groups_mean_estimate_and_resumed_ones_count_their_tokens():
  reqs = [(7, (1, 2)), (8, (1, 2)), (9, (3,))]
  hinted = with_length_hints(reqs, [0, 0, 1], [10.0, 20.0, 5.0])
  assert [r.hint for r in hinted] == [
      LengthHint(0, 15.0),
      LengthHint(0, 15.0),
      LengthHint(1, 5.0),
  ]
  assert hinted[0] == Request(7, (1, 2), None, LengthHint(0, 15.0))
  rnd = base.Round(
      it=0,
      requests=reqs,
      examples_by_id={},
      loader_state={},
      resume={8: (8, (1, 2, 40, 41, 42), 5)},
  )
  sent = base._as_sent(rnd, hinted[1])
  assert sent == Request(8, (1, 2, 40, 41, 42), 5, LengthHint(0, 15.0, done=3))
  assert base._as_sent(rnd, hinted[0]) == hinted[0]
  assert sent.with_hint(None) == Request(8, (1, 2, 40, 41, 42), 5)


def test_a_request_is_a_dataclass_and_tuples_are_accepted_where_users_call():
  assert Request.of((3, [1, 2])) == Request(3, (1, 2))
  assert Request.of((3, (1,), 4)).max_tokens == 4
  r = Request(5, (1,))
  assert Request.of(r) is r
  with pytest.raises(TypeError, match="Request"):
    Request.of((3,))
  with pytest.raises(TypeError, match="Request"):
    Request.of("3 1 2")
  with pytest.raises(ValueError, match="max_tokens"):
    Request(1, (1,), -2)
  with pytest.raises(TypeError, match="LengthHint"):
    Request(1, (1,), None, 7.0)
  hint = LengthHint(group=2, prior=9.0)
  hinted = Request(5, (1, 2), 7).with_hint(hint)
  assert hinted == Request(5, (1, 2), 7, hint) and hinted.with_hint(None) == Request(5, (1, 2), 7)
  with pytest.raises(TypeError, match="LengthHint"):
    r.with_hint(3.0)


def test_sibling_lengths_needs_a_length_predicting_scheduler():
  cfg = settings.to_config(settings.Settings())
  cfg.scheduler.sibling_lengths = "on"
  with pytest.raises(UserError, match="scheduler.kind=skew"):
    settings.from_config(cfg)
  cfg.scheduler.kind = "skew"
  assert settings.from_config(cfg).scheduler.sibling_lengths == "on"
  cfg.scheduler.sibling_lengths = "maybe"
  with pytest.raises(UserError, match="sibling_lengths"):
    settings.from_config(cfg)


def test_the_scheduler_sends_each_prompts_samples_to_one_instance_with_length_hints():
  from streamrl.data import tasks
  from streamrl.scheduling.scheduler import GenerationScheduler

  sched = settings.Scheduler(kind="oracle", sibling_lengths="on")
  gs = GenerationScheduler(sched, model_dir="", workdir=None, num_instances=3, max_batch_size=4)
  examples = tasks.make_examples(6, 0)
  reqs = [(k, (1,) + tuple(range(2, 4 + k // 4))) for k in range(24)]  # 6 prompts x 4 samples
  by_id = {k: examples[k // 4] for k in range(24)}
  gs.recent.extend(range(1, 60))
  assignments, caps = gs.plan(reqs, by_id, seed=0)
  assert len(assignments) == len(caps) == 3
  sent = [r for part in assignments for r in part]
  assert sorted(r.id for r in sent) == list(range(24))
  for part in assignments:
    hints = [r.hint for r in part]
    assert all(isinstance(h, LengthHint) and h.prior > 0 for h in hints)
    groups = {h.group for h in hints}
    for g in groups:  # a group is whole on this instance
      assert sum(r.hint.group == g for r in sent) == sum(h.group == g for h in hints)
  assert len({r.hint.group for r in sent}) == 6
