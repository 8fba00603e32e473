import dataclasses
import importlib
import logging
import math

import numpy as np
import pytest

from streamrl.scheduling.dispatch import choose_batch_size, dispatch, estimate_latency, fifo_plan
from streamrl.scheduling.latency import LatencyProfile

pytestmark = [pytest.mark.unit]

# The package re-exports the function `dispatch`, which shadows the submodule attribute.
dispatch_mod = importlib.import_module("streamrl.scheduling.dispatch")

PAPER = LatencyProfile.from_paper()
# A measured-looking CPU curve with a steep, superlinear tail.
STEEP = LatencyProfile(batch_sizes=(1, 2, 8, 32), ptl_s=(0.01, 0.011, 0.02, 0.2))


def _brute_batch(profile, m, max_bs):
  if m == 0:
    return 1
  costs = [(profile.ptl(b) * math.ceil(m / b), b) for b in range(1, min(max_bs, m) + 1)]
  return min(costs)[1]


@pytest.mark.parametrize("profile", [PAPER, STEEP])
def test_choose_batch_size_matches_full_scan(profile):
  for m in range(0, 300, 7):
    for max_bs in (1, 3, 16, 64, 512):
      b = choose_batch_size(profile, m, max_bs)
      want = _brute_batch(profile, m, max_bs)
      assert profile.ptl(b) * math.ceil(max(m, 1) / b) == pytest.approx(
          profile.ptl(want) * math.ceil(max(m, 1) / want)
      )


def test_estimate_latency_formula():
  p = LatencyProfile(batch_sizes=(1, 10), ptl_s=(0.01, 0.1))
  # 10 prompts on 2 instances -> M = 5; BS 2 -> 3 waves of PTL(2) * 100.
  assert estimate_latency(p, 10, 100.0, 2, 2) == pytest.approx(p.ptl(2) * 100 * 3)
  assert estimate_latency(p, 0, 100.0, 0, 2) == 0.0
  assert estimate_latency(p, 3, 100.0, 0, 2) == math.inf


def _brute_best(pred, n, profile, recent, alpha, objective, max_bs):
  """Independent enumeration of every instance split; returns the best objective value."""
  p = len(pred)
  n_long = math.ceil(alpha * p - 1e-9)
  l_long, l_reg = np.percentile(recent, 90), np.percentile(recent, 50)
  best = math.inf
  for n_l in range(0, n + 1):
    n_r = n - n_l
    if (n_long and not n_l) or ((p - n_long) and not n_r):
      continue
    times = []
    for count, inst, l in ((n_long, n_l, l_long), (p - n_long, n_r, l_reg)):
      if count == 0:
        times.append(0.0)
        continue
      m = math.ceil(count / inst)
      b = _brute_batch(profile, m, max_bs)
      times.append(profile.ptl(b) * l * math.ceil(m / b))
    best = min(best, max(times) if objective == "makespan" else sum(times))
  return best


@pytest.mark.parametrize("objective", ["makespan", "sum"])
@pytest.mark.parametrize("seed", range(30))
def test_dispatch_matches_brute_force(objective, seed):
  rng = np.random.default_rng(seed)
  p, n = int(rng.integers(1, 40)), int(rng.integers(2, 7))
  pred = rng.lognormal(4, 1, size=p)
  recent = rng.lognormal(4, 1, size=int(rng.integers(1, 50)))
  alpha = float(rng.choice([0.1, 0.2, 0.5]))
  max_bs = int(rng.choice([2, 4, 64]))
  profile = PAPER if seed % 2 else STEEP
  plan = dispatch(pred, n, profile, recent, alpha=alpha, objective=objective, max_batch_size=max_bs)
  assert plan.objective_value == pytest.approx(
      _brute_best(pred, n, profile, recent, alpha, objective, max_bs)
  )

  # Every prompt exactly once; long-tail instances hold exactly the top alpha.
  flat = [i for a in plan.assignments for i in a]
  assert sorted(flat) == list(range(p))
  n_long = math.ceil(alpha * p - 1e-9)
  top = set(np.argsort(-pred, kind="stable")[:n_long].tolist())
  assert {i for a in plan.assignments[: plan.n_long_instances] for i in a} == top
  assert 1 <= plan.n_long_instances <= n - (1 if n_long < p else 0)
  for a, bs in zip(plan.assignments, plan.batch_sizes):
    assert list(pred[list(a)]) == sorted(pred[list(a)], reverse=True)  # LPT inside.
    assert 1 <= bs <= max_bs


