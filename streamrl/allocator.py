"""How a process holding weight-sized buffers hands freed memory back to the OS.

The trainer and the generators allocate and free buffers the size of a weight
matrix or a whole model many times per iteration (an update's gradients and
temporaries, a reload's tensors, a checkpoint's). glibc serves a block above
its mmap threshold with a mapping of its own, returned to the OS on free; but
the threshold grows to the size of every such block freed (up to 32 MiB),
after which blocks of that size come from the heap and stay resident once
freed, and every thread that allocates may get a heap (an arena) of its own.
Left so, a process's resident memory grows by what one phase freed, once per
arena, and the next phase (an export, a checkpoint) allocates on top of it.

Fixing the threshold low instead (every large block mapped apart) makes
every temporary of every step a fresh mapping whose pages the kernel zeroes:
measured far slower (experiments/RESULTS.md, bench_real_model.py). So the
heap is kept, with few arenas (`cap_arenas`, once, early in a process and
for the processes it starts), and what it holds free is returned at the ends
of the phases that free the most (`release_freed`: after an update, a
checkpoint, a reload). Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import gc
import os

# mallopt's parameter number (glibc's malloc.h).
_M_ARENA_MAX = -8
# Heaps for the threads that allocate: a few, not one per thread.
ARENA_MAX = 2


def _libc():
  try:
    libc = ctypes.CDLL("libc.so.6")
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
  except OSError:
    return None


def cap_arenas() -> bool:
  """Caps glibc's heaps at `ARENA_MAX` in this process (arenas already made
  stay) and in the processes it starts. True if the setting took."""
  os.environ.setdefault("MALLOC_ARENA_MAX", str(ARENA_MAX))
  libc = _libc()
  return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, ARENA_MAX))


def release_freed() -> None:
  """Collects Python's garbage and returns the heap's free pages to the OS."""
  gc.collect()
  libc = _libc()
  if libc is not None:
    libc.malloc_trim(0)
