"""The order one generate call admits its requests in.

Shared by the engine's single-turn loop (vllm_engine.py) and the multi-turn
agent loop (streamrl/envs/agent_loop.py). No torch or vLLM here.
"""

from __future__ import annotations

import collections

from streamrl.scheduling.pool import Feed
from streamrl.scheduling.request import as_requests
from streamrl.scheduling.siblings import SiblingQueue


def pending_queue(prompts) -> tuple:
  """(pending, hints): the Requests of one `generate` call not admitted yet,
  in the given order or, when they carry length hints, a `SiblingQueue` (see
  its module); and request id -> LengthHint ({} without hints). A shared
  pool's `Feed` is its own queue (more may come while it is open)."""
  if isinstance(prompts, Feed):
    return prompts, {}
  requests = as_requests(prompts)
  hints = [r.hint for r in requests]
  if not any(h is not None for h in hints):
    return collections.deque(requests), {}
  if any(h is None for h in hints):
    raise ValueError("Either every request of a generate call carries a length hint or none does.")
  return SiblingQueue(requests, hints), {r.id: r.hint for r in requests}