def test_long_tail_instances_run_small_batches():
  rng = np.random.default_rng(0)
  pred = rng.lognormal(5, 1, size=256)
  plan = dispatch(pred, 4, PAPER, recent_lengths=pred, alpha=0.2, max_batch_size=512)
  assert 1 <= plan.n_long_instances < 4
  long_bs = plan.batch_sizes[: plan.n_long_instances]
  reg_bs = plan.batch_sizes[plan.n_long_instances :]
  assert max(long_bs) < min(reg_bs)


def test_one_instance_gets_everything_in_lpt_order():
  pred = [5, 1, 9, 3]
  plan = dispatch(pred, 1, PAPER, recent_lengths=[10, 20], max_batch_size=2)
  assert plan.assignments == ((2, 0, 3, 1),)
  assert plan.batch_sizes == (2,)
  assert plan.predicted_time > 0


def test_no_history_falls_back_to_fifo_and_logs_once(caplog, monkeypatch):
  monkeypatch.setattr(dispatch_mod, "_warned_no_history", False)
  with caplog.at_level(logging.WARNING, logger=dispatch_mod.__name__):
    a = dispatch([3, 2, 1, 9, 8], 2, PAPER, None, max_batch_size=8)
    b = dispatch([3, 2, 1, 9, 8], 2, PAPER, [], max_batch_size=8)
  assert a == b == fifo_plan(5, 2, 8)
  assert a.assignments == ((0, 2, 4), (1, 3))
  assert a.objective == "fifo" and math.isnan(a.predicted_time)
  assert sum("No output-length history" in r.message for r in caplog.records) == 1


def test_fifo_plan_seeded_shuffle_is_a_permutation():
  plan = fifo_plan(10, 3, max_batch_size=2, seed=1)
  assert sorted(i for a in plan.assignments for i in a) == list(range(10))
  assert plan.batch_sizes == (2, 2, 2)
  assert fifo_plan(10, 3, 2, seed=1) == plan


def test_bad_arguments_refused():
  with pytest.raises(ValueError, match="objective"):
    dispatch([1], 2, PAPER, [1], objective="mean")
  with pytest.raises(ValueError, match="num_instances"):
    dispatch([1], 0, PAPER, [1])
  with pytest.raises(ValueError, match="alpha"):
    dispatch([1], 2, PAPER, [1], alpha=1.5)
  with pytest.raises(ValueError, match="finite"):
    dispatch([1, math.inf], 2, PAPER, [1])


def test_plan_generation_by_name():
  from streamrl.scheduling import plan_generation

  pred, true = [1.0, 9.0, 3.0, 7.0], [2.0, 8.0, 3.0, 9.0]
  kw = dict(num_prompts=4, num_instances=2, max_batch_size=4, profile=PAPER)
  assert plan_generation("fifo", **kw, seed=3) == fifo_plan(4, 2, 4, seed=3)
  assert plan_generation("skew", **kw, predicted_lengths=pred, recent_lengths=true) == dispatch(
      pred, 2, PAPER, true, max_batch_size=4
  )
  assert plan_generation("oracle", **kw, true_lengths=true) == dispatch(
      true, 2, PAPER, true, max_batch_size=4
  )
  with pytest.raises(ValueError, match="config.scheduler.kind"):
    plan_generation("random", **kw)
  with pytest.raises(ValueError, match="predicted_lengths"):
    plan_generation("skew", **kw)


def _stepwise_time(lengths, cap, profile):
  """Reference: one decode step at a time (integer lengths); a step costs
  PTL(running) plus the context cost of the tokens they generated so far."""
  pending, running, t = list(lengths), [], 0.0  # running: [left, done]
  while pending or running:
    while pending and len(running) < cap:
      running.append([pending.pop(0), 0])
    t += profile.ptl(len(running)) + profile.context_s_per_token * sum(d for _, d in running)
    running = [[left - 1, done + 1] for left, done in running if left > 1]
  return t


# STEEP whose steps also cost 0.2 ms per token of context in flight.
STEEP_CTX = dataclasses.replace(STEEP, context_s_per_token=2e-4)


