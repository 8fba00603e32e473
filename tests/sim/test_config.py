"""SimConfig: a run's settings under their own names."""

import dataclasses

import pytest

from streamrl.config import settings
from streamrl.sim.config import SimConfig
from streamrl.sim.costs import GenCostModel, TrainCostModel
from streamrl.sim.engine import simulate
from streamrl.sim.lengths import from_lengths

pytestmark = [pytest.mark.unit]

GEN = GenCostModel(
    step_fixed_s=0.01,
    per_seq_s=0.001,
    per_ctx_token_s=0.0,
    prefill_s_per_token=0.0,
    kv_capacity_tokens=float("inf"),
)
TRAIN = TrainCostModel.from_measured(fwd_s_per_token=1e-5, upd_s_per_token=3e-5)
LENGTHS = from_lengths([10, 40, 200], 8)


def _settings(**parts):
  s = settings.Settings()
  return s.replace(**{p: dataclasses.replace(getattr(s, p), **kw) for p, kw in parts.items()})


def test_every_field_named_as_a_setting_comes_from_the_settings():
  s = _settings(
      pipeline=dict(
          mode="async",
          max_staleness=2,
          partial="on",
          partial_oversample=0.5,
          max_token_version_gap=3,
      ),
      engine=dict(num_instances=3),
      cluster=dict(trainer_gpus=2),
      trainer=dict(num_iterations=4, prompts_per_iteration=8, mini_batch_size=16, ppo_epochs=3),
      advantage=dict(group_size=4),
      scheduler=dict(
          kind="skew", long_tail_alpha=0.3, latency_model="simulate", pool="shared", migrate=True
      ),
  ).replace(seed=7)
  c = SimConfig.from_settings(s, gen=GEN, train=TRAIN, lengths=LENGTHS, ranker_sigma=0.4)
  leaves = {
      f.name: getattr(getattr(s, p), f.name)
      for p, cls in settings.PARTS.items()
      for f in dataclasses.fields(cls)
  }
  named = [f.name for f in dataclasses.fields(SimConfig) if f.name in leaves]
  assert sorted(named) == sorted(
      [
          "mode",
          "num_instances",
          "trainer_gpus",
          "num_iterations",
          "mini_batch_size",
          "ppo_epochs",
          "long_tail_alpha",
          "objective",
          "latency_model",
          "pool",
          "migrate",
          "max_staleness",
          "partial_oversample",
          "max_token_version_gap",
          "group_size",
      ]
  )
  assert {n: getattr(c, n) for n in named} == {n: leaves[n] for n in named}
  assert (c.scheduler, c.samples_per_iteration, c.seed) == ("skew", 32, 7)
  assert c.partial and c.num_minibatches == 2 and c.ranker_sigma == 0.4
  assert simulate(c).samples_per_s > 0


def test_what_the_run_turns_off_or_means_otherwise():
  off = SimConfig.from_settings(
      _settings(pipeline=dict(mode="async", partial="off")), gen=GEN, train=TRAIN, lengths=LENGTHS
  )
  assert not off.partial and off.trainer_gpus == 1  # a CPU trainer is one device
  oracle = SimConfig.from_settings(
      _settings(scheduler=dict(kind="oracle")),
      gen=GEN,
      train=TRAIN,
      lengths=LENGTHS,
      ranker_sigma=0.5,
  )
  assert (oracle.scheduler, oracle.ranker_sigma) == ("skew", 0.0)
  with pytest.raises(ValueError, match="settings"):
    SimConfig.from_settings(
        settings.Settings(), gen=GEN, train=TRAIN, lengths=LENGTHS, long_tail_alpha=0.5
    )


def test_the_schedulers_defaults_are_the_runs():
  sched = settings.Scheduler()
  c = SimConfig(
      mode="sync",
      gen=GEN,
      num_instances=1,
      train=TRAIN,
      trainer_gpus=1,
      lengths=LENGTHS,
      samples_per_iteration=8,
      num_iterations=1,
      mini_batch_size=8,
  )
  assert (c.scheduler, c.long_tail_alpha, c.objective, c.latency_model, c.pool, c.migrate) == (
      sched.kind,
      sched.long_tail_alpha,
      sched.objective,
      sched.latency_model,
      sched.pool,
      sched.migrate,
  )
