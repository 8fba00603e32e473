"""The skew scheduler's ranker refreshed in its own Ray actor beside the
generators: it predicts and refreshes exactly as the in-process ranker does,
and the scheduler predicts with the parameters of its newest refresh."""

import os

import numpy as np
import pytest
import ray

from streamrl.config import settings
from streamrl.data import tokenizer
from streamrl.generator.rollout import Sample
from streamrl.scheduling import ranker_actor
from streamrl.scheduling.scheduler import GenerationScheduler

pytestmark = [pytest.mark.ray]


@pytest.fixture(scope="module")
def local_ray():
  if ray.is_initialized():
    ray.shutdown()
  ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
  yield
  ray.shutdown()


def rounds(seed=0, n=24, rounds=3):
  rng = np.random.default_rng(seed)
  out = []
  for r in range(rounds):
    reqs, samples = [], []
    for i in range(n):
      prompt = [tokenizer.BOS_ID] + [int(x) for x in rng.integers(4, 30, 1 + i % 7)]
      length = 2 + 3 * (i % 7) + int(rng.integers(0, 3))
      reqs.append((r * n + i, prompt))
      samples.append(Sample(r * n + i, tuple(prompt), (5,) * length, (0.0,) * length, "stop", r, 0))
    out.append((reqs, samples))
  return out


def test_the_ranker_actor_predicts_and_refreshes_as_in_process(local_ray, tmp_path):
  model_dir = str(tmp_path)
  tokenizer.save_hf_tokenizer(model_dir)
  sched = settings.Scheduler(kind="skew", ranker_config="configs/ranker.py:tiny")
  kw = dict(model_dir=model_dir, workdir=None, num_instances=2, max_batch_size=8)
  here = GenerationScheduler(sched, **kw)
  there = GenerationScheduler(sched, **kw, helper=({"num_cpus": 0}, None))
  assert here.ranker is not None and there._actor is not None
  # Background work: the actor yields the CPU to generators and trainer.
  pid = ray.get(there._actor.__ray_call__.remote(lambda self: os.getpid()))
  mine_nice = os.getpriority(os.PRIO_PROCESS, 0)
  assert os.getpriority(os.PRIO_PROCESS, pid) >= min(19, mine_nice + ranker_actor.NICE)
  mine, theirs = [], []
  for reqs, samples in rounds():
    prompts = [list(p) for _, p in reqs]
    # Every refresh so far done: the plan takes the newest (never waits for it).
    ray.wait([m for m, _ in there._refreshes], num_returns=len(there._refreshes))
    np.testing.assert_allclose(
        ray.get(there._actor.predict.remote(prompts)), here.ranker.predict(prompts), rtol=1e-5
    )
    there._adopt()
    np.testing.assert_allclose(
        there.ranker.predict(prompts), here.ranker.predict(prompts), rtol=1e-5
    )
    assert here.plan(reqs, {}, seed=1) == there.plan(reqs, {}, seed=1)
    # The ranker's own metrics (the scheduler's timings differ run to run;
    # the length sources' metrics are each round's, computed in this process).
    for out, sched_ in ((mine, here), (theirs, there)):
      m = sched_.observe(samples)
      per_source = {k for k in m if k.split("/")[1] in ("recall_at_20", "spearman", "coverage")}
      assert "ranker/recall_at_20/combined" in m
      assert m["scheduler/plan_s"] > 0 and m["scheduler/observe_s"] > 0
      out.append({k: v for k, v in m.items() if k.startswith("ranker/") and k not in per_source})
  # Refreshes are not waited for: a round reports the newest one done by
  # then, which is one of the in-process refreshes up to that round.
  reported = [(k, m) for k, m in enumerate(theirs) if m]
  assert reported and all("ranker/pre_recall20" in m for _, m in reported)
  # The actor also reports how long each refresh held its core.
  assert all(m.pop("ranker/refresh_s") > 0 for _, m in reported)
  for k, m in reported:
    assert any(m == pytest.approx(mine[j], rel=1e-4) for j in range(k + 1)), m
  # A group's samples share a prompt, and its score (scored once).
  reqs = rounds(seed=1, rounds=1)[0][0]
  scored, predict = [], there.ranker.predict
  there.ranker.predict = lambda prompts: scored.append(len(prompts)) or predict(prompts)
  there.plan(reqs + [(i + 10_000, p) for i, p in reqs], {}, seed=1)
  assert scored == [len({tuple(p) for _, p in reqs})]
  assert len(there.estimates) == 2 * len(reqs)
  there.close()
  assert there._actor is None
