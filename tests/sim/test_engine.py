"""Event engine: closed-form cases, mode formulas, determinism, real scheduler reuse."""

import dataclasses
import math

import numpy as np
import pytest

from streamrl.sim import plans
from streamrl.sim.config import SimConfig, ToolModel
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.engine import simulate
from streamrl.sim.generation import simulate_generation
from streamrl.sim.lengths import FixedLengths, PaperLengths, from_lengths

pytestmark = [pytest.mark.unit]

A, B = 0.01, 0.001  # PTL(BS) = A + B * BS


def _gen(c=0.0, prefill=0.0, kv=math.inf, max_num_seqs=256):
  return GenCostModel(
      step_fixed_s=A,
      per_seq_s=B,
      per_ctx_token_s=c,
      prefill_s_per_token=prefill,
      kv_capacity_tokens=kv,
      max_num_seqs=max_num_seqs,
  )


def test_one_instance_fixed_lengths_exact_makespan():
  r = simulate_generation(_gen(), 1, [8] * 4, [100] * 4, queues=[[0, 1, 2, 3]], caps=[4])
  assert r.makespan == pytest.approx(100 * (A + 4 * B))
  assert np.allclose(r.finish_times, 100 * (A + 4 * B))


def test_waves_when_batch_is_capped():
  r = simulate_generation(_gen(), 1, [8] * 4, [100] * 4, queues=[[0, 1, 2, 3]], caps=[2])
  assert r.makespan == pytest.approx(2 * 100 * (A + 2 * B))


def test_continuous_batching_shrinks_batch_and_refills():
  # Lengths 10, 30 with cap 2 and a third prompt of 5 tokens waiting:
  # steps 1-10 at BS 2; prompt 2 admitted; steps 11-15 at BS 2; 16-30 at BS 1.
  r = simulate_generation(_gen(), 1, [4, 4, 4], [10, 30, 5], queues=[[0, 1, 2]], caps=[2])
  expect = 10 * (A + 2 * B) + 5 * (A + 2 * B) + 15 * (A + B)
  assert r.makespan == pytest.approx(expect)
  assert r.finish_times[0] == pytest.approx(10 * (A + 2 * B))
  assert r.finish_times[2] == pytest.approx(15 * (A + 2 * B))


def test_time_sharing_a_core_costs_its_measured_share_cost():
  # Two instances, one request of 100 steps each, on one core: perfect
  # sharing runs both at half speed (200 steps' time); a share cost of 1.5
  # makes each shared step 1.5x dearer. Alone on the core nothing changes.
  step = A + B
  kw = dict(queues=[[0], [1]], caps=[1, 1], cores=1)
  perfect = simulate_generation(_gen(), 2, [8, 8], [100, 100], **kw)
  costly = simulate_generation(_gen(), 2, [8, 8], [100, 100], share_cost=1.5, **kw)
  assert perfect.makespan == pytest.approx(200 * step)
  assert costly.makespan == pytest.approx(1.5 * 200 * step)
  # Once one instance is done the other runs alone, at full speed: 50 shared
  # steps of each (75 steps' time each at 1.5 x 2), then 50 alone.
  mixed = simulate_generation(_gen(), 2, [8, 8], [50, 100], share_cost=1.5, **kw)
  assert mixed.makespan == pytest.approx(2 * 1.5 * 50 * step + 50 * step)
  alone = simulate_generation(
      _gen(), 1, [8], [100], queues=[[0]], caps=[1], cores=1, share_cost=1.5
  )
  assert alone.makespan == pytest.approx(100 * step)
  with pytest.raises(ValueError, match="share_cost"):
    simulate_generation(_gen(), 2, [8, 8], [100, 100], share_cost=0.5, **kw)


