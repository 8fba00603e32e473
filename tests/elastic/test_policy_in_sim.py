"""ElasticPolicy in the simulator: timing of its decisions, shared generator cores.

The workload is a small generation-bound run shaped like the local bench
(step-cost dominated PTL profile, 4 requests in flight, a fast trainer).
"""

import dataclasses

import numpy as np
import pytest

from streamrl.elastic.policy import ElasticPolicy, StageTimes
from streamrl.sim.elastic import policy_controller
from streamrl.sim.calibrate import from_measured, predict_elastic_throughput
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.config import SimConfig
from streamrl.sim.engine import simulate
from streamrl.sim.generation import simulate_generation
from streamrl.sim.lengths import PaperLengths, from_lengths

pytestmark = [pytest.mark.unit]

PROFILE = {"batch_sizes": [1, 2, 4], "ptl_s": [0.0021, 0.0022, 0.0024], "prefill_s_per_token": 1e-5}
TRAINER = {"fwd_s_per_token": 2e-6, "upd_s_per_token": 4e-6, "update_overhead_s": 0.005}
OUT = np.random.default_rng(0).integers(16, 64, 64).tolist()
ITERS = 14


def _config(mode, gen_cores=None, transfer_s=0.0, iterations=ITERS):
  gen, train = from_measured(PROFILE, TRAINER, max_num_seqs=4)
  return SimConfig(
      mode=mode,
      gen=gen,
      num_instances=1,
      train=train,
      trainer_gpus=1,
      lengths=from_lengths(OUT, 24),
      samples_per_iteration=32,
      mini_batch_size=16,
      num_iterations=iterations,
      warmup=2,
      transfer_s=transfer_s,
      gen_cores=gen_cores,
  )


def _run(mode, gen_cores=None, free_slots=1 << 30, transfer_s=0.0, **policy):
  kw = {"start_instances": 1, "max_instances": 2, **policy}
  ctl = policy_controller(ElasticPolicy(**kw), free_slots)
  return simulate(_config(mode, gen_cores, transfer_s), controller=ctl), ctl


def _expected_counts(result, start):
  """Round j runs on start + the deltas of every decision made (at its
  iteration's training end) no later than round j's start."""
  ends = {s.index: s.train_end for s in result.iterations}
  counts = []
  for s in result.iterations:
    made = [d.delta for d in result.decisions if ends[d.iteration] <= s.gen_start]
    counts.append(start + sum(made))
  return counts