@pytest.mark.parametrize("profile", [STEEP, STEEP_CTX], ids=["ptl", "ptl+context"])
@pytest.mark.parametrize("seed", range(10))
def test_continuous_batching_time_matches_stepwise(seed, profile):
  from streamrl.scheduling.dispatch import continuous_batching_time

  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 30, size=int(rng.integers(1, 25))).tolist()
  cap = int(rng.integers(1, 9))
  assert continuous_batching_time(lengths, cap, profile) == pytest.approx(
      _stepwise_time(lengths, cap, profile)
  )
  assert continuous_batching_time([], cap, profile) == 0.0


def test_context_cost_makes_long_requests_together_slower_than_apart():
  from streamrl.scheduling.dispatch import continuous_batching_time

  # Four 300-token requests at once: PTL alone says 300 steps at PTL(4); with
  # context every step also reads what all four wrote so far.
  t = continuous_batching_time([300] * 4, 4, STEEP_CTX)
  assert t == pytest.approx(300 * STEEP.ptl(4) + 2e-4 * 4 * 300 * 299 / 2)


def test_calibrated_lengths_follow_predicted_rank():
  from streamrl.scheduling.dispatch import calibrated_lengths

  est = calibrated_lengths([0.3, 5.0, 1.0, 2.0], recent_lengths=[10, 20, 30, 40])
  assert list(np.argsort(-est)) == [1, 3, 2, 0]
  np.testing.assert_allclose(
      sorted(est), np.quantile([10, 20, 30, 40], [0.125, 0.375, 0.625, 0.875])
  )


def _greedy(ids, est, n):
  buckets, loads = [[] for _ in range(n)], [0.0] * n
  for p in ids:
    i = min(range(n), key=lambda j: (loads[j], len(buckets[j]), j))
    buckets[i].append(p)
    loads[i] += est[p]
  return buckets


def _split(order, est, n, n_l, n_long):
  # n_l = 0: no long-tail group, every instance balanced over all prompts.
  if n_l == 0:
    return _greedy(order, est, n)
  return _greedy(order[:n_long], est, n_l) + _greedy(order[n_long:], est, n - n_l)


@pytest.mark.parametrize("objective", ["makespan", "sum"])
@pytest.mark.parametrize("seed", range(15))
def test_simulate_model_matches_brute_force(objective, seed):
  from streamrl.scheduling.dispatch import continuous_batching_time

  rng = np.random.default_rng(100 + seed)
  p, n = int(rng.integers(2, 30)), int(rng.integers(2, 6))
  pred = rng.lognormal(3, 1, size=p)
  recent = rng.integers(1, 60, size=40)
  max_bs = int(rng.choice([2, 4, 64]))
  plan = dispatch(
      pred, n, STEEP, recent, objective=objective, max_batch_size=max_bs, latency_model="simulate"
  )
  order = np.argsort(-pred, kind="stable")
  est = np.empty(p)
  est[order] = np.quantile(recent, 1 - (np.arange(p) + 0.5) / p)
  n_long = math.ceil(0.2 * p - 1e-9)
  best = math.inf
  # n_l = 0 (makespan only): no long-tail group, every instance balanced over all prompts.
  first = 0 if objective == "makespan" else 1
  for n_l in range(first if n_long < p else n, n if n_long < p else n + 1):
    buckets = _split(order, est, n, n_l, n_long)
    # continuous_batching_time is checked against the stepwise reference above.
    # Caps tried: the wave-optimal one and the largest; the faster replay wins.
    times = [
        min(
            continuous_batching_time(est[b], c, STEEP)
            for c in (_brute_batch(STEEP, len(b), max_bs), max(1, min(max_bs, len(b))))
        )
        for b in buckets
    ]
    g = (max(times[:n_l], default=0.0), max(times[n_l:], default=0.0))
    best = min(best, max(g) if objective == "makespan" else sum(g))
  assert plan.objective_value == pytest.approx(best, rel=1e-9)
  assert sorted(i for a in plan.assignments for i in a) == list(range(p))


def test_bad_latency_model_refused():
  with pytest.raises(ValueError, match="latency_model"):
    dispatch([1.0], 2, PAPER, [1.0], latency_model="exact")


# ----------------------------------------- simulate at the ranker's real error


