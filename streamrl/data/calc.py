"""The built-in agentic task: long sums the policy can only get right with a calculator.

A prompt adds `k` multi-digit numbers; the answer is their sum:

  `add:4821+3377+1234=` -> `9432`

The tiny policy cannot add four-digit numbers in its head, but it can call
the calculator of `env.name="calc"` (streamrl/envs), which does one
operation per call and answers with what is left, and copy text, which it
can learn. The trajectory that solves the prompt above is one call per
addition, each call a policy turn and each answer an observation:

  `[calc 4821+3377+1234]` `(8198+1234)` `[calc 8198+1234]` `(9432)` `#9432`

and the verifier reads what follows the last `#` (`tasks.final_answer`).
The number of terms is long-tailed (`k - 2` geometric, capped at
`max_terms`), so the number of tool calls, and the trajectory's length,
vary across prompts: most need one or two calls, a few need many.

The warm-up (`sft_target`) teaches both ways of answering: a fraction
`tool_fraction` of its targets are tool trajectories as above (the policy's
turns trained, the calculator's answers masked), the rest the bare answer
`#9432`, which the tiny policy cannot compute.
So the warm-started policy knows the tool-call format and how to copy what is
left into a call, but mostly answers without the tool, and wrongly; RL has
to find that calling it pays. `tool_steps` puts a first phase of tool
trajectories alone before the mixture.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl.data import tasks


@dataclasses.dataclass(frozen=True)
class CalcConfig:
  """Shape of the sums: terms per prompt (2..max_terms, `k - 2` geometric
  with mean `mean_extra_terms`), digits per term; and the warm-up's: its first
  `tool_steps` steps train tool trajectories only, the rest a mixture with
  `tool_fraction` of them (`trainer.warmstart`)."""

  max_terms: int = 6
  mean_extra_terms: float = 1.0
  digits: int = 4
  tool_fraction: float = 0.25
  tool_steps: int = 0


def make_examples(n: int, seed: int, config: CalcConfig, *, first_id: int = 0) -> list:
  """`n` sums; the same arguments give the same list."""
  rng = np.random.default_rng(seed)
  p = 1.0 / (1.0 + config.mean_extra_terms)
  out = []
  for i in range(n):
    k = min(2 + int(rng.geometric(p)) - 1, config.max_terms)
    terms = [int(x) for x in rng.integers(10 ** (config.digits - 1), 10**config.digits, size=k)]
    out.append(
        tasks.Example(
            prompt_id=first_id + i,
            prompt="add:" + "+".join(map(str, terms)) + "=",
            answer=str(sum(terms)),
            task=f"calc-{k}",
            expected_length=float(len(tool_trajectory(terms)) + 1),
        )
    )
  return out


def terms_of(prompt: str) -> list[int]:
  return [int(x) for x in prompt.removeprefix("add:").removesuffix("=").split("+")]


# Changes with the trajectory's text or what the warm-up trains of it (part of the
# warm-start's cache key). 3: observations are not trained.
FORMAT = 3


def tool_segments(terms) -> list[tuple[str, bool]]:
  """The trajectory that adds `terms` with the calculator, one addition per
  call, as (text, written by the policy) pieces: each call copies what is
  left, the calculator adds its first two numbers
  (`envs.tools.step_calculator`) and answers with the rest."""
  terms, out = list(terms), []
  while len(terms) > 1:
    out.append((f"[calc {'+'.join(map(str, terms))}]", True))
    terms = [terms[0] + terms[1], *terms[2:]]
    out.append((f"({'+'.join(map(str, terms))})", False))
  out.append((f"#{terms[0]}", True))
  return out


def tool_trajectory(terms) -> str:
  """The text of `tool_segments(terms)`."""
  return "".join(text for text, _ in tool_segments(terms))


def sft_target(example, rng: np.random.Generator, config: CalcConfig) -> list[tuple[str, bool]]:
  """The warm-up's target as (text, trained) pieces: a tool trajectory
  (`tool_fraction` of the time), whose observations are the tool's and not
  trained, or the bare answer.

  The bare answer's digits are trained too, although the policy cannot
  compute them: the warm-up's batches come from one length bucket each and
  its loss is a mean over tokens, so with only `#` trained a bare batch put
  most of its weight on the choice to answer at once (measured: 2 % of
  trajectories called the tool after a warm-up with 30 % tool targets)."""
  if rng.random() < config.tool_fraction:
    return tool_segments(terms_of(example.prompt))
  return [(f"#{example.answer}", True)]
