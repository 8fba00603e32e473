"""Semantics of the pipeline modes, on the real trainer and the real loop
(`train.train_iteration`), with a scripted rollout.

The rollout here stands in for the vLLM engines (tested on their own in
tests/generator): it answers each request
with a fixed token sequence, yields them in a shuffled "finish" order, and
stamps each sample with the weight version it holds, so the tests can count
samples and check versions exactly.
"""

import importlib.util
import os

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl import pipeline, train
from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.errors import UserError
from streamrl.data import tasks
from streamrl.data.loader import PromptLoader
from streamrl.data.rewards import Rewarder
from streamrl.data.tokenizer import Tokenizer
from streamrl.generator.fake import FakeRollout
from streamrl.generator.rollout import PARTIAL
from streamrl.models import config as model_config
from streamrl.models import tiny
from streamrl.models.transformer import Transformer
from streamrl.pipeline.timeline import Timeline
from streamrl.trainer.rl_trainer import RLTrainer

pytestmark = [pytest.mark.unit]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def load(name, **overrides):
  spec = importlib.util.spec_from_file_location(f"cfg_{name}", os.path.join(CONFIGS, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = {
      "trainer.prompts_per_iteration": 8,
      "trainer.mini_batch_size": 8,
      "trainer.micro_batch_size": 4,
      "trainer.num_iterations": 3,
      # One of the 8 faked devices: sharding is tested in tests/trainer.
      "mesh.fsdp": 1,
      # The plain modes; the partial-rollout tests below turn it on.
      "pipeline.partial": "off",
  }
  return config_lib.apply_overrides(module.get_config(), {**base, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return tiny.build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")), seed=3)


def run_mode(config, model_dir, iterations, workdir=None, start=0):
  """`iterations` of the real loop; returns (trainer, rollout, per-iteration outputs)."""
  s = settings.from_config(config)
  policy = Transformer(model_config.tiny_qwen2(64), rngs=nnx.Rngs(1))
  trainer = RLTrainer.from_settings(policy, s)
  rollout = FakeRollout()
  examples = tasks.make_examples(64, 0)
  loader = PromptLoader(examples, s.trainer.prompts_per_iteration, seed=0)
  tok = Tokenizer(model_dir)
  rewarder = Rewarder("partial_match", tok, workers=0)
  mode = pipeline.make_mode(
      s,
      rollout,
      model_dir=model_dir,
      workdir=workdir,
      rounds=pipeline.make_rounds(loader, tok, s.advantage.group_size),
  )
  timeline = Timeline()
  if start:  # as train.run does on resume: the generators get the restored weights
    mode.push(trainer.export_weights(), start)
  outs = []
  for it in range(start, start + iterations):
    x = train.train_iteration(
        it, mode, trainer, rewarder, timeline, ppo_epochs=s.trainer.ppo_epochs, seed=s.seed
    )
    outs.append(
        {
            "samples": x.samples,
            "scalars": train.iteration_scalars(x, timeline, rollout),
            "staleness": [it - q.weight_version for q in x.samples],
        }
    )
  mode.close()
  run_mode.last_mode = mode
  return trainer, rollout, outs


def params_of(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.state.actor)]


def test_stream_with_one_step_per_iteration_equals_sync(model_dir):
  # One optimizer step per iteration: the mini-batch is the whole batch.
  overrides = {"trainer.mini_batch_size": 8, "advantage.group_size": 1}
  t_sync, _, _ = run_mode(load("ppo", **{"pipeline.mode": "sync", **overrides}), model_dir, 2)
  t_stream, _, _ = run_mode(load("ppo", **{"pipeline.mode": "stream", **overrides}), model_dir, 2)
  for a, b in zip(params_of(t_sync), params_of(t_stream)):
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("mode", ["sync", "stream", "async"])
def test_every_sample_trained_on_exactly_once(model_dir, mode):
  cfg = load(
      "grpo",
      **{
          "pipeline.mode": mode,
          "advantage.group_size": 2,
          "trainer.prompts_per_iteration": 8,
          "trainer.mini_batch_size": 4,
          "trainer.micro_batch_size": 2,
      },
  )
  trainer, rollout, outs = run_mode(cfg, model_dir, 3)
  for it, out in enumerate(outs):
    ids = [s.prompt_id for s in out["samples"]]
    assert sorted(ids) == list(range(16)), (mode, it)
  # Three iterations were generated: every request once, nothing extra.
  assert len(rollout.produced) == 3 * 16
  # 16 samples in mini-batches of 4, for every PPO epoch of each iteration.
  assert int(trainer.state.step) == 3 * (16 // 4) * cfg.trainer.ppo_epochs


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_async_respects_the_staleness_bound(model_dir, max_staleness):
  cfg = load("ppo", **{"pipeline.mode": "async", "pipeline.max_staleness": max_staleness})
  _, rollout, outs = run_mode(cfg, model_dir, 3)
  stale = [s for out in outs for s in out["staleness"]]
  assert max(stale) <= max_staleness
  assert rollout.updates == [1, 2, 3]
  # Iteration 0 is generated by the initial weights, later ones may lag.
  assert all(s == 0 for s in outs[0]["staleness"])


def test_bubbles_are_reported(model_dir):
  _, _, outs = run_mode(load("ppo", **{"pipeline.mode": "stream"}), model_dir, 1)
  scal = outs[0]["scalars"]
  assert 0.0 <= scal["bubble/trainer"] <= 1.0
  assert scal["staleness/max"] == 0


def test_skew_scheduler_dispatches_learns_and_saves_pairs(model_dir, tmp_path):
  cfg = load("ppo", **{"pipeline.mode": "sync", "scheduler.kind": "skew"})
  _, rollout, outs = run_mode(cfg, model_dir, 2, workdir=str(tmp_path))
  # Every round went out as per-instance assignments covering each request once.
  assert len(rollout.assignments) == 2
  for plan in rollout.assignments:
    ids = sorted(r.id for part in plan for r in part)
    assert ids == list(range(8)) and len(plan) == 2
  # The (prompt, length) pairs of both rounds were saved for the ranker.
  from streamrl.ranker.data import load_pairs

  assert len(load_pairs(str(tmp_path / "length_pairs.jsonl"))) == 16
  assert run_mode.last_mode.scheduler.ranker.step > 0


def test_oracle_scheduler_puts_the_longest_prompt_first(model_dir):
  cfg = load("ppo", **{"pipeline.mode": "sync", "scheduler.kind": "oracle"})
  _, rollout, _ = run_mode(cfg, model_dir, 1)
  by_len = {}
  for e in tasks.make_examples(64, 0):
    by_len[e.prompt] = tasks.oracle_answer_length(e.prompt)
  from streamrl.data import tokenizer as char_tok

  for part in rollout.assignments[0]:
    lengths = [by_len[char_tok.decode(r.prompt[1:])] for r in part]
    assert lengths == sorted(lengths, reverse=True)


def test_async_resumes_after_the_restored_weights_are_pushed(model_dir):
  cfg = load("ppo", **{"pipeline.mode": "async", "trainer.num_iterations": 6})
  _, rollout, outs = run_mode(cfg, model_dir, 2, start=4)
  assert rollout.updates == [4, 5, 6]
  assert all(s.weight_version == 4 for s in outs[0]["samples"])


def _stitched_from_segments(sample, produced) -> bool:
  """Whether `sample` (a trained partial-rollout sample) is its prompt's
  segments as the rollout produced them: each resumed request sent the
  prompt plus the tokens before it, each token has its segment's version."""
  prompt, tokens, versions = sample.prompt_token_ids, sample.token_ids, sample.token_versions
  reach = {0}
  while reach:
    k = reach.pop()
    for _, sent, seg, reason, version in produced:
      n = len(seg)
      if sent != prompt + tokens[:k] or tokens[k : k + n] != seg:
        continue
      if any(v != version for v in versions[k : k + n]):
        continue
      if reason != PARTIAL and k + n == len(tokens):
        return True
      if reason == PARTIAL and n:
        reach.add(k + n)
  return False


def test_partial_rollouts_train_every_response_once_and_whole(model_dir):
  cfg = load(
      "grpo",
      **{
          "pipeline.mode": "async",
          "pipeline.partial": "on",
          "pipeline.partial_oversample": 0.5,
          "advantage.group_size": 2,
          "trainer.prompts_per_iteration": 8,
          "trainer.mini_batch_size": 4,
          "trainer.micro_batch_size": 2,
          "trainer.num_iterations": 5,
      },
  )
  _, rollout, outs = run_mode(cfg, model_dir, 5)
  mode = run_mode.last_mode
  trained_prompts = []
  resumed = 0.0
  for it, out in enumerate(outs):
    samples = out["samples"]
    # Whole groups of the configured size, numbered as a plain round.
    assert sorted(s.prompt_id for s in samples) == list(range(16)), it
    for s in samples:
      assert s.finish_reason != PARTIAL
      assert len(s.token_versions) == len(s.token_ids) == len(s.logprobs)
      assert max(it - v for v in s.token_versions) <= 2
      assert _stitched_from_segments(s, rollout.produced), (it, s.prompt_id)
    trained_prompts.extend(samples[j].prompt_token_ids for j in range(0, 16, 2))
    scal = out["scalars"]
    resumed += scal["partial/resumed_fraction"]
    assert scal["partial/token_version_gap_max"] <= 2
    # The trainer/generator mismatch, per version gap of the tokens.
    gaps = {int(k.split("/")[1][3:]) for k in scal if k.startswith("mismatch/gap")}
    assert gaps and max(gaps) <= 2 and all(f"mismatch/gap{g}/k3_kl" in scal for g in gaps)
  assert resumed > 0  # some responses spanned two rounds
  # No prompt group trained twice; the 4 extra groups are still in flight, untrained.
  assert len(set(trained_prompts)) == len(trained_prompts) == 5 * 8
  carried = [g.prompt_ids for g in mode.buffer.groups]
  assert len(carried) == 4 and not set(carried) & set(trained_prompts)


def test_partial_rollouts_are_async_only():
  cfg = load("ppo", **{"pipeline.mode": "stream", "pipeline.partial": "on"})
  with pytest.raises(UserError, match="pipeline.mode=async"):
    settings.from_config(cfg)