def test_a_shared_pool_lets_the_free_instance_take_the_next_request():
  # Instance 0 gets lengths 100 and 10, instance 1 gets 10 and 10, one at a time.
  # Fixed lists: instance 0 runs 110 steps. Shared (interleaved 0, 2, 1, 3):
  # instance 1 finishes 10 at step 10 and takes the next, so the long one is
  # alone on instance 0 and the round ends at step 100.
  lens = [100, 10, 10, 10]
  kw = dict(queues=[[0, 1], [2, 3]], caps=[1, 1])
  fixed = simulate_generation(_gen(), 2, [4] * 4, lens, **kw)
  shared = simulate_generation(_gen(), 2, [4] * 4, lens, pool="shared", **kw)
  assert fixed.makespan == pytest.approx(110 * (A + B))
  assert shared.makespan == pytest.approx(100 * (A + B))
  assert shared.finish_times[3] == pytest.approx(30 * (A + B))
  # More instances than requests: the spare ones end at once.
  spare = simulate_generation(_gen(), 3, [4] * 2, [10, 20], queues=[[0], [1], []], pool="shared")
  assert spare.makespan == pytest.approx(20 * (A + 2 * B) - 10 * B)
  with pytest.raises(ValueError, match="pool must be one of"):
    simulate_generation(_gen(), 1, [4], [4], pool="bogus")


def test_migration_moves_the_longest_running_request_to_the_idle_instance():
  # Instance 0 runs two 100-token requests, instance 1 one of 10. When 1 goes idle (at
  # 10 steps of BS 1), instance 0 is 9 whole steps in (BS 2 steps are slower); its request
  # with the most tokens moves to 1 and resumes there from 9 tokens, each instance finishes
  # its 91 left alone.
  kw = dict(queues=[[0, 2], [1]], caps=[2, 2], pool="shared")  # interleaved: 0, 1 | 2
  stay = simulate_generation(_gen(), 2, [4] * 3, [100, 100, 10], **kw)
  moved = simulate_generation(_gen(), 2, [4] * 3, [100, 100, 10], migrate=True, **kw)
  assert stay.makespan == pytest.approx(100 * (A + 2 * B)) and stay.moves == 0
  assert moved.moves == 1
  assert moved.makespan == pytest.approx(10 * (A + B) + 91 * (A + B))
  # A lone request is not moved (nothing gained), and migration needs the shared pool.
  lone = simulate_generation(
      _gen(), 2, [4] * 2, [100, 10], queues=[[0], [1]], caps=[1, 1], pool="shared", migrate=True
  )
  assert lone.moves == 0
  with pytest.raises(ValueError, match="shared"):
    simulate_generation(_gen(), 2, [4] * 2, [100, 10], queues=[[0], [1]], migrate=True)


def test_context_term_and_prefill_closed_form():
  c, p = 1e-5, 2e-4
  # One sequence, prompt 50, 20 tokens: sum_k (A + B + c * (50 + k)), k = 0..19, plus prefill of 50.
  r = simulate_generation(_gen(c=c, prefill=p), 1, [50], [20], queues=[[0]], caps=[1])
  expect = 50 * p + sum(A + B + c * (50 + k) for k in range(20))
  assert r.makespan == pytest.approx(expect)


def test_kv_overflow_preempts_newest_and_recomputes():
  # Capacity 150 tokens; two sequences (prompt 10, 100 tokens each) both admitted (S = 20),
  # S grows by 2/step: after 65 steps S = 150 -> the newest is preempted at context 75.
  # The first finishes 35 steps later alone; then the second re-prefills 75 tokens and
  # generates its last 35 tokens alone.
  p = 1e-4
  r = simulate_generation(
      _gen(prefill=p, kv=150), 1, [10, 10], [100, 100], queues=[[0, 1]], caps=[2]
  )
  assert r.preemptions == 1
  expect = 20 * p + 65 * (A + 2 * B) + 35 * (A + B) + 75 * p + 35 * (A + B)
  assert r.makespan == pytest.approx(expect)
  assert r.finish_times[0] < r.finish_times[1]


def test_too_long_for_kv_cache_is_a_clear_error():
  with pytest.raises(ValueError, match="KV cache"):
    simulate_generation(_gen(kv=50), 1, [10], [100], queues=[[0]], caps=[1])


