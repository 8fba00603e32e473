"""The Stream Generation Service on a local Ray: two tiny vLLM instances.

One Ray and one 2-instance service serve the whole module (start-up is the
slow part). The tests that kill instances come last, in file order.
"""

import collections
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import ray
from flax import nnx

from streamrl.generator.config import Sampling
from streamrl.models import config as model_config
from streamrl.models import hf, tiny, transformer
from streamrl import cluster
from streamrl.config import settings
from streamrl.generator import service

pytestmark = [pytest.mark.engine, pytest.mark.ray]

SAMPLING = Sampling(temperature=1.0, max_tokens=8)
SEED = 11


def requests(n, start=0):
  return [
      (i, [1] + [4 + (3 * i + j) % 40 for j in range(2 + i % 3)]) for i in range(start, start + n)
  ]


ENGINE = settings.Engine(max_num_seqs=8, max_model_len=64, kv_cache_gib=1.0, num_instances=2)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
  cfg = model_config.tiny_qwen2(64)
  path = tiny.build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")), cfg, seed=3)
  info = cluster.init_ray(None, generator_cpus=1, trainer_cpus=1)
  s = service.StreamGenerationService(
      path, ENGINE, dtype="float32", seed=0, cluster=info, stall_timeout_s=300.0
  )
  s.model_cfg = cfg
  yield s
  s.close()
  ray.shutdown()


def count_ids(samples):
  return collections.Counter(s.prompt_id for s in samples)


# -- pure helpers (no Ray) -----------------------------------------------------


def test_cpu_shares_are_disjoint_when_cores_allow():
  shares = cluster.plan_cpu_shares(3, 1, cores=[0, 1, 2, 3])
  assert shares.generator_cores == (0, 1, 2) and shares.trainer_cores == (3,)
  assert [shares.instance_cores(i, 2) for i in range(2)] == [(0, 1), (2,)]
  # More instances than cores: shared round-robin, never empty.
  assert [shares.instance_cores(i, 4) for i in range(4)] == [(0,), (1,), (2,), (0,)]
  overlap = cluster.plan_cpu_shares(2, 2, cores=[0, 1])
  assert overlap.generator_cores == overlap.trainer_cores == (0, 1)
  with pytest.raises(ValueError, match="must be >= 1"):
    cluster.plan_cpu_shares(0, 1, cores=[0, 1])


def test_bound_trainer_threads_pins_every_thread():
  # In a child process: pinning this test process would slow the others.
  code = textwrap.dedent("""
      import os, threading, time
      from streamrl import cluster
      from streamrl.config import settings
      core = min(os.sched_getaffinity(0))
      ev = threading.Event()
      t = threading.Thread(target=ev.wait); t.start()  # exists before the call
      out = cluster.bound_trainer_threads([core])
      masks = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
      ev.set(); t.join()
      assert len(masks) >= 2 and all(m == {core} for m in masks.values()), masks
      assert out["num_threads"] == 1 and os.environ["OMP_NUM_THREADS"] == "1"
      print("ok")
  """)
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_unreachable_address_fails_with_one_sentence():
  with socket.socket() as s:  # A port that was free a moment ago: nothing listens.
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with pytest.raises(ConnectionError, match="Cannot reach the Ray cluster at .*cluster.address"):
    cluster.init_ray(f"127.0.0.1:{port}", timeout_s=3)
  with pytest.raises(ValueError, match="host:port"):
    cluster.init_ray("127.0.0.1:notaport", timeout_s=3)


def test_a_failed_join_leaves_the_auth_mode_as_it_was(monkeypatch):
  # A join turns token auth on when a token exists; a join that fails must
  # not leave it on for a local Ray this process starts later.
  monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
  monkeypatch.setattr(cluster.start, "token_available", lambda: True)
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  with pytest.raises(ConnectionError, match="Cannot reach"):
    cluster.init_ray(f"127.0.0.1:{port}", timeout_s=3)
  assert "RAY_AUTH_MODE" not in os.environ
  monkeypatch.setenv("RAY_AUTH_MODE", "token")  # set by the user: kept
  with pytest.raises(ConnectionError, match="Cannot reach"):
    cluster.init_ray(f"127.0.0.1:{port}", timeout_s=3)
  assert os.environ["RAY_AUTH_MODE"] == "token"


# -- the service ---------------------------------------------------------------


