"""streamrl/allocator.py: freed weight-sized blocks go back to the OS."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.unit]

# Frees every other one of 200 blocks of 1 MiB (holes between live blocks,
# which glibc's automatic trimming of the heap's top never returns) and
# prints how much resident memory that returned, in MiB.
_PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    from streamrl import allocator
    assert allocator.cap_arenas()

    def rss_mib():
      with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    np.ones(1 << 18, np.float32)  # one block of 1 MiB freed: glibc's threshold grows to it
    blocks = [np.ones(1 << 18, np.float32) for _ in range(200)]
    before = rss_mib()
    del blocks[::2]
    if sys.argv[1] == "release":
      allocator.release_freed()
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
def test_released_blocks_leave_the_process():
  assert _returned_mib("release") > 90  # the 100 freed MiB
  # Without the release the freed blocks stay in the heap, between live ones.
  assert _returned_mib("keep") < 10