def test_rank_quantiles_order_prompts_from_shortest_to_longest_prediction():
  from streamrl.scheduling.dispatch import rank_quantiles

  # Longest prediction -> (P - 1) / P, shortest -> 0; a tie keeps input order.
  assert rank_quantiles([5.0, 1.0, 9.0, 5.0]).tolist() == [0.5, 0.0, 0.75, 0.25]
  assert rank_quantiles([]).shape == (0,)


def test_rank_bins_group_lengths_by_rank_and_fill_empty_bins_from_a_neighbour():
  from streamrl.scheduling.dispatch import rank_bins

  bins = rank_bins([(0.05, 1), (0.07, 3), (0.95, 100)], num_bins=4)
  assert [b.tolist() for b in bins] == [[1.0, 3.0], [1.0, 3.0], [100.0], [100.0]]
  with pytest.raises(ValueError, match="rank_history is empty"):
    rank_bins([], num_bins=4)


def _noisy_ranker_workload(rng, p):
  """A prompt-only ranker on random lengths: its prediction says which prompts
  tend to run long, but each sample's length is drawn anew (a 300-token
  response can come from any rank, more often from a high one)."""
  pred = rng.random(p)
  long = rng.random(p) < 0.01 + 0.08 * pred  # 1 % at the bottom, 9 % at the top
  return pred, np.where(long, 300.0, rng.integers(5, 20, size=p).astype(float))


def test_simulate_with_rank_history_avoids_the_plan_an_exact_rank_order_would_trust():
  from streamrl.scheduling.dispatch import rank_quantiles

  rng = np.random.default_rng(0)
  prof = LatencyProfile(batch_sizes=(1, 8, 32), ptl_s=(0.004, 0.005, 0.008))
  history = []
  for _ in range(4):  # earlier rounds: (rank at prediction, length it had)
    pred, true = _noisy_ranker_workload(rng, 256)
    history += list(zip(rank_quantiles(pred), true))
  recent = [n for _, n in history]
  pred, _ = _noisy_ranker_workload(rng, 256)
  kw = dict(alpha=0.2, max_batch_size=32, latency_model="simulate")
  exact = dispatch(pred, 4, prof, recent, **kw)
  drawn = dispatch(pred, 4, prof, recent, rank_history=history, **kw)
  assert exact.assignments != drawn.assignments

  def mean_makespan(plan, trials=200):
    # This round's lengths, drawn again and again at the prompts' ranks.
    out = []
    for t in range(trials):
      r = np.random.default_rng(1000 + t)
      true = np.where(r.random(256) < 0.01 + 0.08 * pred, 300.0, r.integers(5, 20, size=256))
      out.append(
          max(
              dispatch_mod.continuous_batching_time(true[list(a)], c, prof)
              for a, c in zip(plan.assignments, plan.batch_sizes)
          )
      )
    return float(np.mean(out))

  # Trusting the order, the predicted-short 80 % share one instance and the
  # hidden long responses there finish late; the draws see that coming.
  assert mean_makespan(drawn) < 0.9 * mean_makespan(exact)
  # And its estimate of its own makespan is about what the drawn lengths give.
  assert drawn.predicted_time == pytest.approx(mean_makespan(drawn), rel=0.25)


@pytest.mark.parametrize("objective", ["makespan", "sum"])
@pytest.mark.parametrize("seed", range(6))
def test_simulate_with_rank_history_matches_brute_force_over_the_same_draws(objective, seed):
  from streamrl.scheduling.dispatch import RANK_DRAWS, _rank_draws, continuous_batching_time, rank_bins

  rng = np.random.default_rng(200 + seed)
  p, n = int(rng.integers(4, 40)), int(rng.integers(2, 5))
  pred = rng.lognormal(3, 1, size=p)
  history = list(zip(rng.random(300), rng.integers(1, 200, size=300).astype(float)))
  recent = [n_ for _, n_ in history]
  max_bs = int(rng.choice([2, 4, 64]))
  plan = dispatch(
      pred,
      n,
      STEEP,
      recent,
      objective=objective,
      max_batch_size=max_bs,
      latency_model="simulate",
      rank_history=history,
      seed=seed,
  )
  est, draws = _rank_draws(pred, rank_bins(history), RANK_DRAWS, seed)
  assert plan.lengths == pytest.approx(est)
  order = np.argsort(-pred, kind="stable")
  n_long = math.ceil(0.2 * p - 1e-9)
  best = math.inf
  for n_l in range(0 if objective == "makespan" else 1, n):
    buckets = _split(order, est, n, n_l, n_long)
    per = []  # per instance: [draws] times at the cap with the least mean
    for b in buckets:
      caps = (_brute_batch(STEEP, len(b), max_bs), max(1, min(max_bs, len(b))))
      runs = [np.asarray([continuous_batching_time(d[b], c, STEEP) for d in draws]) for c in caps]
      per.append(min(runs, key=lambda t: t.mean()))
    per = np.asarray(per)
    span = per.max(axis=0).mean()
    total = (per[:n_l].max(axis=0).mean() if n_l else 0.0) + per[n_l:].max(axis=0).mean()
    best = min(best, span if objective == "makespan" else total)
  assert plan.objective_value == pytest.approx(best, rel=1e-9)
  assert sorted(i for a in plan.assignments for i in a) == list(range(p))


