"""A generation request as the scheduler, the pipeline and the engines pass it.

(request id, prompt token ids), or with a third element: that request's own
max_tokens or None (a resumed partial response: its prompt holds the tokens
it already has, and only the rest of the budget is left), and a fourth: its
length hint (`scheduling.siblings.LengthHint`: its group of samples of one
prompt and the dispatcher's length estimate), which makes the instance order
its pending requests by what their finished siblings say.
"""

from __future__ import annotations

from collections.abc import Sequence

Request = (
    tuple[int, Sequence[int]]
    | tuple[int, Sequence[int], int | None]
    | tuple[int, Sequence[int], int | None, object]
)


def request_parts(request) -> tuple[int, tuple[int, ...], int | None]:
  """(request id, prompt token ids, its own max_tokens or None) of a Request."""
  rid, ids, *rest = request
  budget = rest[0] if rest else None
  return int(rid), tuple(int(t) for t in ids), (None if budget is None else int(budget))


def request_hint(request):
  """A Request's length hint (`scheduling.siblings.LengthHint`), or None."""
  return request[3] if len(request) > 3 else None


def with_hint(request, hint) -> tuple:
  """`request` carrying `hint` (None: without one)."""
  rid, ids, budget = request_parts(request)
  if hint is not None:
    return (rid, ids, budget, hint)
  return (rid, ids) if budget is None else (rid, ids, budget)
