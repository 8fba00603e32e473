"""The built-in agentic task: long sums the policy can only get right with a calculator.

A prompt adds `k` multi-digit numbers; the answer is their sum:

  `add:4821+3377+1234=` -> `9432`

The tiny policy cannot add four-digit numbers in its head, but it can call
the calculator of `env.name="calc"` (streamrl/envs) and copy digits, which
it can learn. The trajectory that solves the prompt above adds one number
per call, each call a policy turn and each result an observation:

  `[calc 4821+3377]` `(8198)` `[calc 8198+1234]` `(9432)` `#9432`

and the verifier reads what follows the last `#` (`tasks.final_answer`).
The number of terms is long-tailed (`k - 2` geometric, capped at
`max_terms`), so the number of tool calls, and the trajectory's length,
vary across prompts: most need one or two calls, a few need many.

The warm-up (`sft_target`) teaches both ways of answering: a fraction
`tool_fraction` of its targets are tool trajectories as above, the rest
the bare answer `#9432`, which the tiny policy cannot compute. So the
warm-started policy knows the tool-call format but mostly answers without
it, and is mostly wrong; RL has to find that calling the tool pays.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl.data import tasks


@dataclasses.dataclass(frozen=True)
class CalcConfig:
  """Shape of the sums: terms per prompt (2..max_terms, `k - 2` geometric
  with mean `mean_extra_terms`), digits per term, and the warm-up's share of
  tool trajectories."""

  max_terms: int = 6
  mean_extra_terms: float = 1.0
  digits: int = 4
  tool_fraction: float = 0.25


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


def tool_trajectory(terms) -> str:
  """The text of the trajectory that adds `terms` with the calculator, one call per term."""
  total, text = terms[0], ""
  for x in terms[1:]:
    text += f"[calc {total}+{x}]"
    total += x
    text += f"({total})"
  return f"{text}#{total}"


def sft_target(example, rng: np.random.Generator, config: CalcConfig) -> str:
  """The warm-up's target: a tool trajectory (`tool_fraction` of the time) or the bare answer."""
  if rng.random() < config.tool_fraction:
    return tool_trajectory(terms_of(example.prompt))
  return f"#{example.answer}"