def _trivial(mode, *, out_len=100, fwd=2e-4, upd=6e-4, transfer=0.1, iterations=5, **kw):
  """P samples of equal length on 2 instances: every sample finishes at G."""
  return SimConfig(
      mode=mode,
      gen=_gen(),
      num_instances=2,
      train=TrainCostModel.from_measured(fwd_s_per_token=fwd, upd_s_per_token=upd),
      trainer_gpus=1,
      lengths=FixedLengths(prompt_len=10, output_len=out_len),
      samples_per_iteration=8,
      mini_batch_size=4,
      num_iterations=iterations,
      transfer_s=transfer,
      **kw,
  )


def _stage_times(cfg):
  g = cfg.lengths.output_len * (A + 4 * B)  # 4 samples per instance, one wave
  t = (
      cfg.samples_per_iteration
      * (cfg.lengths.prompt_len + cfg.lengths.output_len)
      * (cfg.train.fwd_s_per_token + cfg.train.upd_s_per_token)
  )
  return g, t


@pytest.mark.parametrize("mode", ["sync", "stream", "colocated", "verl"])
def test_on_policy_modes_iteration_is_gen_plus_train_plus_transfer(mode):
  cfg = _trivial(mode)
  g, t = _stage_times(cfg)
  r = simulate(cfg)
  assert r.mean_iteration_s == pytest.approx(g + t + cfg.transfer_s)
  assert np.allclose(r.iteration_times[1:], g + t + cfg.transfer_s)


@pytest.mark.parametrize("out_len,upd", [(100, 6e-4), (100, 6e-3)])
def test_async_iteration_is_the_slower_stage(out_len, upd):
  cfg = _trivial("async", out_len=out_len, upd=upd, iterations=6)
  g, t = _stage_times(cfg)
  assert (t < g) == (upd == 6e-4)  # one case of each
  r = simulate(cfg)
  assert r.mean_iteration_s == pytest.approx(max(g, t))


def test_stream_beats_sync_with_skewed_lengths():
  lengths = from_lengths([10, 20, 40, 400], 8)
  kw = dict(fwd=1e-4, upd=3e-4, transfer=0.0, iterations=4)
  base = _trivial("sync", **kw)

  base = dataclasses.replace(base, lengths=lengths, samples_per_iteration=64, mini_batch_size=32)
  sync = simulate(base)
  stream = simulate(dataclasses.replace(base, mode="stream"))
  asyn = simulate(dataclasses.replace(base, mode="async"))
  assert sync.samples_per_s < stream.samples_per_s < asyn.samples_per_s


def _paper_cfg(seed, scheduler="skew"):
  return SimConfig(
      mode="async",
      gen=_gen(c=2e-8),
      num_instances=4,
      train=TrainCostModel.from_measured(fwd_s_per_token=1e-6, upd_s_per_token=3e-6),
      trainer_gpus=1,
      lengths=PaperLengths(max_output=2048),
      samples_per_iteration=128,
      num_iterations=3,
      mini_batch_size=32,
      scheduler=scheduler,
      ranker_sigma=0.2,
      seed=seed,
  )


def test_deterministic_under_seed():
  a, b, c = simulate(_paper_cfg(1)), simulate(_paper_cfg(1)), simulate(_paper_cfg(2))
  assert a.samples_per_s == b.samples_per_s
  assert np.array_equal(a.iteration_times, b.iteration_times)
  assert a.events == b.events
  assert a.samples_per_s != c.samples_per_s


def test_skew_scheduler_uses_the_project_dispatcher(monkeypatch):
  calls = []
  real = plans.dispatch

  def spy(*args, **kw):
    calls.append(kw)
    return real(*args, **kw)

  monkeypatch.setattr(plans, "dispatch", spy)
  simulate(_paper_cfg(0, "skew"))
  assert len(calls) == 3  # once per iteration
  calls.clear()
  simulate(_paper_cfg(0, "fifo"))
  assert not calls


def test_bad_config_errors():
  with pytest.raises(ValueError, match="mode"):
    _trivial("bogus")
  with pytest.raises(ValueError, match="scheduler"):
    _trivial("sync", scheduler="lifo")


