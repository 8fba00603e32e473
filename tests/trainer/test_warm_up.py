"""RLTrainer.warm_up: after it, scoring and updating batches of every padded
length compile nothing, and the state trains exactly as without it."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from streamrl.config import settings
from streamrl.generator.rollout import Sample
from streamrl.models import config as model_config
from streamrl.models import transformer
from streamrl.trainer import compiles, experience, rl_trainer, sharding

pytestmark = [pytest.mark.unit]

PROMPT, MAX_TOKENS = 5, 40  # samples of up to 45 tokens: padded lengths 16, 24, 32, 48


def make_trainer() -> rl_trainer.RLTrainer:
  s = settings.Settings()
  s = s.replace(
      trainer=dataclasses.replace(
          s.trainer, mini_batch_size=4, micro_batch_size=2, prompts_per_iteration=2
      ),
      advantage=dataclasses.replace(s.advantage, estimator="grpo", group_size=4, use_critic=False),
      kl=dataclasses.replace(s.kl, use_reference=True),
  )
  cfg = dataclasses.replace(model_config.tiny_qwen2(64), num_layers=1)  # cheaper to compile
  policy = transformer.Transformer(cfg, rngs=nnx.Rngs(1))
  # One device: on a mesh of several, the first ragged step after an update
  # still reshards the zero accumulator `step.zero_accumulator` returns
  # uncommitted, a small program of its own.
  mesh = sharding.make_mesh({"fsdp": 1}, jax.devices()[:1])
  return rl_trainer.RLTrainer.from_settings(policy, s, mesh=mesh)


def batch(lengths, seed):
  """Samples with responses of the given lengths (a PROMPT-token prompt each)."""
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(lengths):
    prompt = tuple(int(x) for x in rng.integers(3, 64, PROMPT))
    resp = tuple(int(x) for x in rng.integers(3, 64, n))
    out.append(Sample(i, prompt, resp, tuple(-rng.uniform(2, 5, n)), "stop", 0, 0))
  return out, rng.uniform(0, 1, len(lengths)).astype(np.float32)


# Batches of 8 samples whose mini-batches and micro-batches fall in every
# bucket: all short, all long, long-tailed (ragged micro-batches) and mixed.
BATCHES = [
    [3] * 8,
    [MAX_TOKENS] * 8,
    [2, 3, 4, 40, 3, 5, 20, 30],
    [1, 40, 1, 40, 12, 12, 12, 12],
]


def train(trainer):
  out = []
  for k, lengths in enumerate(BATCHES):
    samples, rewards = batch(lengths, seed=k)
    minis, _ = trainer.prepare(samples, rewards, trainer.snapshot())
    for mini in minis:
      out.append(trainer.update(mini))
  return jax.device_get(out)


def test_after_warm_up_no_batch_compiles_and_the_state_is_unchanged():
  compiles.install()
  trainer = make_trainer()
  before = jax.tree.map(np.asarray, trainer.state)
  trainer.start_warm_up(PROMPT + MAX_TOKENS, chunk_sizes=(8,), snapshot_copies=(True, False))
  trainer.wait_warm_up()
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainer.state))
  programs = compiles.totals()["compile/programs"]
  got = train(trainer)
  for lengths in BATCHES[:2]:  # the whole batch scored by the live parameters too
    trainer.prepare(*batch(lengths, seed=9), trainer.snapshot(copy=False))
  assert compiles.totals()["compile/programs"] == programs
  assert [m["ragged_micro_batches"] for m in got].count(2) >= 1  # the ragged step ran
  # Bit for bit the state and metrics of a trainer that did not warm up
  # (equal settings share the compiled programs: this one compiles nothing).
  plain = make_trainer()
  want = train(plain)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(plain.state), trainer.state)
  jax.tree.map(np.testing.assert_array_equal, want, got)


def test_the_buckets_cover_every_sample_length():
  assert experience.bucket_length(PROMPT + MAX_TOKENS, rl_trainer.SCORE_SMALLEST_BUCKET) == 48
