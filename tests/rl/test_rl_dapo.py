"""DAPO's group filter and overlong penalty against plain numpy / Python references."""

import numpy as np
import pytest

from streamrl import rl
from streamrl.errors import UserError
from streamrl.rl.config import Advantage, Loss

pytestmark = [pytest.mark.unit]


def keep_reference(rewards, group_ids):
  groups = sorted(set(group_ids))
  keep = [len({r for r, g in zip(rewards, group_ids) if g == k}) > 1 for k in groups]
  return np.array(groups), np.array(keep)


@pytest.mark.parametrize("seed", range(5))
def test_group_keep_mask_matches_the_reference(seed):
  rng = np.random.default_rng(seed)
  group_ids = rng.permutation(np.repeat(rng.choice(1000, 12, replace=False), 4))
  # Rewards from a small set, so some groups are all equal.
  rewards = rng.choice([0.0, 0.5, 1.0], size=group_ids.size, p=[0.6, 0.1, 0.3])
  groups, keep = rl.group_keep_mask(rewards, group_ids)
  want_groups, want_keep = keep_reference(rewards.tolist(), group_ids.tolist())
  np.testing.assert_array_equal(groups, want_groups)
  np.testing.assert_array_equal(keep, want_keep)


def test_a_kept_group_never_has_all_zero_grpo_advantages():
  rewards = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.2, 0.2, 0.2, 0.2], np.float32)
  _, keep = rl.group_keep_mask(rewards, np.arange(12) // 4)
  adv_gk = np.asarray(rl.grpo_advantages(rewards, 4)).reshape(3, 4)
  np.testing.assert_array_equal(keep, [False, True, False])
  np.testing.assert_array_equal(np.any(adv_gk != 0, axis=1), keep)


def test_group_keep_mask_refuses_mismatched_inputs():
  with pytest.raises(ValueError, match="one group id per reward"):
    rl.group_keep_mask([1.0, 0.0], [0])


@pytest.mark.parametrize(
    "kept,target,unit,want",
    [
        (10, 8, 2, (8, 0)),
        (8, 8, 2, (8, 0)),
        (7, 8, 2, (6, 0)),
        (5, 8, 4, (4, 0)),
        (1, 8, 2, (1, 1)),
    ],
)
def test_groups_to_train_fills_whole_mini_batches(kept, target, unit, want):
  assert rl.groups_to_train(kept, target, unit) == want
  take, pad = want
  assert (take + pad) % unit == 0 or take == target


def overlong_reference(length, max_tokens, buffer, penalty):
  expected = max_tokens - buffer
  if length <= expected:
    return 0.0
  if length >= max_tokens:
    return -penalty
  return -(length - expected) / buffer * penalty


@pytest.mark.parametrize("max_tokens,buffer,penalty", [(56, 16, 1.0), (320, 64, 0.5), (8, 8, 2.0)])
def test_overlong_penalty_matches_the_numpy_reference(max_tokens, buffer, penalty):
  lengths = np.arange(0, max_tokens + 5)
  got = np.asarray(rl.overlong_penalty(lengths, max_tokens, buffer, penalty))
  want = np.array([overlong_reference(n, max_tokens, buffer, penalty) for n in lengths])
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert got.dtype == np.float32


def test_overlong_penalty_off_without_a_buffer():
  np.testing.assert_array_equal(np.asarray(rl.overlong_penalty([5, 60], 56, 0, 1.0)), [0.0, 0.0])


@pytest.mark.parametrize(
    "part,match",
    [
        (Advantage(group_size=1, filter_groups=True), "filter_groups=True.*group_size >= 2"),
        (Advantage(filter_max_rounds=-1), "filter_max_rounds"),
        (Loss(overlong_buffer=-1), "loss.overlong_buffer"),
        (Loss(overlong_penalty=-0.5), "loss.overlong_penalty"),
    ],
)
def test_bad_dapo_settings_fail_with_one_sentence(part, match):
  with pytest.raises(UserError, match=match) as info:
    part.check()
  assert "\n" not in str(info.value)
