"""Held-out evaluation: the policy's accuracy by the task's verifier.

`streamrl.train.run` evaluates before the first iteration, every
`log.eval_every` iterations and after the last; the accuracy of the training
samples themselves is logged per source the same way (`accuracy_by_source`).
"""

from __future__ import annotations

import dataclasses
import typing

import numpy as np

from streamrl.config import settings as settings_lib
from streamrl.data.loader import make_requests
from streamrl.data.rewards import Rewarder

if typing.TYPE_CHECKING:  # Only named in annotations: the rollout is a layer above.
  from streamrl.generator.rollout import Rollout


def accuracy_by_source(name: str, samples, correct, by_id) -> dict:
  """`name` over all samples, and `name/<data_source>` per source when the
  rows carry one."""
  out = {name: float(np.mean(correct))}
  sources = [by_id[x.prompt_id].source for x in samples]
  for src in sorted({x for x in sources if x is not None}):
    out[f"{name}/{src}"] = float(np.mean([c for c, x in zip(correct, sources) if x == src]))
  return out


def evaluate(
    rollout: Rollout, examples, tokenizer, rewarder: Rewarder, s: settings_lib.Settings
) -> dict:
  """Held-out accuracy by the task's verifier: sampled (the policy's pass@1)
  and greedy, and per data source when the rows name one."""
  requests, by_id = make_requests(examples, tokenizer, 1)
  out = {}
  for name, temp in (("accuracy", s.sampling.temperature), ("accuracy_greedy", 0.0)):
    sampling = dataclasses.replace(s.sampling, temperature=temp)
    samples = list(rollout.generate(requests, sampling, seed=s.seed))
    _, correct = rewarder(samples, by_id)
    out.update(accuracy_by_source(name, samples, correct, by_id))
  rewarder.metrics()  # The eval's reward metrics are not the training iteration's.
  return out