def test_the_simulate_latency_model_gets_the_noisy_rankers_error_on_recent_lengths(monkeypatch):
  # As in a run, "simulate" times splits over the ranker's real error: the
  # recent round's lengths at the ranks a ranker of the same noise gives them.
  from streamrl.scheduling.dispatch import MIN_RANK_HISTORY

  seen = []
  real = plans.dispatch
  monkeypatch.setattr(
      plans, "dispatch", lambda *a, **kw: seen.append(dict(kw, profile=a[2])) or real(*a, **kw)
  )
  rng = np.random.default_rng(0)
  out = rng.integers(1, 300, size=256)
  recent = rng.integers(1, 300, size=256)
  for model in ("simulate", "paper"):
    r = simulate_generation(
        _gen(c=1e-5),
        4,
        [8] * 256,
        out,
        scheduler="skew",
        ranker_sigma=0.5,
        recent_lengths=recent,
        latency_model=model,
    )
    assert np.all(np.isfinite(r.finish_times)) and r.makespan > 0
  sim, paper = seen
  assert paper["rank_history"] is None
  # The replay grows each request's context itself: PTL at the prompt alone
  # plus the cost per context token; the paper formula's PTL holds a context.
  assert sim["profile"].context_s_per_token == 1e-5 and paper["profile"].context_s_per_token == 0
  assert sim["profile"].ptl(8) < paper["profile"].ptl(8)
  hist = np.asarray(sim["rank_history"])
  assert len(hist) == len(recent) >= MIN_RANK_HISTORY
  assert sorted(hist[:, 1]) == sorted(recent)  # the recent lengths, not this round's
  assert sorted(hist[:, 0]) == [k / len(recent) for k in range(len(recent))]
  # Noisy, yet the ranks follow the lengths.
  assert np.corrcoef(hist[:, 0], hist[:, 1])[0, 1] > 0.5


def test_a_trajectory_leaves_the_batch_for_each_tool_call_and_returns_with_its_observation():
  p = 2e-4
  tools = ToolModel(latency_s=0.5, turn_tokens=10, observation_tokens=5)
  assert list(tools.calls([1, 10, 11, 25])) == [0, 0, 1, 2]
  # One trajectory of 25 tokens: turns of 10, 10, 5 with two calls of 0.5 s between them;
  # each return prefills only its observation (the context before it is cached).
  r = simulate_generation(_gen(prefill=p), 1, [8], [25], queues=[[0]], caps=[1], tools=tools)
  expect = (8 + 5 + 5) * p + 25 * (A + B) + 2 * 0.5
  assert r.makespan == pytest.approx(expect)
  # Two trajectories, one short: the engine decodes the second while the first waits on
  # its tool, so the latency is hidden where there is other work.
  r2 = simulate_generation(_gen(), 1, [8, 8], [20, 10], queues=[[0, 1]], caps=[2], tools=tools)
  # Steps 1-10 at BS 2; 0 calls its tool, 1 finishes; the engine idles 0.5 s; 0's second
  # turn decodes alone.
  assert r2.finish_times[1] == pytest.approx(10 * (A + 2 * B))
  assert r2.makespan == pytest.approx(10 * (A + 2 * B) + 0.5 + 10 * (A + B))
  # Without tools the same lengths are one turn each.
  r3 = simulate_generation(_gen(), 1, [8, 8], [20, 10], queues=[[0, 1]], caps=[2])
  assert r3.makespan == pytest.approx(10 * (A + 2 * B) + 10 * (A + B))


def test_tool_latency_is_hidden_by_other_work_and_async_gains_from_it():
  # Many trajectories on one instance: the latency of one is covered by the others'
  # decoding, so generation grows far less than calls x latency; and an async run overlaps
  # the longer generation with training.
  lengths = from_lengths([20, 40, 80], 64)
  tools = ToolModel(latency_s=0.2, turn_tokens=20, observation_tokens=4)
  cfg = _trivial("colocated", iterations=4)

  base = dataclasses.replace(cfg, lengths=lengths, samples_per_iteration=64, mini_batch_size=32)
  plain = simulate(base)
  with_tools = simulate(dataclasses.replace(base, tools=tools))
  calls = tools.calls([20, 40, 80]).mean() * 64
  extra = with_tools.mean_iteration_s - plain.mean_iteration_s
  assert 0.2 <= extra < 0.5 * calls * 0.2
  async_tools = simulate(dataclasses.replace(base, tools=tools, mode="async", num_iterations=6))
  assert async_tools.mean_iteration_s < with_tools.mean_iteration_s
  with pytest.raises(ValueError, match="turn_tokens"):
    ToolModel(latency_s=0.1, turn_tokens=0)


