"""How a process holding weight-sized buffers hands freed memory back to the OS.

The trainer and the generators allocate and free buffers the size of a weight
matrix or a whole model many times per iteration (an update's gradients and
temporaries, a reload's tensors). glibc serves a block above its mmap
threshold with a mapping of its own, returned to the OS on free; but the
threshold grows to the size of every such block freed (up to 32 MiB), after
which blocks of that size come from the heap and stay resident once freed,
and every thread that allocates may get a heap (an arena) of its own. Left so,
a process's resident memory grows by the temporaries of its largest step,
once per arena, memory that the run's memory plan does not count.

`hand_back_large_blocks` fixes the threshold (which stops its growth) and
caps the arenas, once, early in a process (and for the processes it starts);
`release_freed` returns what the
heap holds free after a one-off peak (a start-up profiling pass, a reload).
Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

# Blocks from this size up are mapped apart and unmapped on free. Large
# enough that the small objects of Python and the runtimes stay in the heap.
MMAP_THRESHOLD_BYTES = 128 * 1024
# Heaps for the threads that allocate: a few, not one per thread.
ARENA_MAX = 2


def _libc():
  try:
    libc = ctypes.CDLL("libc.so.6")
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
  except OSError:
    return None


def hand_back_large_blocks() -> bool:
  """Makes glibc map every block of `MMAP_THRESHOLD_BYTES` or more apart (so
  it is returned on free) and caps its arenas at `ARENA_MAX`. Call it before
  the process allocates its large buffers (arenas already made stay). True if
  both settings took."""
  # For the processes this one starts (an engine's own process, workers).
  os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD_BYTES))
  os.environ.setdefault("MALLOC_ARENA_MAX", str(ARENA_MAX))
  libc = _libc()
  if libc is None:
    return False
  ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
  ok = bool(libc.mallopt(_M_ARENA_MAX, ARENA_MAX)) and ok
  if not ok:
    log.debug("glibc refused the allocator settings; freed memory may stay resident")
  return ok


def release_freed() -> None:
  """Collects Python's garbage and returns the heap's free pages to the OS."""
  gc.collect()
  libc = _libc()
  if libc is not None:
    libc.malloc_trim(0)
