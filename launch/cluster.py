r"""Starts or stops a multi-node Ray cluster on this machine (tests and demos).

  python launch/cluster.py up [--dir=/tmp/streamrl_cluster] [--generation_slots=4]
      [--trainer_dc=dc0] [--generation_dc=dc1] [--gpus=0] [--no_auth]
      [--node_ip_address=127.0.0.1]
  python launch/cluster.py down [--dir=/tmp/streamrl_cluster]

`up` starts a head (no work of its own), a training node (`training_pool`,
datacenter dc0) and a generation node (`generation_pool`, datacenter dc1), each
a `ray start --block` of its own with its labels (datacenter, pool,
accelerator), token authentication on, every node on 127.0.0.1 (its Ray
servers listen on loopback only; `--node_ip_address` puts them on another
address of this machine, open to its network), and prints what a run needs:

  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/tmp/streamrl_cluster/auth_token \
      RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
  python launch/main.py --config=configs/ppo.py --config.pipeline.mode=sync \
      --config.cluster.address=127.0.0.1:PORT --config.transfer.enabled=True

(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 lets Ray's own clients, `ray status` and
a plain `ray.init`, reach a head on 127.0.0.1; a run needs only the token,
and `ray start --address` refuses to run with it set.)

The run places the trainer on the training node and the generators on the
generation node, and <workdir>/placement.json records each one's Ray node id
and datacenter. `--gpus=N` gives the two worker nodes N fake GPUs each (Ray
sets CUDA_VISIBLE_DEVICES for actors that ask for them). The nodes keep
running after `up` returns; `down` stops them (their pids are in
<dir>/cluster.json). The equivalent `ray start` lines are in
streamrl/local_cluster.py.
"""

import json
import os
import signal
import sys
import time

# Runnable as `python launch/cluster.py` from a checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # pylint: disable=g-import-not-at-top,wrong-import-position

from streamrl import cli, errors  # pylint: disable=g-import-not-at-top,wrong-import-position
from streamrl.cluster import local as local_cluster  # pylint: disable=g-import-not-at-top,wrong-import-position

_DIR = flags.DEFINE_string("dir", "/tmp/streamrl_cluster", "Node logs, token and cluster.json.")
_SLOTS = flags.DEFINE_integer(
    "generation_slots", 4, "Generator instances the generation node may host."
)
_TRAINER_DC = flags.DEFINE_string("trainer_dc", "dc0", "Datacenter label of the training node.")
_GEN_DC = flags.DEFINE_string("generation_dc", "dc1", "Datacenter label of the generation node.")
_CPUS = flags.DEFINE_integer("cpus_per_node", 1, "CPUs each worker node offers.")
_GPUS = flags.DEFINE_integer("gpus", 0, "Fake GPUs each worker node offers.")
_NO_AUTH = flags.DEFINE_bool("no_auth", False, "Start without token authentication.")
_NODE_IP = flags.DEFINE_string(
    "node_ip_address",
    "127.0.0.1",
    "Every node's address: 127.0.0.1 listens on this machine only; another address of it "
    "opens the nodes to its network (Ray then listens on every interface).",
)


def _state_path() -> str:
  return os.path.join(_DIR.value, "cluster.json")


def up() -> None:
  if os.path.exists(_state_path()):
    raise errors.UserError(
        f"A cluster started from {_DIR.value} may still run; stop it with "
        f"`python launch/cluster.py down --dir={_DIR.value}` or choose another --dir."
    )
  from streamrl import cluster  # pylint: disable=g-import-not-at-top

  cluster.check_node_ip_address(_NODE_IP.value, key="--node_ip_address")
  nodes = local_cluster.default_nodes(
      trainer_dc=_TRAINER_DC.value,
      generation_dc=_GEN_DC.value,
      generation_slots=_SLOTS.value,
      trainer_cpus=_CPUS.value,
      generator_cpus=_CPUS.value,
      gpus=_GPUS.value,
  )
  c = local_cluster.LocalCluster(
      nodes, workdir=_DIR.value, auth=not _NO_AUTH.value, node_ip_address=_NODE_IP.value
  ).start()
  with open(_state_path(), "w") as f:
    json.dump(
        {"address": c.address, "env": c.env(), "pids": {n: p.pid for n, p in c.procs.items()}},
        f,
        indent=1,
    )
  exports = " ".join(f"{k}={v}" for k, v in c.env().items())
  print(f"Ray cluster up at {c.address}: " + ", ".join(n.name for n in nodes))
  if exports:
    print(f"export {exports}")
  print(f"python launch/main.py ... --config.cluster.address={c.address}")


def down() -> None:
  try:
    with open(_state_path()) as f:
      state = json.load(f)
  except FileNotFoundError:
    raise errors.UserError(f"No cluster was started from {_DIR.value} (no cluster.json).") from None
  for name, pid in reversed(list(state["pids"].items())):
    try:
      os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
      continue
    for _ in range(100):
      try:
        os.kill(pid, 0)
      except ProcessLookupError:
        break
      time.sleep(0.2)
    print(f"stopped {name} (pid {pid})")
  port = int(state["address"].rsplit(":", 1)[1])
  local_cluster.forget_address(port)
  os.remove(_state_path())


def main(argv):
  if len(argv) != 2 or argv[1] not in ("up", "down"):
    raise errors.UserError("say what to do: `python launch/cluster.py up` or `... down`.")
  up() if argv[1] == "up" else down()  # pylint: disable=expression-not-assigned


if __name__ == "__main__":
  cli.run_main(main)
