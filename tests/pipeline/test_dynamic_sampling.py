"""Dynamic sampling (`advantage.filter_groups`) in every pipeline mode, on the
real trainer and loop (`train.train_iteration`) with the GRPO config, a
scripted rollout (as tests/pipeline/test_modes.py) and the skew scheduler
that config uses; plus the reward shaping of `loss.overlong_*` and
`loss.mask_truncated`."""

import importlib.util
import os

import numpy as np
import pytest
from flax import nnx

from streamrl import pipeline, train
from streamrl import config as config_lib
from streamrl.config import settings
from streamrl.data import tasks
from streamrl.data.loader import PromptLoader
from streamrl.data.rewards import Rewarder
from streamrl.data.tokenizer import Tokenizer
from streamrl.errors import UserError
from streamrl.generator.fake import FakeRollout
from streamrl.generator.rollout import Sample
from streamrl.models import config as model_config
from streamrl.models import tiny
from streamrl.models.transformer import Transformer
from streamrl.pipeline.stream import LengthBatcher
from streamrl.pipeline.timeline import Timeline
from streamrl.trainer import shaping
from streamrl.trainer.rl_trainer import RLTrainer

pytestmark = [pytest.mark.unit]

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
GROUP = 2


def grpo_config(**overrides):
  spec = importlib.util.spec_from_file_location("cfg_grpo", os.path.join(CONFIGS, "grpo.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  base = {
      # The shapes of tests/pipeline/test_modes.py, whose compiles the suite shares.
      "advantage.group_size": GROUP,
      "trainer.prompts_per_iteration": 8,
      "trainer.mini_batch_size": 4,
      "trainer.micro_batch_size": 2,
      "trainer.num_iterations": 2,
      "mesh.fsdp": 1,
      "pipeline.partial": "off",
      "advantage.filter_groups": True,
      "advantage.filter_max_rounds": 3,
  }
  return config_lib.apply_overrides(module.get_config(), {**base, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  return tiny.build_tiny_model_dir(str(tmp_path_factory.mktemp("tiny")), seed=3)


def run_filtered(config, model_dir, iterations):
  """`iterations` of the real loop with dynamic sampling wired as `train.run` wires it."""
  s = settings.from_config(config)
  trainer = RLTrainer.from_settings(Transformer(model_config.tiny_qwen2(64), rngs=nnx.Rngs(1)), s)
  rollout = FakeRollout()
  tok = Tokenizer(model_dir)
  loader = PromptLoader(tasks.make_examples(64, 0), s.trainer.prompts_per_iteration, seed=0)
  rewarder = Rewarder("partial_match", tok, workers=0)
  mode = pipeline.make_mode(
      s,
      rollout,
      model_dir=model_dir,
      workdir=None,
      rounds=pipeline.make_rounds(loader, tok, GROUP),
      on_sample=rewarder.submit,
      group_rewards=shaping.GroupRewards(rewarder, s.loss, s.sampling.max_tokens),
  )
  timeline, outs = Timeline(), []
  for it in range(iterations):
    x = train.train_iteration(
        it,
        mode,
        trainer,
        rewarder,
        timeline,
        ppo_epochs=1,
        seed=s.seed,
        loss=s.loss,
        max_tokens=s.sampling.max_tokens,
    )
    outs.append((x, train.iteration_scalars(x, timeline, rollout)))
  mode.close()
  return trainer, rollout, outs


@pytest.mark.parametrize("mode", ["sync", "stream", "async", "async_partial"])
def test_no_trained_group_has_equal_rewards(model_dir, mode):
  overrides = {"pipeline.mode": mode.split("_")[0]}
  if mode == "async_partial":
    overrides.update({"pipeline.partial": "on", "pipeline.partial_oversample": 0.5})
  trainer, rollout, outs = run_filtered(grpo_config(**overrides), model_dir, 2)
  dropped = extra = steps = 0
  for x, scal in outs:
    ids = [q.prompt_id for q in x.samples]
    assert len(set(ids)) == len(ids) and len(ids) % 4 == 0
    groups = {}
    for q, r in zip(x.samples, x.rewards):
      groups.setdefault(q.prompt_id // GROUP, []).append(r)
    assert all(len(g) == GROUP for g in groups.values())
    # The trainer's own rewards of every trained group differ: no zero-advantage group.
    assert all(max(g) > min(g) for g in groups.values()), mode
    assert 0 < scal["filter/batch_fill"] <= 1
    assert scal["filter/batch_fill"] == len(groups) / 8
    dropped += scal["filter/dropped_groups"]
    extra += scal["filter/extra_prompts"]
    steps += len(ids) // 4
  # The scripted answers give most groups equal rewards: dropped, and replaced.
  assert dropped > 0 and extra > 0
  assert int(trainer.state.step) == steps
  if mode != "async_partial":
    # Extra rounds went through the skew scheduler too, one plan per round.
    assert len(rollout.assignments) == sum(1 + s["filter/extra_rounds"] for _, s in outs)


def test_filter_groups_needs_groups():
  cfg = grpo_config(**{"advantage.estimator": "reinforce_pp", "advantage.group_size": 1})
  with pytest.raises(UserError, match="advantage.filter_groups"):
    settings.from_config(cfg)


def _sample(i, n, reason="stop"):
  return Sample(i, (1, 5), tuple(range(4, 4 + n)), (-1.0,) * n, reason, 0, 0)


def test_rewards_are_shaped_near_the_length_limit(model_dir):
  tok = Tokenizer(model_dir)
  rewarder = Rewarder("partial_match", tok, workers=0)
  ex = tasks.make_examples(1, 0)[0]
  samples = [_sample(0, 4), _sample(1, 10), _sample(2, 16, "length")]
  by_id = dict.fromkeys(range(3), ex)
  loss = settings.Loss(overlong_buffer=8, overlong_penalty=0.5, mask_truncated=True)
  plain, _ = rewarder(samples, by_id)
  shaped, _ = shaping.shaped_rewards(rewarder, samples, by_id, loss, 16)
  # Lengths 4, 10, 16 against max_tokens 16 and a buffer of 8: 0, -(10-8)/8, -1 times 0.5.
  np.testing.assert_allclose(shaped - plain, [0.0, -0.125, -0.5], atol=1e-6)


def test_held_verdicts_are_scored_once_and_released(model_dir):
  calls = []
  rewarder = Rewarder("partial_match", Tokenizer(model_dir), workers=0)
  start = rewarder._start
  rewarder._start = lambda s, ex: calls.append(s.prompt_id) or start(s, ex)
  ex = tasks.make_examples(1, 0)[0]
  group = [_sample(0, 3), _sample(1, 5)]
  judged, _ = rewarder(group, {0: ex, 1: ex}, keep=True)
  # The trainer sees the group renumbered (partial rollouts): the held verdicts still match.
  renumbered = [_sample(6, 3), _sample(7, 5)]
  trained, _ = rewarder(renumbered, {6: ex, 7: ex})
  np.testing.assert_array_equal(judged, trained)
  assert calls == [0, 1]
  rewarder(group, {0: ex, 1: ex}, keep=True)
  rewarder.release(group, {0: ex, 1: ex})
  assert not rewarder._held


def test_a_short_stream_batch_is_cut_to_whole_mini_batches():
  batcher = LengthBatcher(4, GROUP)
  released = [batcher.add([_sample(2 * j, 3), _sample(2 * j + 1, 3)]) for j in range(3)]
  assert [len(m) for r in released for m in r] == [4]  # the first two groups, at once
  assert batcher.flush(drop_rest=True) == []  # the third group alone: left out
  batcher.add([_sample(6, 3), _sample(7, 3)])
  with pytest.raises(RuntimeError, match="outside a full mini-batch"):
    batcher.flush()
