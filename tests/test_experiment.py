"""The trainer as a Ray actor: a disaggregated run end to end through experiment.run."""

import glob
import json
import os

import pytest
import ray

from streamrl import experiment
from streamrl import config as config_lib
from streamrl.errors import UserError
from tests.test_loopback import ListenerWatch, exposed

pytestmark = [pytest.mark.engine, pytest.mark.ray, pytest.mark.e2e]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")

# Two iterations of the tiny run, a checkpoint after each (shared by the run tests).
TINY = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())


def load(**overrides):
  import importlib.util

  spec = importlib.util.spec_from_file_location("cfg_ppo_actor", os.path.join(CONFIGS, "ppo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return config_lib.apply_overrides(module.get_config(), {**TINY, **overrides})


@pytest.fixture(scope="module", autouse=True)
def fresh_ray():
  if ray.is_initialized():
    ray.shutdown()
  yield
  ray.shutdown()


def test_async_run_trains_on_a_trainer_actor(tmp_path):
  workdir = str(tmp_path / "async")
  # The config's default: async with partial rollouts ("auto"). Whatever the
  # run starts (Ray, the trainer and generator actors, vLLM) listens on loopback only.
  with ListenerWatch() as watch:
    final = experiment.run(load(**{"pipeline.mode": "async"}), workdir)
  assert exposed(watch.seen) == {}, watch.seen
  assert {"gcs_server", "raylet"} <= {name for name, _ in watch.seen.values()}, watch.seen
  with open(os.path.join(workdir, "placement.json")) as f:
    placement = json.load(f)
  # The trainer ran in its own process (an actor), not in this one, and the
  # generator in another; on a machine with 2+ cores their cores don't overlap.
  trainer, gen = placement["trainer"], placement["generators"]["0"]
  assert trainer["pid"] != os.getpid()
  assert gen["pid"] not in (os.getpid(), trainer["pid"])
  if len(os.sched_getaffinity(0)) >= 2:
    assert not set(trainer["cores"]) & set(gen["cores"])
  # It did the whole job: events, checkpoints, final metrics, its own log.
  assert glob.glob(os.path.join(workdir, "events.out.tfevents.*"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "2"
  # A resumed response's tokens are at most max_token_version_gap (2) old.
  assert final["staleness/max"] <= 2 and final["partial/token_version_gap_max"] <= 2
  assert 0.0 <= final["eval/accuracy"] <= 1.0
  with open(os.path.join(workdir, "trainer.log")) as f:
    assert "Warm-start eval" in f.read()
  # A workdir written by another config is refused here, before any actor starts.
  before = sorted((p, os.path.getmtime(p)) for p in glob.glob(f"{workdir}/**", recursive=True))
  with pytest.raises(ValueError, match="new --workdir"):
    experiment.run(load(**{"pipeline.mode": "async", "model.tiny": "llama"}), workdir)
  after = sorted((p, os.path.getmtime(p)) for p in glob.glob(f"{workdir}/**", recursive=True))
  assert before == after


def test_an_error_in_the_actor_keeps_its_type_and_message(tmp_path):
  # The data file is read inside the actor (the settings only check that it
  # exists); an empty one is refused there and comes back as itself.
  data = tmp_path / "empty.jsonl"
  data.write_text("")
  cfg = load(**{"pipeline.mode": "sync", "task.kind": "jsonl", "task.jsonl_path": str(data)})
  with pytest.raises(UserError, match="empty.jsonl") as info:
    experiment.run(cfg, str(tmp_path / "bad"))
  assert isinstance(info.value, ray.exceptions.RayTaskError)  # it did come from the actor


def test_elastic_generation_scales_up_and_back_by_the_policy(tmp_path):
  """A generation-bound run (one request at a time per engine, so generation
  time grows with the tokens of the batch): after the warm-up iterations (the
  trainer compiles) the policy adds an instance; on the one generator core
  the two instances share it cannot pay (it saves less than half the
  expected time), so the policy releases it. Every sample arrives once,
  with the weights of its iteration (sync)."""
  workdir = str(tmp_path / "elastic")
  final = experiment.run(
      load(
          **{
              "pipeline.mode": "sync",
              "trainer.num_iterations": 6,
              # Actor only (no critic, no reference): training stays cheap.
              "advantage.estimator": "grpo",
              "advantage.group_size": 4,
              "advantage.use_critic": False,
              "kl.use_reference": False,
              "kl.coef": 0.0,
              "trainer.prompts_per_iteration": 12,
              "trainer.mini_batch_size": 48,
              "trainer.micro_batch_size": 48,
              "trainer.ppo_epochs": 1,
              "engine.max_num_seqs": 1,
              # The trainer may use both cores (sync: the sides take turns),
              # the generators have one.
              "cluster.trainer_cpus": 2,
              "transfer.enabled": True,
              "elastic.enabled": True,
              "elastic.max_instances": 2,
              "elastic.warmup_iterations": 2,
              "elastic.observe_iterations": 1,
          }
      ),
      workdir,
  )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [r for r in map(json.loads, f) if "samples/count" in r]
  timing = [(r["time/generation_s"], r["time/training_s"]) for r in rows]
  with open(os.path.join(workdir, "elastic.jsonl")) as f:
    events = [json.loads(line) for line in f]
  # One trial: added after a look past the warm-up, judged one iteration later, released.
  assert [e["action"] for e in events] == ["added", "removed"], timing
  added = events[0]["iteration"]
  assert added in (2, 3) and events[1]["iteration"] == added + 1, timing
  assert "generation-bound" in events[0]["reason"] and "released" in events[1]["reason"]
  # The instances that served each iteration.
  served = [r["generators/instances"] for r in rows]
  assert served == [1] * (added + 1) + [2] + [1] * (len(rows) - added - 2)
  for r in rows:
    assert r["samples/count"] == 48
    assert r["samples/duplicated"] == 0 and r["staleness/max"] == 0
  assert final["elastic/added_total"] == 1 and final["elastic/removed_total"] == 1


def test_a_later_run_in_the_process_gets_a_local_ray_sized_for_it():
  """A local Ray an earlier run started is restarted when the next run needs
  more CPUs (its trainer would hold them and the generators wait forever);
  a Ray the user started themselves is never replaced: too small is an error."""
  from streamrl import cluster

  ray.shutdown()
  assert cluster.init_ray(generator_cpus=1, trainer_cpus=1).resources["CPU"] == 2
  assert cluster.init_ray(generator_cpus=1, trainer_cpus=2).resources["CPU"] == 3
  assert cluster.init_ray(generator_cpus=1, trainer_cpus=1).resources["CPU"] == 3  # Fits: reused.
  ray.shutdown()
  ray.init(address="local", num_cpus=1, include_dashboard=False)
  with pytest.raises(UserError, match="ray.shutdown"):
    cluster.init_ray(generator_cpus=1, trainer_cpus=2)
  assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 1
  ray.shutdown()


def _saved_meta(workdir, step):
  with open(os.path.join(workdir, "checkpoints", str(step), "meta", "metadata")) as f:
    return json.load(f)


def test_partial_rollouts_carry_unfinished_responses_across_a_resume(tmp_path, monkeypatch):
  """Async with partial rollouts on the real engine, stopped after two
  iterations and resumed: the resumed run starts from the unfinished
  responses the checkpoint saved, and every iteration is logged once."""
  from streamrl import train
  from streamrl.pipeline import partial

  cfg = load(
      **{
          "pipeline.mode": "async",
          "pipeline.partial": "on",
          "pipeline.partial_oversample": 0.5,
          "trainer.num_iterations": 3,
          "cluster.trainer_actor": False,  # in this process, so the stop can be scripted
      }
  )
  workdir = str(tmp_path / "partial")
  real_iteration = train.train_iteration

  def stop_before_third(it, *args, **kwargs):
    if it == 2:
      raise KeyboardInterrupt("simulated stop after iteration 2")
    return real_iteration(it, *args, **kwargs)

  monkeypatch.setattr(train, "train_iteration", stop_before_third)
  with pytest.raises(KeyboardInterrupt):
    experiment.run(cfg, workdir)
  saved = _saved_meta(workdir, 2)["partial"]
  # 8 prompts per iteration, 4 more in flight: they wait in the checkpoint.
  assert len(saved["groups"]) == 4
  restored = []
  real_restore = partial.PartialAsyncMode.restore
  monkeypatch.setattr(train, "train_iteration", real_iteration)
  monkeypatch.setattr(
      partial.PartialAsyncMode,
      "restore",
      lambda self, carry, loader: restored.append(carry) or real_restore(self, carry, loader),
  )
  final = experiment.run(cfg, workdir)
  assert restored == [saved]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
  assert all(
      r["samples/count"] == 8 and r["samples/duplicated"] == 0 for r in rows if "samples/count" in r
  )
  assert final["partial/token_version_gap_max"] <= 2
  assert 0.0 <= final["partial/resumed_fraction"] <= 1.0
  assert len(_saved_meta(workdir, 3)["partial"]["groups"]) == 4
