"""A generation request as the scheduler, the pipeline and the engines pass it.

`Request(id, prompt)` asks for one sample of `prompt` (token ids) under
request id `id`. Two optional fields:

- `max_tokens`: this request's own budget, None for the sampling's
  `max_tokens`. A resumed partial response sets it: its prompt holds the
  tokens it already has, and only the rest of the budget is left.
- `hint`: its length hint (`scheduling.siblings.LengthHint`: its group of
  samples of one prompt and the dispatcher's length estimate), which makes
  the instance order its pending requests by what their finished siblings
  say.
- `trajectory`: for a multi-turn trajectory stopped early and resumed
  (`streamrl.envs.runner.Resume`), where it goes on from; its prompt holds
  the original prompt and every token so far.

The generate entry points also take plain `(id, prompt)` tuples (and
`(id, prompt, max_tokens)`), so a user calling a rollout directly need not
build Requests; `Request.of` turns either into a Request.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence

from streamrl.scheduling.siblings import LengthHint

if typing.TYPE_CHECKING:  # Only named here: the request carries it to the engine.
  from streamrl.envs.runner import Resume


@dataclasses.dataclass(frozen=True)
class Request:
  """One sample to generate: its id, prompt token ids, budget, length hint and, resuming a
  trajectory, where it goes on from."""

  id: int
  prompt: tuple[int, ...]
  max_tokens: int | None = None
  hint: LengthHint | None = None
  trajectory: Resume | None = None

  def __post_init__(self):
    # Coerced once here, so ids from numpy or a list compare and hash alike.
    object.__setattr__(self, "id", int(self.id))
    object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
    if self.max_tokens is not None:
      if int(self.max_tokens) < 0:
        raise ValueError(
            f"Request {self.id} has max_tokens={self.max_tokens}; give a budget >= 0 or None."
        )
      object.__setattr__(self, "max_tokens", int(self.max_tokens))
    if self.hint is not None and not isinstance(self.hint, LengthHint):
      raise TypeError(
          f"Request {self.id}'s hint is a {type(self.hint).__name__}; give a "
          "scheduling.siblings.LengthHint or None."
      )

  @classmethod
  def of(cls, request) -> Request:
    """`request` as a Request: a Request, or an (id, prompt[, max_tokens[, hint]]) tuple."""
    if isinstance(request, Request):
      return request
    if isinstance(request, (tuple, list)) and 2 <= len(request) <= 4:
      return cls(*request)
    raise TypeError(
        f"A request is a Request(id, prompt) or an (id, prompt token ids) tuple, not {request!r}."
    )

  def with_hint(self, hint: LengthHint | None) -> Request:
    if hint is not None and not isinstance(hint, LengthHint):
      raise TypeError(f"Request {self.id}'s hint must be a scheduling.siblings.LengthHint or None.")
    # A copy with the new hint, without checking the other fields again (as
    # `dataclasses.replace` would): they were checked when this one was made.
    out = object.__new__(Request)
    out.__dict__.update(self.__dict__, hint=hint)
    return out


def as_requests(requests: Sequence) -> list[Request]:
  """Each of `requests` as a Request (see `Request.of`)."""
  return [Request.of(r) for r in requests]
