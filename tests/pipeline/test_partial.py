"""`PartialBuffer`: the bookkeeping of partial rollouts, without engines.

A scripted generator stands in for the engines: response r of a prompt has
a fixed length and fixed tokens (so a stitched response can be checked
token by token), and each round every request decodes at most `per_round`
more tokens; what is not done comes back PARTIAL, as after a stop. The last
test hands it a multi-turn trajectory's segments.
"""

import dataclasses
import json

import numpy as np
import pytest

from streamrl.data.tasks import Example
from streamrl.envs.runner import Resume
from streamrl.errors import UserError
from streamrl.generator.rollout import PARTIAL, Sample, TurnStats
from streamrl.scheduling.request import Request
from streamrl.pipeline.partial import PartialBuffer

pytestmark = [pytest.mark.unit]

GROUP = 2


def examples(start, n):
  return [Example(i, f"p{i}", "a", "cpy") for i in range(start, start + n)]


class Loader:
  """Batches of 4 (Example, prompt ids) pairs, counted."""

  def __init__(self):
    self.next = 0

  def __call__(self):
    batch = [(ex, (1, 100 + ex.prompt_id)) for ex in examples(self.next, 4)]
    self.next += 4
    return batch


def full_response(prompt_ids, member):
  """The tokens response `member` of a prompt has once finished."""
  seed = prompt_ids[-1] * 10 + member
  n = 1 + (seed * 7919) % 11
  return tuple(4 + (seed + j) % 30 for j in range(n))


def run_round(buf, it, loader, version, per_round):
  """One round: each request decodes <= per_round more tokens under `version`."""
  plan = buf.start_round(it, loader)
  member_of = {}
  for j, g in enumerate(buf.groups):
    for k in range(GROUP):
      member_of[j * GROUP + k] = (g.prompt_ids, k)
  for r in plan.requests:
    rid = r.id
    sent = plan.resume.get(rid, r).prompt
    prompt, k = member_of[rid]
    assert sent[: len(prompt)] == prompt
    have = len(sent) - len(prompt)
    full = full_response(prompt, k)
    assert sent[len(prompt) :] == full[:have]  # resumed with exactly its tokens so far
    seg = full[have : have + per_round]
    done = have + len(seg) == len(full)
    buf.add(
        Sample(
            rid,
            sent,
            seg,
            tuple([-0.5] * len(seg)),
            "stop" if done else PARTIAL,
            weight_version=version,
            instance_id=0,
        )
    )
  return plan


def new_buffer(max_gap=3):
  return PartialBuffer(
      target_groups=3, extra_groups=2, group_size=GROUP, max_tokens=16, max_version_gap=max_gap
  )


def test_every_response_is_trained_once_whole_with_its_versions():
  buf, loader, trained = new_buffer(), Loader(), []
  for it in range(8):
    run_round(buf, it, loader, version=it, per_round=4)
    if buf.num_done < buf.target:
      continue  # as a run would: the round goes on until enough groups finished
    samples, by_id, metrics = buf.finish_round(it)
    assert sorted(by_id) == [s.prompt_id for s in samples] == list(range(6))
    for s in samples:
      k = s.prompt_id % GROUP
      assert s.token_ids == full_response(s.prompt_token_ids, k)
      # 4 tokens per round: token j was sampled in the (j // 4)-th round of its response.
      versions = np.array(s.token_versions)
      assert np.all(np.diff(versions) >= 0) and len(versions) == len(s.token_ids)
      assert all(it - v <= 3 for v in versions)
    trained.extend(by_id[j].prompt_id for j in range(0, 6, GROUP))
    assert 0.0 <= metrics["partial/resumed_fraction"] <= 1.0
  assert len(trained) == len(set(trained)) > 0
  # Drawn = trained + in flight + drawn but not started: nothing lost.
  in_flight = [g.example.prompt_id for g in buf.groups] + [ex.prompt_id for ex, _ in buf.fresh]
  assert sorted(trained + in_flight) == list(range(loader.next))


def test_a_group_waits_for_its_unfinished_sibling():
  buf = new_buffer()
  plan = buf.start_round(0, Loader())
  rid, ids = plan.requests[0].id, plan.requests[0].prompt
  buf.add(Sample(rid, ids, (5, 2), (-1.0, -1.0), "stop", weight_version=0, instance_id=0))
  assert buf.num_done == 0
  buf.add(Sample(rid + 1, ids, (6,), (-1.0,), PARTIAL, weight_version=0, instance_id=0))
  assert buf.num_done == 0
  plan = buf.start_round(1, Loader())
  # Only the unfinished sibling is asked for again, resumed after its token.
  assert plan.resume[rid + 1] == Request(rid + 1, ids + (6,), 15)
  assert all(r.id != rid for r in plan.requests)
  with pytest.raises(RuntimeError, match="second sample"):
    buf.add(Sample(rid, ids, (5,), (-1.0,), "stop", weight_version=1, instance_id=0))
  buf.add(
      Sample(rid + 1, ids + (6,), (7, 2), (-1.0, -1.0), "stop", weight_version=1, instance_id=0)
  )
  assert buf.num_done == 1
  with pytest.raises(RuntimeError, match="1 finished groups of the 3"):
    buf.finish_round(1)