def test_instances_are_placed_on_generator_cores(svc):
  gen_cores = set(cluster.plan_cpu_shares(1, 1).generator_cores)
  for i in (0, 1):
    info = svc.placement[i]
    assert set(info["cores"]) <= gen_cores
    assert info["torch_threads"] == 1 and info["engine_in_process"]


def test_every_request_exactly_once_across_two_instances(svc):
  reqs = requests(12)
  samples = list(svc.generate(reqs, SAMPLING, seed=SEED))
  assert count_ids(samples) == collections.Counter(range(12))
  # Default split: round-robin over the live instances.
  assert all(s.instance_id == s.prompt_id % 2 for s in samples)
  assert all(s.weight_version == 0 and 0 < len(s.token_ids) <= 8 for s in samples)
  assert {iv[0] for iv in svc.busy_intervals} == {0, 1}
  # Same seeds, another split: identical tokens (a sample doesn't depend on
  # its instance or its batch-mates).
  again = list(svc.generate(reqs, SAMPLING, seed=SEED, assignments=[reqs[6:], reqs[:6]]))
  by_id = {s.prompt_id: s.token_ids for s in samples}
  assert all(by_id[s.prompt_id] == s.token_ids for s in again)
  with pytest.raises(ValueError, match="unique"):
    svc.generate(reqs + reqs[:1], SAMPLING, seed=SEED)


@pytest.mark.parametrize("coalesce_s, most_objects", [(0.0, 12), (60.0, 2)])
def test_coalescing_sends_fewer_objects_and_loses_nothing(svc, coalesce_s, most_objects):
  before, svc.coalesce_s = svc.coalesce_s, coalesce_s
  try:
    n0 = svc.num_objects
    samples = list(svc.generate(requests(12, start=100), SAMPLING, seed=SEED))
    objects = svc.num_objects - n0
  finally:
    svc.coalesce_s = before
  assert count_ids(samples) == collections.Counter(range(100, 112))
  # One object per sample without a window; with a window longer than the
  # stream, one per instance.
  assert objects == most_objects


def test_update_reaches_every_instance_and_samples_carry_the_version(svc):
  reqs = requests(8)
  before = {s.prompt_id: s.token_ids for s in svc.generate(reqs, SAMPLING, seed=SEED)}
  new = hf.to_hf_tensors(transformer.Transformer(svc.model_cfg, rngs=nnx.Rngs(99)))
  assert svc.update(new, version=2).wait() == {0: 2, 1: 2}
  assert svc.query_versions() == {0: 2, 1: 2}
  # Not waited for: the instances still load it before the next stream.
  pending = svc.update(new, version=3)
  after = list(svc.generate(reqs, SAMPLING, seed=SEED))
  assert pending.wait() == {0: 3, 1: 3}
  assert count_ids(after) == collections.Counter(range(8))
  assert all(s.weight_version == 3 for s in after)
  # Same sampling seeds, new weights: the tokens change.
  assert any(before[s.prompt_id] != s.token_ids for s in after)


def test_explicit_assignments_and_caps_are_respected(svc):
  reqs = requests(10)
  assignments = [reqs[:7], reqs[7:]]
  samples = list(svc.generate(None, SAMPLING, seed=SEED, assignments=assignments, caps=[1, None]))
  assert count_ids(samples) == collections.Counter(range(10))
  for s in samples:
    assert s.instance_id == (0 if s.prompt_id < 7 else 1)
  # Cap 1: one request at a time, so instance 0 finishes them in the given order.
  assert [s.prompt_id for s in samples if s.instance_id == 0] == list(range(7))
  stats = ray.get([svc.actor(i).last_stream_stats.remote() for i in (0, 1)])
  assert stats[0]["peak_in_flight"] == 1 and stats[1]["peak_in_flight"] == 3
  with pytest.raises(ValueError, match="exactly the given requests"):
    svc.generate(reqs[:3], SAMPLING, seed=SEED, assignments=assignments)
  with pytest.raises(ValueError, match="one .* per instance"):
    svc.generate(None, SAMPLING, seed=SEED, assignments=[reqs])