class _Queue:
  """Output lengths in the order given, then again, whatever the rng (prompts of 8)."""

  def __init__(self, outs):
    self.outs, self.k = list(outs), 0

  def sample(self, rng, n):
    del rng
    out = [self.outs[(self.k + i) % len(self.outs)] for i in range(n)]
    self.k += n
    return np.full(n, 8), np.asarray(out)


def test_partial_rollouts_stop_at_the_target_carry_the_tokens_and_drop_too_old_ones():
  # One group trained per iteration, one extra: round 0 runs [10, 100]; the short one
  # finishes at step 10 and stops the round, the long one keeps 10 tokens and resumes
  # first next round (prefilling its prompt + 10 tokens), beside a fresh 10. In round 2
  # its oldest token (round 0, weights version -1) would be 3 versions old at training
  # (> max_token_version_gap=2): it starts again, its 20 tokens wasted.
  prefill = 1e-4
  cfg = dataclasses.replace(
      _trivial("async", iterations=4, fwd=1e-6, upd=1e-6),
      gen=_gen(prefill=prefill),
      num_instances=1,
      lengths=_Queue([10, 100, 10, 10, 10]),
      samples_per_iteration=1,
      mini_batch_size=1,
      partial_oversample=1.0,
      max_token_version_gap=2,
  )
  planned = []
  real = plans.first_k_plan

  def spy(lengths, n, max_bs, first=()):
    planned.append(list(first))
    return real(lengths, n, max_bs, first=first)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(plans, "first_k_plan", spy)
    r = simulate(dataclasses.replace(cfg, scheduler="skew"))
  assert r.resumed == (0, 1, 0, 1)
  assert planned == [[], [0], [], [0]]  # the resumed response is planned first
  assert r.wasted_tokens == 20
  assert [int(s.output_lens[0]) for s in r.iterations] == [10, 10, 10, 10]
  step = 10 * (A + 2 * B)
  fresh, resumed = 2 * 8 * prefill, (8 + 8 + 10) * prefill
  gen = [s.gen_time for s in r.iterations]
  assert gen == pytest.approx([step + fresh, step + resumed, step + fresh, step + resumed])
  # Without partial rollouts every round waits for the 100-token response.
  plain = simulate(dataclasses.replace(cfg, partial_oversample=0.0, lengths=from_lengths([100], 8)))
  assert min(s.gen_time for s in plain.iterations) > 5 * max(gen)
  # A generous bound keeps every carried token; one equal to the staleness resumes nothing.
  kept = simulate(
      dataclasses.replace(cfg, lengths=_Queue([10, 100, 10, 10, 10]), max_token_version_gap=9)
  )
  assert kept.wasted_tokens == 0 and kept.resumed == (0, 1, 1, 1)
  none = simulate(
      dataclasses.replace(cfg, lengths=_Queue([10, 100, 10, 10, 10, 10]), max_token_version_gap=1)
  )
  assert none.resumed == (0, 0, 0, 0) and none.wasted_tokens > 0
  with pytest.raises(ValueError, match="async"):
    dataclasses.replace(cfg, mode="sync")
  with pytest.raises(ValueError, match="multiple of group_size"):
    dataclasses.replace(cfg, samples_per_iteration=3, group_size=2)


def test_partial_rollouts_cut_the_long_tail_of_a_generation_bound_run():
  lengths = from_lengths([10] * 15 + [400], 8)
  base = dataclasses.replace(
      _trivial("async", iterations=8, fwd=1e-7, upd=1e-7),
      lengths=lengths,
      samples_per_iteration=32,
      mini_batch_size=16,
  )
  plain = simulate(base)
  partial = simulate(dataclasses.replace(base, partial_oversample=0.25, group_size=2))
  assert partial.samples_per_s > 1.5 * plain.samples_per_s
  assert sum(partial.resumed) > 0
  # Every iteration trains whole groups of the batch.
  assert all(len(s.output_lens) == 32 for s in partial.iterations)


