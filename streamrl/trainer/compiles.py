"""How many XLA programs this process has compiled, and the seconds they took.

JAX reports every program it builds for a backend (compiled, or read from the
persistent compilation cache) as one `/jax/core/compile/backend_compile_duration`
event; `install()` counts them from then on. The run logs the totals each
iteration as `compile/programs` and `compile/seconds` (`compile/cache_hits`:
how many of them the persistent cache served).
"""

from __future__ import annotations

import threading

from jax import monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_totals = {"programs": 0, "seconds": 0.0, "cache_hits": 0}
_installed = False


def _on_duration(event: str, seconds: float, **_) -> None:
  if event == _BACKEND_COMPILE:
    with _lock:
      _totals["programs"] += 1
      _totals["seconds"] += float(seconds)


def _on_event(event: str, **_) -> None:
  if event == _CACHE_HIT:
    with _lock:
      _totals["cache_hits"] += 1


def install() -> None:
  """Starts counting (once per process; later calls do nothing)."""
  global _installed
  with _lock:
    if _installed:
      return
    _installed = True
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)


def totals() -> dict:
  """{"compile/programs", "compile/seconds", "compile/cache_hits"} since `install()`."""
  with _lock:
    return {f"compile/{k}": v for k, v in _totals.items()}