def test_length_hints_travel_to_the_instance_which_probes_each_group_first(svc):
  from streamrl.scheduling.siblings import LengthHint

  reqs = requests(6)  # groups: 0 1 2 on instance 0 (priors 1, 9, 5), 3 4 5 on instance 1
  hinted = [r + (None, LengthHint(k % 3, [1.0, 9.0, 5.0][k % 3])) for k, r in enumerate(reqs)]
  hinted = [hinted[k] for k in (0, 3, 1, 4, 2, 5)]  # two samples of a group in a row
  samples = list(svc.generate(None, SAMPLING, seed=SEED, assignments=[hinted, []], caps=[1, None]))
  assert count_ids(samples) == collections.Counter(range(6))
  # One at a time: a sample of every group before a second of any, highest prior first.
  assert [s.prompt_id % 3 for s in samples[:3]] == [1, 2, 0]


def test_closing_the_stream_early_cancels_and_the_service_stays_usable(svc):
  # Each instance pauses for 120 s after its first sample, unless cancelled.
  ray.get([svc.actor(i).inject_fault.remote("stall", after_samples=1, seconds=120) for i in (0, 1)])
  stream = svc.generate(requests(16), SAMPLING, seed=SEED)
  first = [next(stream), next(stream)]
  stream.close()
  assert {s.instance_id for s in first} == {0, 1}
  # Answered only once the cancelled streams have ended (not after 120 s).
  stats = ray.get([svc.actor(i).last_stream_stats.remote() for i in (0, 1)], timeout=60)
  assert [st["num_samples"] for st in stats] == [1, 1]
  samples = list(svc.generate(requests(6, start=100), SAMPLING, seed=SEED))
  assert count_ids(samples) == collections.Counter(range(100, 106))


def test_a_bad_request_raises_the_engines_error(svc):
  too_long = [(0, [1] * 60)]  # + max_tokens 8 > max_model_len 64
  with pytest.raises(ValueError, match="max_model_len"):
    list(svc.generate(too_long + requests(3, start=1), SAMPLING, seed=SEED))
  assert svc.dead_instances == []
  assert count_ids(svc.generate(requests(4), SAMPLING, seed=SEED)) == collections.Counter(range(4))


def test_stall_fails_with_timeout_naming_the_instance(svc):
  ray.get(svc.actor(1).inject_fault.remote("stall", after_samples=1, seconds=120))
  reqs = requests(4)
  with pytest.raises(TimeoutError, match=r"instance 1 produced no sample .*stall_timeout_s"):
    for _ in svc.generate(
        None, SAMPLING, seed=SEED, assignments=[[], reqs], caps=[None, 1], stall_timeout_s=2
    ):
      pass
  # The cancelled stall ends, and the instance serves the next call.
  samples = list(svc.generate(reqs, SAMPLING, seed=SEED))
  assert count_ids(samples) == collections.Counter(range(4))
  assert svc.dead_instances == []


def test_killed_instance_work_finishes_on_the_survivor_exactly_once(svc):
  reqs = requests(12)
  # Instance 1 pauses after two samples, so the kill lands mid-stream.
  ray.get(svc.actor(1).inject_fault.remote("stall", after_samples=2, seconds=120))
  samples, killed = [], False
  for s in svc.generate(None, SAMPLING, seed=SEED, assignments=[reqs[:6], reqs[6:]], caps=[2, 1]):
    samples.append(s)
    if not killed and sum(x.instance_id == 1 for x in samples) == 2:
      ray.kill(svc.actor(1))
      killed = True
  assert count_ids(samples) == collections.Counter(range(12))
  assert [d.instance_id for d in svc.dead_instances] == [1]
  assert svc.dead_instances[0].requeued == 4
  assert svc.live_instances == [0] and svc.versions() == {0: 3}
  # The four undelivered requests of instance 1 ran on instance 0.
  assert sum(s.instance_id == 1 for s in samples) == 2
  # Later calls use the survivor only, even when assignments name the dead one.
  later = list(svc.generate(None, SAMPLING, seed=SEED, assignments=[reqs[:2], reqs[2:5]]))
  assert count_ids(later) == collections.Counter(range(5))
  assert {s.instance_id for s in later} == {0}


def test_all_instances_dead_is_a_clear_error(svc):
  ray.get(svc.actor(0).inject_fault.remote("crash", after_samples=1))
  with pytest.raises(RuntimeError, match="All 2 generator instances are dead"):
    list(svc.generate(requests(4), SAMPLING, seed=SEED))
  assert [d.instance_id for d in svc.dead_instances] == [1, 0]
  with pytest.raises(RuntimeError, match="dead"):
    svc.generate(requests(2), SAMPLING, seed=SEED)
