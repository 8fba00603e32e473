"""Real processes: a receiver or the sender is SIGKILLed in the middle of a transfer."""

import os
import pathlib
import signal
import subprocess
import sys
import time

from streamrl.transfer import Publisher, Receiver, RunKeys, new_secret, spawn_receiver
from streamrl.transfer.process import relay_only
from .conftest import Loads, config, make_tensors, wait_until

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The sender process: paced uplink so that version 1 takes ~2 s; prints its address, publishes on "go".
# Its secret comes as hex on the first line of stdin (argv would show it to every local user);
# its port and run keys go back on stdout, as hex.
SENDER = """
import sys, time
from streamrl.transfer import Publisher, Transfer
import numpy as np
secret = bytes.fromhex(sys.stdin.readline())
cfg = Transfer(chunk_bytes=1024, use_shm=False, uplink_bytes_per_s=4000.0)
pub = Publisher(cfg, dc="A", host="t", secret=secret)
k = pub.run_keys
print(pub.address[1], k.publisher_key.hex(), k.tls_cert.hex(), k.tls_key.hex(), flush=True)
sys.stdin.readline()
pub.publish({"w": np.arange(2048, dtype=np.float32)})
time.sleep(60)
"""


def test_killed_receiver_process_does_not_block_the_others():
  cfg = config(fanout=1, use_shm=False, uplink_bytes_per_s=8000.0, repair_interval_s=0.5)
  secret = new_secret()
  pub = Publisher(cfg, dc="A", host="trainer", secret=secret)
  procs = []
  try:
    procs = [
        spawn_receiver(
            f"p{i}",
            "A",
            relay_only,
            pub.address,
            config=cfg,
            host=f"h{i}",
            secret=secret,
            run_keys=pub.run_keys,
        )
        for i in range(3)
    ]
    assert pub.wait_receivers(3, timeout=60)
    v = pub.publish(make_tensors(7))
    head = pub.plan().children[0].info.name  # chain: sender -> head -> ... (fanout 1)
    time.sleep(0.3)  # the head is a few chunks in and already forwarding
    os.kill(procs[int(head[1:])].pid, signal.SIGKILL)
    assert pub.wait_acks(v, timeout=30)
    assert sorted(n for n, ver in pub.acked_versions().items() if ver == v) == sorted(
        f"p{i}" for i in range(3) if f"p{i}" != head
    )
    assert head not in [i.name for i in pub.receivers()]
  finally:
    for p in procs:
      p.kill()
      p.join(5)
    pub.close()


def test_killed_sender_leaves_receiver_on_its_old_version():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.Popen(
      [sys.executable, "-c", SENDER],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      text=True,
      env=env,
      cwd=ROOT,
  )
  loads = Loads()
  secret = new_secret()
  cfg = config(use_shm=False, max_retries=1)
  proc.stdin.write(secret.hex() + "\n")
  proc.stdin.flush()
  port, *keys = proc.stdout.readline().split()
  keys = RunKeys(*(bytes.fromhex(k) for k in keys))
  r = Receiver("r", "A", loads, config=cfg, host="h", secret=secret, run_keys=keys)
  try:
    r.join(("127.0.0.1", int(port)), timeout=30)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert wait_until(timeout=20.0, pred=lambda: r._inflight is not None and r._inflight.ready >= 2)
    os.kill(proc.pid, signal.SIGKILL)  # the sender dies with version 1 half delivered
    assert wait_until(timeout=20.0, pred=lambda: 1 in r._gave_up)
    assert (
        r.version == 0 and loads.calls == [] and r._inflight is None
    )  # load_fn never saw partial data
  finally:
    r.close()
    proc.kill()
    proc.wait(5)