def test_tokens_beyond_the_version_gap_are_never_trained():
  buf, loader = new_buffer(max_gap=1), Loader()
  wasted = 0
  for it in range(6):
    # One token per round: long responses span many rounds, so the bound bites.
    plan = run_round(buf, it, loader, version=it, per_round=1)
    wasted += plan.wasted_tokens
    if buf.num_done >= buf.target:
      samples, _, metrics = buf.finish_round(it)
      assert metrics["partial/token_version_gap_max"] <= 1
      assert all(it - v <= 1 for s in samples for v in s.token_versions)
  assert wasted > 0


def test_the_buffer_resumes_from_its_saved_state():
  def play(buf, loader, rounds):
    out = []
    for it in rounds:
      run_round(buf, it, loader, version=it, per_round=3)
      if buf.num_done >= buf.target:
        samples, _, _ = buf.finish_round(it)
        out.append([(s.prompt_token_ids, s.token_ids, s.token_versions) for s in samples])
    return out

  straight, loader = new_buffer(), Loader()
  first = play(straight, loader, range(3))
  saved = json.loads(json.dumps(straight.state()))  # as the checkpoint's meta holds it
  at = loader.next
  rest = play(straight, loader, range(3, 7))

  resumed = new_buffer()
  resumed.load_state(saved)
  loader2 = Loader()
  loader2.next = at
  assert first and play(resumed, loader2, range(3, 7)) == rest
  with pytest.raises(ValueError, match="same group size"):
    PartialBuffer(
        target_groups=3, extra_groups=2, group_size=3, max_tokens=16, max_version_gap=3
    ).load_state(saved)


def test_a_trajectorys_segments_are_stitched_with_their_mask_and_resume_state():
  buf = new_buffer(max_gap=1)
  plan = buf.start_round(0, Loader())
  ids = plan.requests[0].prompt
  # Segment 1 (version 0): a turn with its tool call, the observation, then stopped.
  seg1, mask1 = (5, 6, 7, 8, 9), (1, 1, 1, 0, 0)
  resume = Resume(len(ids), state={"calls": 1}, turns=1, turn_start=len(ids), tool_calls=1)
  stats1 = TurnStats(1, tool_calls=1, tool_s=0.5)
  buf.add(
      Sample(
          0,
          ids,
          seg1,
          (-1.0,) * 3 + (0.0,) * 2,
          PARTIAL,
          0,
          0,
          mask=mask1,
          turns=stats1,
          trajectory=resume,
      )
  )
  saved = json.loads(json.dumps(buf.state()))  # as the checkpoint's meta holds it
  again = new_buffer(max_gap=1)
  again.load_state(saved)
  assert again.groups[0].members[0] == buf.groups[0].members[0]
  plan = buf.start_round(1, Loader())
  # Resumed from the original prompt and every token so far, with the trajectory's state.
  assert plan.resume[0] == Request(0, ids + seg1, 16 - 5, trajectory=resume)
  stats2 = TurnStats(2, tool_calls=1, tool_s=0.5)  # the engine's counts: the whole trajectory's
  buf.add(Sample(0, ids + seg1, (10, 2), (-1.0, -1.0), "stop", 1, 0, mask=(1, 1), turns=stats2))
  for r in plan.requests[1:]:  # the other responses: one policy token each, under version 1
    buf.add(Sample(r.id, r.prompt, (2,), (-1.0,), "stop", 1, 0, mask=(1,), turns=TurnStats(1)))
  samples, _, metrics = buf.finish_round(1)
  s = samples[0]
  assert s.token_ids == seg1 + (10, 2) and s.mask == mask1 + (1, 1) and s.turns == stats2
  assert s.token_versions == (0,) * 5 + (1, 1) and s.weight_version == 0
  # Policy tokens only: member 0's gaps (1, 1, 1, 0, 0), the other five responses' 0.
  assert metrics["partial/token_version_gap_mean"] == pytest.approx(3 / 10)

  # The gap bound reads the oldest policy token: too old, the trajectory starts again.
  buf = new_buffer(max_gap=1)
  buf.start_round(0, Loader())
  buf.add(
      Sample(0, ids, seg1, (0.0,) * 5, PARTIAL, 0, 0, mask=mask1, turns=stats1, trajectory=resume)
  )
  assert buf.start_round(1, Loader()).resume[0].trajectory == resume
  plan = buf.start_round(2, Loader())
  assert plan.wasted_tokens == 5 and 0 not in plan.resume
  assert buf.groups[0].members[0].trajectory is None
  # An environment state JSON cannot hold cannot be checkpointed: said in one sentence.
  buf.start_round(2, Loader())
  buf.add(
      Sample(
          0,
          ids,
          seg1,
          (0.0,) * 5,
          PARTIAL,
          2,
          0,
          mask=mask1,
          turns=stats1,
          trajectory=dataclasses.replace(resume, state={"seen": {1, 2}}),
      )
  )
  with pytest.raises(UserError, match="not JSON-serialisable.*pipeline.partial=off"):
    buf.state()
