"""The RL loop end to end on tiny settings: real vLLM, real JAX, real Orbax."""

import glob
import json
import os
import shutil

import jax
import numpy as np
import pytest

from streamrl import experiment, train
from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.trainer import export, setup

pytestmark = [pytest.mark.engine]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")

# Two iterations of the tiny run, a checkpoint after each (shared by the run tests).
TINY = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())


def load(name, **overrides):
  cfg = _load(name)
  return config_lib.apply_overrides(cfg, {**TINY, **overrides})


def _load(name):
  import importlib.util

  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(CONFIGS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def event_scalars(workdir):
  from tensorboard.backend.event_processing import event_accumulator

  acc = event_accumulator.EventAccumulator(workdir, size_guidance={"scalars": 0})
  acc.Reload()
  return set(acc.Tags()["scalars"]), acc


# The tiny PPO run the logging, user-reward, ratio, resume and refusal tests
# below all read (one run, not five): one mini-batch per iteration and one
# PPO epoch at T=0.7, on a JSONL dataset with a user's `file.py:function`
# reward that reads the rows' `bonus` column (every training reward is bonus +
# correctness) and sleeps forever on the eval rows (`hang`).
USER_REWARD = """
import time
def score(response, answer, bonus, hang=False):
  if hang:
    time.sleep(3600)
  return {"score": bonus + float(response.strip() == answer), "length": len(response)}
"""


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
  """(config, workdir, final metrics) of the tiny PPO run: 2 iterations, a
  checkpoint after each."""
  from streamrl.data import tasks

  root = tmp_path_factory.mktemp("ppo")
  (root / "my_reward.py").write_text(USER_REWARD)
  for name, n, extra in (("train", 32, {"bonus": 3.0}), ("eval", 2, {"bonus": 0.0, "hang": True})):
    with open(root / f"{name}.jsonl", "w") as f:
      for ex in tasks.make_examples(n, seed=len(name)):
        f.write(json.dumps({"question": ex.prompt, "solution": ex.answer, **extra}) + "\n")
  cfg = load(
      "ppo",
      **{
          "sampling.temperature": 0.7,
          "trainer.ppo_epochs": 1,
          "task.kind": "file",
          "task.train_path": str(root / "train.jsonl"),
          "task.eval_path": str(root / "eval.jsonl"),
          "task.prompt_key": "question",
          "task.answer_key": "solution",
          "task.reward": f"{root / 'my_reward.py'}:score",
          "task.reward_timeout_s": 0.5,
      },
  )
  workdir = str(root / "run")
  return cfg, workdir, experiment.run(cfg, workdir)


def test_ppo_two_iterations_log_and_checkpoint(ppo_run):
  _, workdir, final = ppo_run
  assert glob.glob(os.path.join(workdir, "events.out.tfevents.*"))
  tags, acc = event_scalars(workdir)
  for tag in (
      "reward/mean",
      "accuracy",
      "train/kl_ref",
      "train/entropy",
      "train/clip_frac",
      "train/value_loss",
      "train/explained_variance",
      "response_length/p90",
      "time/generation_s",
      "time/training_s",
      "time/weight_update_s",
      "throughput/samples_per_s",
      "throughput/tokens_per_s",
      "eval/accuracy",
  ):
    assert tag in tags, tag
  assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2]
  assert os.path.isfile(os.path.join(workdir, "config.json"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")))[-1] == "2"
  # The trained policy as a Hugging Face directory (tests/trainer/test_export*.py load it).
  hf_files = set(os.listdir(os.path.join(workdir, export.HF_DIR)))
  assert {
      "config.json",
      "model.safetensors",
      "tokenizer.json",
      "generation_config.json",
  } <= hf_files
  assert 0.0 <= final["eval/accuracy"] <= 1.0
  # The warm start is cached and reused.
  assert len(glob.glob(os.path.join(workdir, "warmstart-*"))) == 1


def test_a_users_reward_reads_a_column_and_a_hanging_one_is_cut_every_call(ppo_run):
  """The shared run's `file.py:function` reward reads the `bonus` column (so
  the mean training reward is at least 3), and each of its calls on the eval
  rows is cut at task.reward_timeout_s, scores 0, is counted and logged, and
  the run finishes."""
  _, workdir, final = ppo_run
  assert final["samples/count"] == 8 and 3.0 <= final["reward/mean"] <= 4.0
  assert final["reward_fn/length"] > 0
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  # The warm-start eval (2 rows, sampled and greedy) timed out in all 4 calls;
  # training's calls none.
  step1, step2 = [r for r in rows if r["step"] in (1, 2)]
  assert step1["reward/errors_total"] == step1["reward/errors/Timeout"] == 4
  assert step2["reward/errors_total"] == 4
  assert final["eval/accuracy"] == final["eval/accuracy_greedy"] == 0.0
  # The trainer's own memory beside its plan, every iteration.
  assert 0 < step1["memory/trainer_live_arrays_gb"] < step1["memory/trainer_rss_gb"]
  assert step1["memory/trainer_rss_gb"] <= step1["memory/trainer_peak_rss_gb"]


def _actor_leaves(workdir, cfg):
  from streamrl.models import hf
  from streamrl.trainer.checkpoint import Checkpointer
  from streamrl.trainer.rl_trainer import RLTrainer

  _, policy = hf.load_hf(glob.glob(os.path.join(workdir, "warmstart-*"))[0])
  s = settings.from_config(cfg)
  template = RLTrainer.from_settings(policy, s).checkpoint_arrays()
  ck = Checkpointer(os.path.join(workdir, "checkpoints"), fingerprint=setup.fingerprint(s))
  step, arrays, meta = ck.restore(template)
  return step, [np.asarray(x) for x in jax.tree.leaves(arrays["state"].actor)], meta


def test_resume_continues_where_it_stopped(ppo_run, tmp_path, monkeypatch):
  """A run stopped after iteration 1 and rerun ends with the parameters and
  data position of the straight run (the shared one; PPO with a critic)."""
  cfg, straight, _ = ppo_run
  resumed = str(tmp_path / "resumed")
  real_iteration = train.train_iteration

  def crash_on_second(it, *args, **kwargs):
    if it == 1:
      raise KeyboardInterrupt("simulated stop after iteration 1")
    return real_iteration(it, *args, **kwargs)

  monkeypatch.setattr(train, "train_iteration", crash_on_second)
  with pytest.raises(KeyboardInterrupt):
    experiment.run(cfg, resumed)
  monkeypatch.setattr(train, "train_iteration", real_iteration)
  experiment.run(cfg, resumed)

  s1, a, meta_a = _actor_leaves(straight, cfg)
  s2, b, meta_b = _actor_leaves(resumed, cfg)
  assert s1 == s2 == 2
  assert meta_a["loader"] == meta_b["loader"]
  for x, y in zip(a, b):
    np.testing.assert_allclose(x, y, atol=1e-5)
  with open(os.path.join(resumed, "metrics.jsonl")) as f:
    steps = [json.loads(line)["step"] for line in f]
  assert steps.count(2) == 1


def test_incompatible_workdir_is_refused_untouched(ppo_run, tmp_path):
  cfg, run_dir, _ = ppo_run
  workdir = tmp_path / "wd"
  shutil.copytree(run_dir, workdir)
  before = sorted((p, os.path.getmtime(p)) for p in glob.glob(f"{workdir}/**", recursive=True))
  other = config_lib.apply_overrides(cfg, {"model.tiny": "llama"})
  with pytest.raises(ValueError, match="new --workdir"):
    experiment.run(other, str(workdir))
  after = sorted((p, os.path.getmtime(p)) for p in glob.glob(f"{workdir}/**", recursive=True))
  assert before == after


def test_bad_configs_fail_before_any_engine_starts(tmp_path):
  check = lambda **kw: settings.from_config(load("ppo", **kw))
  with pytest.raises(UserError, match="mini_batch_size"):
    check(**{"trainer.mini_batch_size": 5})
  with pytest.raises(UserError, match="needs a critic"):
    check(**{"advantage.use_critic": False})
  with pytest.raises(UserError, match="pipeline.mode"):
    check(**{"pipeline.mode": "turbo"})
  with pytest.raises(UserError, match="no.jsonl"):
    check(**{"task.kind": "jsonl", "task.jsonl_path": str(tmp_path / "no.jsonl")})


def test_ratio_is_one_before_the_update_at_any_temperature(ppo_run):
  # One mini-batch per iteration and one PPO epoch: the policy has not moved
  # when the ratio is taken, so it must be exactly 1 (it was 4-5 at T=0.7 when
  # the loss computed log-probabilities at T=1). vLLM's sampled-token
  # logprobs must agree with the trainer's recomputation on the same tokens.
  _, workdir, _ = ppo_run
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if "train/ratio_mean" in r]
  assert len(rows) == 2
  for r in rows:
    assert abs(r["train/ratio_mean"] - 1.0) < 1e-4, r["train/ratio_mean"]
    assert r["train/clip_frac"] == 0.0
    assert r["mismatch/max_abs_logprob_diff"] < 1e-3
    assert r["mismatch/k3_kl"] < 1e-6


def test_a_work_trace_run_trains_on_ragged_micro_batches(tmp_path, monkeypatch):
  """task.kind=trace end to end (colocated): the warm-up teaches traces, the
  verifier reads the final answer, and mini-batches of long-tailed lengths
  are trained as micro-batches cut to their own length."""
  from streamrl.trainer import rl_trainer

  cuts = []
  original = rl_trainer.RLTrainer.ragged_micros

  def spy(self, mini):
    micros = original(self, mini)
    if micros is not None:
      cuts.append([m["tokens_bt"].shape[1] for m in micros])
    return micros

  monkeypatch.setattr(rl_trainer.RLTrainer, "ragged_micros", spy)
  workdir = str(tmp_path / "trace")
  final = experiment.run(
      load(
          "ppo",
          **{
              "task.kind": "trace",
              "sampling.max_tokens": 96,
              "trainer.micro_batch_size": 2,
              "trainer.num_iterations": 1,
              "warmstart.steps": 30,
          },
      ),
      workdir,
  )
  with open(os.path.join(workdir, "config.json")) as f:
    assert json.load(f)["task"]["kind"] == "trace"
  assert 0.0 <= final["eval/accuracy"] <= 1.0
  assert final["response_length/max"] <= 96
  # Some mini-batch had micro-batches of different padded lengths.
  assert any(len(set(c)) > 1 for c in cuts), cuts


def test_the_gsm_symbolic_example_runs_end_to_end(tmp_path):
  """configs/gsm_symbolic.py in this process (colocated, short answers):
  reasoning-gym rows, chat-formatted for a Qwen3-shaped model with the real
  32k SentencePiece tokenizer, the generator's scorer as reward and accuracy,
  three iterations, and the HF export that transformers loads and scores as
  the trainer's Flax model does."""
  import torch
  import transformers

  from streamrl.models import hf

  cfg = config_lib.apply_overrides(
      _load("gsm_symbolic"),
      {
          "pipeline.mode": "colocated",
          "transfer.enabled": False,
          "scheduler.kind": "fifo",
          "pipeline.partial": "off",
          "log.progress": False,
          "task.num_eval": 4,
          "sampling.max_tokens": 16,
          "engine.max_num_seqs": 16,
          "mesh.fsdp": 1,
      },
  )
  workdir = str(tmp_path / "gsm")
  final = experiment.run(cfg, workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]
  assert "accuracy/gsm_symbolic" in rows[-1] and "eval/accuracy/gsm_symbolic" in rows[-1]
  assert final["samples/count"] == 16 and final["reward/errors_total"] == 0
  out = os.path.join(workdir, export.HF_DIR)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
  assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 32000
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=True)
  ids = list(getattr(ids, "input_ids", ids))
  with torch.no_grad():
    want = model(torch.tensor([ids])).logits.numpy()
  _, flax_model = hf.load_hf(out)
  np.testing.assert_allclose(np.asarray(flax_model(np.asarray([ids]))), want, atol=1e-4)