def test_stream_trains_its_later_epochs_after_generation():
  # One instance, outputs 10, 10, 100, 100 (prompts of 8), mini-batches of 2, 2 epochs.
  # The two short samples finish at t1 and make the first mini-batch: its forward and first
  # epoch run during generation. At t2 the rest arrives: the second mini-batch's forward and
  # first epoch, then the second epoch over both.
  f, u = 1e-4, 3e-4
  cfg = dataclasses.replace(
      _trivial("stream", iterations=1, fwd=f, upd=u),
      num_instances=1,
      lengths=_Queue([10, 10, 100, 100]),
      samples_per_iteration=4,
      mini_batch_size=2,
      ppo_epochs=2,
  )
  t2 = 10 * (A + 4 * B) + 90 * (A + 2 * B)
  r = simulate(cfg)
  assert r.iterations[0].gen_end == pytest.approx(t2)
  assert r.iterations[0].train_end == pytest.approx(t2 + 2 * 108 * f + 108 * u + 126 * u)
  one = simulate(dataclasses.replace(cfg, lengths=_Queue([10, 10, 100, 100]), ppo_epochs=1))
  assert one.iterations[0].train_end == pytest.approx(t2 + 2 * 108 * f + 216 * u)
  with pytest.raises(ValueError, match="ppo_epochs"):
    dataclasses.replace(cfg, ppo_epochs=0)


def test_the_rankers_refresh_takes_its_leftover_from_the_next_round():
  # Sync, one instance: each round is followed by training (T) and the push (P); a refresh of
  # R seconds on the generators' core from the round's end leaves max(0, R - T - P) for the
  # next round, which starts generating that much later (its generation time holds it).
  cfg = dataclasses.replace(
      _trivial("sync", iterations=3, fwd=1e-4, upd=3e-4),
      num_instances=1,
      lengths=_Queue([10, 10, 100, 100]),
      samples_per_iteration=4,
      mini_batch_size=2,
      transfer_s=0.05,
  )
  base = simulate(cfg)
  it = base.iterations[0]
  gap = base.iterations[1].gen_start - it.gen_end  # training + push
  for r in (0.5 * gap, gap + 0.2):
    slow = simulate(
        dataclasses.replace(cfg, lengths=_Queue([10, 10, 100, 100]), ranker_refresh_s=r)
    )
    extra = max(0.0, r - gap)
    for a, b in zip(base.iterations[1:], slow.iterations[1:]):
      assert b.gen_time == pytest.approx(a.gen_time + extra)
    assert slow.iterations[0].gen_time == pytest.approx(it.gen_time)  # no refresh before it
  with pytest.raises(ValueError, match="ranker_refresh_s"):
    dataclasses.replace(cfg, ranker_refresh_s=-1.0)


def test_a_round_on_added_instances_starts_later_by_their_first_rounds_cost():
  # Rounds on 1, 3, 3, 1 instances: round 1 added two, so it starts generating
  # 2 * added_round_s later; the rounds that keep or drop instances do not.
  counts = [1, 3, 3, 1]
  cfg = dataclasses.replace(
      _trivial("sync", iterations=4, fwd=1e-4, upd=3e-4),
      num_instances=1,
      lengths=_Queue([10, 10, 100, 100]),
      samples_per_iteration=4,
      mini_batch_size=2,
  )
  ctl = lambda g, stats: counts[g]  # pylint: disable=unnecessary-lambda-assignment
  base = simulate(cfg, controller=ctl)
  slow = simulate(
      dataclasses.replace(cfg, lengths=_Queue([10, 10, 100, 100]), added_round_s=0.25),
      controller=ctl,
  )
  extra = [0.0, 0.5, 0.0, 0.0]
  for a, b, e in zip(base.iterations, slow.iterations, extra):
    assert b.num_instances == a.num_instances
    assert b.gen_time == pytest.approx(a.gen_time + e)
  with pytest.raises(ValueError, match="added_round_s"):
    dataclasses.replace(cfg, added_round_s=float("nan"))
