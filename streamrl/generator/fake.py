"""A rollout without vLLM, for tests and benchmarks of the loop and the modes.

`FakeRollout` answers each request with a token sequence fixed by its id
and prompt, yields them in a shuffled "finish" order, and stamps each sample
with the weight version it holds, so a test can count samples and check
versions exactly while the real trainer and the real loop
(`streamrl/train.py`) run. Every field a caller may read is public.
"""

from __future__ import annotations

import threading

import numpy as np

from streamrl.generator.config import Sampling
from streamrl.generator.rollout import PARTIAL, Sample, UpdateHandle, as_requests


class FakeRollout:
  """A `Rollout` without an engine: deterministic answers, a shuffled finish
  order, real weight versions.

  Stoppable (partial rollouts): after `stop_generation`, every request not
  yielded yet comes back PARTIAL with a prefix of its answer; a request
  with its own budget (a resumed one) answers with at most that many tokens.
  """

  def __init__(self, seed=0):
    self.version = 0
    self.rng = np.random.default_rng(seed)
    self.busy_intervals = []
    self.dead_instances = []
    self.live_instances = [0, 1]
    self.placement = {}
    self.updates = []
    self.lock = threading.Lock()
    self.produced = []
    self.assignments = []
    self.num_instances = 2
    self.retired = []
    self.pooled = False
    self.publisher = None
    self._stop = False

  def helper_placement(self):
    return None

  def stop_generation(self):
    self._stop = True

  def generate(
      self,
      requests,
      sampling: Sampling,
      *,
      seed: int | None = None,
      assignments=None,
      caps=None,
      stoppable=False,
  ):
    """`rollout.Rollout.generate`; the answers depend on the request only
    (`sampling` and `seed` are ignored)."""
    if assignments is not None:
      self.assignments.append(assignments)
      requests = [r for part in assignments for r in part]
    requests = as_requests(requests)
    order = self.rng.permutation(len(requests))
    self._stop = False
    for j in order:
      rid, ids, budget = requests[j].id, requests[j].prompt, requests[j].max_tokens
      r = np.random.default_rng(rid + 7 * len(ids))
      n = int(r.integers(1, 12))
      tokens = tuple(int(t) for t in r.integers(4, 40, n)) + (2,)
      reason = "stop"
      if budget is not None and len(tokens) > budget:
        tokens, reason = tokens[:budget], "length"
      if stoppable and self._stop:
        tokens, reason = tokens[: int(r.integers(0, len(tokens)))], PARTIAL
      with self.lock:
        version = self.version
        self.produced.append((rid, tuple(ids), tokens, reason, version))
      yield Sample(
          prompt_id=rid,
          prompt_token_ids=tuple(ids),
          token_ids=tokens,
          logprobs=tuple(float(x) for x in -r.uniform(0.1, 3.0, len(tokens))),
          finish_reason=reason,
          weight_version=version,
          instance_id=0,
      )

  def update(self, tensors, version):
    with self.lock:
      self.version = version
      self.updates.append(version)
    return UpdateHandle.done(version, {0: version})

  def close(self):
    pass