def test_the_scheduler_records_each_requests_rank_with_the_length_it_had():
  import types

  from streamrl.config import settings
  from streamrl.data import tasks
  from streamrl.scheduling.dispatch import MIN_RANK_HISTORY
  from streamrl.scheduling.scheduler import GenerationScheduler

  sched = settings.Scheduler(kind="oracle", latency_model="simulate")
  gs = GenerationScheduler(sched, model_dir="", workdir=None, num_instances=2, max_batch_size=4)
  examples = tasks.make_examples(8, 0)
  reqs = [(100 + k, (1, 2 + k)) for k in range(8)]
  by_id = {100 + k: ex for k, ex in enumerate(examples)}
  gs.recent.extend(range(1, 30))
  gs.plan(reqs, by_id, seed=0)
  expected = {
      100 + k: float(q)
      for k, q in enumerate(
          dispatch_mod.rank_quantiles(
              [e.expected_length or tasks.oracle_answer_length(e.prompt) + 1 for e in examples]
          )
      )
  }
  # Samples come back in any order, a request unplanned (99) is skipped.
  samples = [
      types.SimpleNamespace(prompt_id=rid, prompt_token_ids=ids, token_ids=[7] * (rid - 90))
      for rid, ids in reversed(reqs + [(99, (1,))])
  ]
  gs.observe(samples)
  assert sorted(gs.rank_history) == sorted((expected[r], float(r - 90)) for r, _ in reqs)
  assert gs.rank_history.maxlen >= MIN_RANK_HISTORY
  gs.observe(samples)  # each request's rank is used once
  assert len(gs.rank_history) == len(reqs)
  # Until the history is long enough, simulate would trust the order: the
  # paper formula plans instead.
  assert gs._latency_model() == "paper"
  gs.rank_history.extend([(0.5, 10.0)] * MIN_RANK_HISTORY)
  assert gs._latency_model() == "simulate"


def test_many_instances_time_their_splits_on_fewer_draws(monkeypatch):
  # 64 instances: 64 candidate splits x 64 instances x 2 caps replays per
  # draw, so the draws shrink to stay near REPLAY_BUDGET (2 at least).
  used = []
  real = dispatch_mod._rank_draws
  monkeypatch.setattr(
      dispatch_mod,
      "_rank_draws",
      lambda pred, bins, n, seed: used.append(n) or real(pred, bins, n, seed),
  )
  rng = np.random.default_rng(0)
  history = list(zip(rng.random(400), rng.integers(1, 100, size=400).astype(float)))
  recent = [n for _, n in history]
  for n_inst in (4, 64):
    plan = dispatch(
        rng.random(256), n_inst, STEEP, recent, latency_model="simulate", rank_history=history
    )
    assert sorted(i for a in plan.assignments for i in a) == list(range(256))
  assert used == [dispatch_mod.RANK_DRAWS, 2]


