"""streamrl/allocator.py: freed weight-sized blocks go back to the OS."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.unit]

# Frees every other one of 200 blocks of 1 MiB (the holes between live blocks
# cannot be trimmed from a heap) and prints how much resident memory the
# freeing returned, in MiB.
_PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    from streamrl import allocator
    if sys.argv[1] == "on":
      assert allocator.hand_back_large_blocks()

    def rss_mib():
      with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    np.ones(1 << 18, np.float32)  # one block of 1 MiB freed: glibc's threshold grows to it
    blocks = [np.ones(1 << 18, np.float32) for _ in range(200)]
    before = rss_mib()
    del blocks[::2]
    print(before - rss_mib())
""")


def _returned_mib(mode: str) -> float:
  out = subprocess.run(
      [sys.executable, "-c", _PROBE, mode],
      capture_output=True,
      text=True,
      check=True,
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  )
  return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_blocks_leave_the_process():
  assert _returned_mib("on") > 90  # the 100 freed MiB, each block unmapped on free
  # Without the settings the freed blocks stay in the heap, between live ones.
  assert _returned_mib("off") < 10
