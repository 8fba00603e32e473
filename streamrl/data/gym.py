"""Prompts made offline by the `reasoning-gym` package (`task.kind="gym"`).

`task.gym_dataset` names one of its procedural generators (`gsm_symbolic`:
GSM8K-style word problems from templates derived from GSM8K, with numbers
drawn anew) and each row keeps the generator's metadata, so the built-in
`reasoning_gym` reward scores a response with that generator's own scorer
(`reasoning_gym.get_score_answer_fn`). Nothing is downloaded: the
generators and their templates ship in the package.
"""

from __future__ import annotations

from streamrl.data.tasks import Example

TASK = "gym"


def make_examples(name: str, n: int, seed: int, *, first_id: int = 0) -> list[Example]:
  """`n` rows of generator `name`, the same for the same seed."""
  import reasoning_gym  # pylint: disable=g-import-not-at-top

  out = []
  for i, entry in enumerate(reasoning_gym.create_dataset(name, size=n, seed=seed)):
    out.append(
        Example(
            prompt_id=first_id + i,
            prompt=entry["question"],
            answer=str(entry["answer"]),
            task=TASK,
            fields={"metadata": entry["metadata"], "gym_dataset": name},
            source=name,
        )
    )
  return out


def known(name: str) -> bool:
  """Whether reasoning-gym has a generator called `name`."""
  import reasoning_gym  # pylint: disable=g-import-not-at-top

  try:
    reasoning_gym.get_score_answer_fn(name)
  except Exception:  # pylint: disable=broad-except
    return False
  return True