@pytest.mark.parametrize("mode", ["sync", "stream", "colocated"])
def test_forced_schedule_applies_to_the_next_round(mode):
  r, ctl = _run(mode, schedule="2:+1,4:-1", transfer_s=0.01)
  assert list(r.instances) == [1, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
  assert [(d.iteration, d.delta) for d in r.decisions] == [(2, 1), (4, -1)]
  assert ctl.applied == {2: 3, 4: 5}
  assert [s.num_instances for s in r.iterations] == list(r.instances)
  assert ctl.instances == dict(enumerate(r.instances))


def test_forced_schedule_in_async_waits_for_the_round_after_the_decision():
  # Round 3 starts (weights of iteration 1) while iteration 2 still trains, so
  # the change decided after iteration 2 reaches round 4 (and after 4, round 6).
  r, ctl = _run("async", schedule="2:+1,4:-1")
  its = r.iterations
  assert its[3].gen_start < its[2].train_end < its[4].gen_start
  assert list(r.instances) == [1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
  assert ctl.applied == {2: 4, 4: 6}
  assert list(r.instances) == _expected_counts(r, 1)


def test_no_free_slot_blocks_a_scheduled_addition():
  r, ctl = _run("sync", free_slots=lambda it, n: 0, schedule="2:+1")
  assert set(r.instances) == {1}
  assert not r.decisions
  assert "no free slot" in ctl.looks[2].reason


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_addition_pays_on_own_hardware_not_on_one_shared_core(mode):
  own, _ = _run(mode, gen_cores=None)
  shared, _ = _run(mode, gen_cores=1)
  # Own hardware: added after the first full window, judged, kept.
  assert [d.delta for d in own.decisions] == [1]
  assert own.instances[-1] == 2
  # One core: the same rule adds it, measures no saving and releases it.
  assert [d.delta for d in shared.decisions[:2]] == [1, -1]
  assert "released" in shared.decisions[1].reason
  assert shared.decisions[0].iteration == own.decisions[0].iteration
  # Later tries wait for the (doubling) cooldown and fail the same way.
  assert all(d.delta == (1 if k % 2 == 0 else -1) for k, d in enumerate(shared.decisions))
  assert own.samples_per_s > 1.6 * shared.samples_per_s


@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
@pytest.mark.parametrize("gen_cores", [None, 1])
def test_sim_decisions_equal_a_direct_replay(mode, gen_cores):
  kw = {"start_instances": 1, "max_instances": 3, "observe_iterations": 2}
  r, ctl = _run(mode, gen_cores=gen_cores, **kw)
  replay = ElasticPolicy(**kw)
  looks = [
      replay.decide(StageTimes(s.index, s.num_instances, s.gen_end - s.gen_start, s.train_busy))
      for s in r.iterations
  ]
  assert looks == ctl.looks
  assert len(looks) == ITERS  # the decisions after the last rounds started too
  assert tuple(replay.decisions) == r.decisions
  assert r.decisions  # the workload does make the policy act
  assert list(r.instances) == _expected_counts(r, 1)


# Results of the engine before gen_cores existed (same configs, same seeds).
_OLD = {
    "sync": (7.105661818538374, 66.33212309999999, 65, 539),
    "async": (11.413786057669773, 41.97340309999998, 65, 725),
    "stream": (9.97130036439547, 46.84040159999996, 65, 728),
}


@pytest.mark.parametrize("mode", sorted(_OLD))
def test_gen_cores_none_reproduces_the_old_engine(mode):
  gen = GenCostModel(
      step_fixed_s=0.002,
      per_seq_s=0.001,
      per_ctx_token_s=1e-7,
      prefill_s_per_token=1e-5,
      kv_capacity_tokens=8000.0,
      max_num_seqs=32,
  )
  train = TrainCostModel.from_measured(
      fwd_s_per_token=2e-5, upd_s_per_token=6e-5, fwd_overhead_s=0.01, update_overhead_s=0.02
  )
  cfg = SimConfig(
      mode=mode,
      gen=gen,
      num_instances=3,
      train=train,
      trainer_gpus=1,
      lengths=PaperLengths(max_output=600),
      samples_per_iteration=96,
      num_iterations=5,
      mini_batch_size=24,
      scheduler="skew",
      objective="sum",
      ranker_sigma=0.3,
      transfer_s=0.05,
      seed=3,
  )
  r = simulate(cfg)
  assert (r.samples_per_s, float(r.iteration_times.sum()), r.preemptions, r.events) == _OLD[mode]
  assert r.instances == (3,) * 5 and r.decisions == ()
  # As many cores as instances: nothing is shared, the very same run.
  same = simulate(dataclasses.replace(cfg, gen_cores=3))
  assert same.samples_per_s == r.samples_per_s and same.events == r.events
  slower = simulate(dataclasses.replace(cfg, gen_cores=2))
  assert slower.samples_per_s < r.samples_per_s


def test_shared_core_is_processor_sharing():
  # Two single-sequence instances on one core: both run at half speed until the
  # shorter one ends, then the longer one has the core alone.
  gen, _ = from_measured(PROFILE, TRAINER, max_num_seqs=1)
  step, pre = gen.step_time(1, 0), 10 * gen.prefill_s_per_token
  r = simulate_generation(gen, 2, [10, 10], [100, 50], queues=[[0], [1]], caps=[1, 1], cores=1)
  short, long = pre + 50 * step, pre + 100 * step
  assert r.instance_done[1] == pytest.approx(2 * short)
  assert r.instance_done[0] == pytest.approx(2 * short + (long - short))
  own = simulate_generation(gen, 2, [10, 10], [100, 50], queues=[[0], [1]], caps=[1, 1])
  assert own.makespan == pytest.approx(long)


def test_bad_gen_cores():
  with pytest.raises(ValueError):
    _config("sync", gen_cores=0)


def test_predict_elastic_throughput():
  kw = dict(
      output_lens=OUT,
      prompt_lens=24,
      batch_size=32,
      max_in_flight=4,
      num_minibatches=2,
      iterations=ITERS,
      warmup=2,
  )
  pol = {"start_instances": 1, "max_instances": 2}
  own = predict_elastic_throughput(PROFILE, TRAINER, "sync", policy_kwargs=pol, **kw)
  shared = predict_elastic_throughput(
      PROFILE, TRAINER, "sync", policy_kwargs=pol, gen_cores=1, **kw
  )
  for p in (own, shared):
    assert len(p["instances"]) == len(p["gen_s"]) == len(p["train_s"]) == ITERS
    # Samples over the summed iteration times of the measured iterations.
    t = sum(p["iteration_s"][2:])
    assert p["samples_per_s"] == pytest.approx(32 * (ITERS - 2) / t)
  # Iteration 0 is the policy's warm-up; with two iterations observed it decides after 2.
  assert [(d["iteration"], d["delta"], d["first_round"]) for d in own["decisions"]] == [(2, 1, 3)]
  assert own["instances"] == [1, 1, 1] + [2] * (ITERS - 3)
  assert [d["delta"] for d in shared["decisions"][:2]] == [1, -1]
  assert own["samples_per_s"] > 1.6 * shared["samples_per_s"]
  # Per-iteration lengths: longer outputs later give longer generation rounds.
  grow = [[o * (1 + j // 7) for o in OUT] for j in range(ITERS)]
  g = predict_elastic_throughput(
      PROFILE,
      TRAINER,
      "sync",
      policy_kwargs={"start_instances": 1, "max_instances": 1},
      output_lens_per_iteration=grow,
      **{**kw, "output_lens": None},
  )
  assert np.mean(g["gen_s"][7:]) > 1.5 * np.mean(g["gen_s"][:7])
  assert g["decisions"] == [] and set(g["instances"]) == {1}
  with pytest.raises(ValueError):
    predict_elastic_throughput(
        PROFILE, TRAINER, "sync", output_lens_per_iteration=grow[:3], **{**kw, "output_lens": None}
    )