def test_first_k_plan_puts_resumed_first_then_shortest_round_robin_at_full_cap():
  lengths = [30.0, 5.0, 20.0, 5.0, 50.0, 10.0, 1.0]
  plan = dispatch_mod.first_k_plan(lengths, 2, 3, first=[4, 0, 4])
  order = [4, 0, 6, 1, 3, 5, 2]  # resumed in their order, then ascending (ties kept)
  assert plan.assignments == (tuple(order[0::2]), tuple(order[1::2]))
  assert plan.batch_sizes == (3, 3) and plan.n_long_instances == 0
  assert plan.objective == "first_k" and plan.lengths == ()
  assert dispatch_mod.first_k_plan([1.0], 3, 8).batch_sizes == (1, 1, 1)
  with pytest.raises(ValueError, match="outside"):
    dispatch_mod.first_k_plan(lengths, 2, 3, first=[7])
  with pytest.raises(ValueError, match="finite"):
    dispatch_mod.first_k_plan([1.0, math.nan], 2, 3)


def test_first_k_plan_finishes_the_first_groups_sooner_than_lpt_and_the_long_tail():
  """What a stoppable round waits for (its K-th finished response) comes
  sooner with the first-K plan than with Algorithm 2's LPT plan on the same
  true lengths, and sooner than FIFO on average; LPT still wins the makespan."""
  from streamrl.sim.costs import GenCostModel
  from streamrl.sim.generation import simulate_generation

  gen = GenCostModel(
      step_fixed_s=0.01,
      per_seq_s=0.001,
      per_ctx_token_s=0.0,
      prefill_s_per_token=0.0,
      kv_capacity_tokens=float("inf"),
      max_num_seqs=8,
  )

  def times(plan, out):
    queues = [list(a) for a in plan.assignments]
    res = simulate_generation(
        gen, 2, [8] * len(out), out, queues=queues, caps=list(plan.batch_sizes)
    )
    k = int(0.8 * len(out))  # the round stops at 80 % (partial_oversample 0.25)
    return np.sort(res.finish_times)[k - 1], res.makespan

  rng = np.random.default_rng(0)
  first_k, lpt, fifo = [], [], []
  for _ in range(20):
    out = np.maximum(1, rng.lognormal(3.0, 1.0, size=40).astype(int))
    first_k.append(times(dispatch_mod.first_k_plan(out, 2, 8), out))
    lpt.append(times(dispatch(out, 2, PAPER, out, max_batch_size=8, objective="makespan"), out))
    fifo.append(times(fifo_plan(len(out), 2, 8, seed=1), out))
  assert all(a[0] <= b[0] for a, b in zip(first_k, lpt))
  assert np.mean([a[0] for a in first_k]) < np.mean([b[0] for b in fifo])
  assert np.mean([a[1] for a in lpt]) <= np.mean([b[1] for b in first_k])


def test_a_stoppable_round_is_planned_for_its_first_groups_resumed_first():
  from streamrl.config import settings
  from streamrl.data import tasks
  from streamrl.scheduling import scheduler as scheduler_lib
  from streamrl.scheduling.scheduler import GenerationScheduler

  sched = settings.Scheduler(kind="oracle", latency_model="simulate")
  gs = GenerationScheduler(sched, model_dir="", workdir=None, num_instances=2, max_batch_size=4)
  examples = tasks.make_examples(10, 3)
  reqs = [(100 + k, (1, 2 + k)) for k in range(10)]
  by_id = {100 + k: ex for k, ex in enumerate(examples)}
  true = [e.expected_length or tasks.oracle_answer_length(e.prompt) + 1 for e in examples]
  gs.recent.extend(range(1, 30))
  assignments, caps = gs.plan(reqs, by_id, seed=0, stoppable=True, resumed={107: None, 102: None})
  order = [r.id for k in range(5) for part in assignments for r in part[k : k + 1]]
  rest = [100 + int(i) for i in np.argsort(true, kind="stable") if i not in (2, 7)]
  assert order[:2] == [102, 107] and order[2:] == rest
  assert caps == [4, 4] and gs.n_long == 0 and gs.estimates == {}
  # Slots for every request (2 x 5): all start at once, no length is asked for.
  roomy = GenerationScheduler(sched, model_dir="", workdir=None, num_instances=2, max_batch_size=5)
  roomy.recent.extend(range(1, 30))
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(scheduler_lib, "plan_generation", lambda *a, **k: pytest.fail("planned"))
    parts, caps = roomy.plan(reqs, by_id, seed=0, stoppable=True, resumed={107: None})
  assert [[r.id for r in p] for p in parts] == [
      [107, 101, 103, 105, 108],
      [100, 102, 104, 106, 109],
  ]
  assert caps == [5, 5] and roomy.estimates == {}
  # The same round unstoppable: Algorithm 2 + LPT (longest first on each instance).
  assignments, _ = gs.plan(reqs, by_id, seed=0)
  for part in assignments:
    assert [true[r.id - 100] for r in part] == sorted(
        (true[r.id - 100] for r in part), reverse=True
    )


# ------------------------------------------- the vectorised plan against its reference
@pytest.mark.parametrize("profile", [PAPER, STEEP, STEEP_CTX], ids=["paper", "steep", "ctx"])
@pytest.mark.parametrize("seed", range(8))
def test_batched_replay_matches_the_event_by_event_replay(seed, profile):
  from tests.scheduling import reference_dispatch as ref

  rng = np.random.default_rng(seed)
  draws, m = int(rng.integers(1, 17)), int(rng.integers(0, 60))
  lengths = rng.lognormal(3, 1, size=(draws, m)) * (rng.random((draws, m)) > 0.1)
  lengths[:, : m // 4] = np.round(lengths[:, : m // 4])  # ties between finishes
  for cap in (1, 3, max(1, m // 2), m, m + 5):
    got = dispatch_mod.continuous_batching_times(lengths, cap, profile)
    want = [ref.continuous_batching_time(row, cap, profile) for row in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
  assert dispatch_mod.continuous_batching_time([4.0, -1.0, 2.0], 2, profile) == pytest.approx(
      ref.continuous_batching_time([4.0, -1.0, 2.0], 2, profile), rel=1e-12
  )


def _seeded_rounds():
  """(args, kwargs) of `dispatch` for rounds of 128 and fewer requests."""
  for seed in range(40):
    rng = np.random.default_rng(1000 + seed)
    group = int(rng.choice([1, 4, 8]))
    p = int(rng.choice([128, 128, 40, 9])) // group * group or group
    pred = np.repeat(rng.lognormal(3, 1, size=p // group), group)
    if seed % 5 == 0:
      pred = np.round(pred / 10)  # many equal predictions
    history = np.stack([rng.random(600), rng.integers(1, 300, 600)], axis=1)
    kw = dict(
        alpha=float(rng.choice([0.1, 0.2, 0.5])),
        objective=str(rng.choice(["makespan", "sum"])),
        max_batch_size=int(rng.choice([4, 16, 128])),
        latency_model=str(rng.choice(["paper", "simulate"])),
        groups=list(np.repeat(np.arange(p // group), group)) if seed % 2 else None,
        rank_history=history[: int(rng.choice([50, 600]))],
        seed=seed,
    )
    profile = [PAPER, STEEP, STEEP_CTX][seed % 3]
    yield (pred, int(rng.choice([1, 2, 3, 8])), profile, history[:, 1]), kw


def test_the_plan_decides_exactly_as_the_reference_helpers_on_seeded_rounds(monkeypatch):
  from tests.scheduling import reference_dispatch as ref

  rounds = list(_seeded_rounds())
  now = [dispatch(*args, **kw) for args, kw in rounds]
  ref.install(monkeypatch)
  before = [dispatch(*args, **kw) for args, kw in rounds]
  assert any(p.n_long_instances for p in now) and any(len(p.assignments) > 2 for p in now)
  for a, b in zip(now, before):
    assert (a.assignments, a.batch_sizes, a.n_long_instances) == (
        b.assignments,
        b.batch_sizes,
        b.n_long_instances,
    )
    assert a.lengths == b.lengths
    assert a.objective_value == pytest.approx(b.objective_value, rel=1e-9)
    assert a.group_times == pytest.approx(b.group_times, rel=1e-9)


def test_every_objective_the_settings_accept_is_one_dispatch_runs():
  from streamrl.errors import UserError  # pylint: disable=g-import-not-at-top
  from streamrl.scheduling.config import DISPATCH_OBJECTIVES, Scheduler  # pylint: disable=g-import-not-at-top

  for objective in DISPATCH_OBJECTIVES:
    Scheduler(kind="skew", objective=objective).check()
    assert dispatch([5, 1, 3, 2], 2, PAPER, [1], objective=objective).assignments
  with pytest.raises((UserError, ValueError), match="scheduler.objective"):
    Scheduler(kind="skew", objective="mean").check()
