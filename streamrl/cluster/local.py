"""A multi-node Ray cluster on one machine, for tests and demos.

Each node is one `ray start --block` process (its raylet, object store and
workers), with its own CPU/GPU counts, custom resources (the pools) and node
labels (datacenter, accelerator type, pool), exactly as on a real cluster:

  ray start --head --port=P --node-ip-address=127.0.0.1 --num-cpus=0 \
      --labels='{"datacenter":"dc0"}'
  ray start --address=127.0.0.1:P --node-ip-address=127.0.0.1 --num-cpus=1 \
      --resources='{"training_pool":1}' --labels='{"datacenter":"dc0",...}'
  ray start --address=127.0.0.1:P --node-ip-address=127.0.0.1 --num-cpus=1 \
      --resources='{"generation_pool":4}' --labels='{"datacenter":"dc1",...}'

Every node's address is 127.0.0.1 unless `node_ip_address` names another
address of this machine, and on 127.0.0.1 every Ray server listens on
loopback only. Ray 2.60 would replace that address with the machine's
network address (and listen on every interface), so each node runs those
lines as `python -m streamrl.cluster.local start ...`: Ray's own command line
with the address kept (`streamrl.cluster.addresses.loopback_kept`).

Token authentication is on by default, as `ray start --head` does when a
token exists: every node and every process that joins gets RAY_AUTH_MODE=token
and the token's path (`env()`); a run joins with those set (or with the token
in ~/.ray/auth_token, which `streamrl.cluster.init_ray` then uses by itself).
On loopback `env()` also has RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's
single-machine switch, with which Ray's own clients (`ray status`, a plain
`ray.init(address=...)`) keep 127.0.0.1 as the head's address too.
Fake GPU counts are fine: Ray then sets CUDA_VISIBLE_DEVICES for actors that
ask for GPUs, so placement can be tested without hardware.

  with LocalCluster(default_nodes(), workdir=d) as c:
    ... --config.cluster.address={c.address}, with c.env() in the environment

or from the shell: `python launch/cluster.py up` / `down` (see there).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

from streamrl import lifecycle, oom
from streamrl.cluster.addresses import LOOPBACK, is_loopback, loopback_kept
from streamrl.cluster.start import GENERATION_POOL, TRAINING_POOL


@dataclasses.dataclass(frozen=True)
class NodeSpec:
  """One Ray node: its name (for logs), CPUs, GPUs, custom resources and labels."""

  name: str
  cpus: int = 1
  gpus: int = 0
  resources: dict = dataclasses.field(default_factory=dict)
  labels: dict = dataclasses.field(default_factory=dict)


def default_nodes(
    *,
    trainer_dc: str = "dc0",
    generation_dc: str = "dc1",
    generation_slots: int = 4,
    trainer_cpus: int = 1,
    generator_cpus: int = 1,
    gpus: int = 0,
    training_slots: int = 1,
) -> list[NodeSpec]:
  """A head (no work of its own) plus a training node and a generation node,
  in two datacenters: the smallest cluster with every kind of edge. The
  training node holds `training_slots` trainer processes
  (`cluster.trainer_processes`), `trainer_cpus` each."""
  return [
      NodeSpec("head", cpus=0, labels={"datacenter": trainer_dc, "pool": "head"}),
      NodeSpec(
          "trainer",
          cpus=trainer_cpus * training_slots,
          gpus=gpus,
          resources={TRAINING_POOL: training_slots},
          labels={"datacenter": trainer_dc, "pool": "training", "accelerator": "trainer-standin"},
      ),
      NodeSpec(
          "generator",
          cpus=generator_cpus,
          gpus=gpus,
          resources={GENERATION_POOL: generation_slots},
          labels={
              "datacenter": generation_dc,
              "pool": "generation",
              "accelerator": "generator-standin",
          },
      ),
  ]


# Ray's single-machine switch: "0" makes its clients keep a loopback head address
# (and makes `ray start --address` refuse to run, so the nodes never get it).
_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _free_port(host: str = LOOPBACK) -> int:
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def forget_address(port: int) -> None:
  """`ray start --head` leaves its address in /tmp/ray/ray_current_cluster,
  where a later plain `ray.init()` would try to join it; `ray stop` removes
  it, and so does this (only if it still names the head at `port`)."""
  path = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")
  try:
    with open(path) as f:
      if f.read().strip().endswith(f":{port}"):
        os.remove(path)
  except OSError:
    pass


class LocalCluster:
  """Starts `nodes` (the first is the head) as Ray nodes on this machine.

  Args:
    nodes: the node specs; the first becomes the head.
    workdir: where each node's output goes (<workdir>/<name>.log) and, with
      `auth`, the token (<workdir>/auth_token) unless `token_path` is given.
    auth: token authentication (RAY_AUTH_MODE=token) for every node.
    object_store_mb: each node's object store (keeps a many-node cluster
      within a small machine's memory).
    start_timeout_s: longest wait for a node to come up.
    node_ip_address: every node's address: 127.0.0.1 (this machine only), or
      another address of this machine, which opens the nodes to its network.
  """

  def __init__(
      self,
      nodes: list[NodeSpec],
      *,
      workdir: str,
      auth: bool = True,
      token_path: str | None = None,
      port: int = 0,
      object_store_mb: int = 256,
      start_timeout_s: float = 120.0,
      node_ip_address: str = LOOPBACK,
  ):
    if not nodes:
      raise ValueError("A cluster needs at least one node (the head).")
    self.nodes = list(nodes)
    self.workdir = os.path.abspath(workdir)
    self.auth = auth
    self.token_path = token_path or os.path.join(self.workdir, "auth_token")
    self.node_ip_address = node_ip_address
    self.port = port or _free_port(node_ip_address)
    self.object_store_mb = object_store_mb
    self.start_timeout_s = start_timeout_s
    self.procs: dict[str, subprocess.Popen] = {}

  @property
  def address(self) -> str:
    host = self.node_ip_address
    return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

  def env(self) -> dict[str, str]:
    """What a process that joins needs in its environment."""
    out = {}
    if self.auth:
      out.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_path)
    if is_loopback(self.node_ip_address):
      out[_SINGLE_MACHINE] = "0"
    return out

  def _node_env(self) -> dict[str, str]:
    env = {**os.environ, **self.env()}
    env.pop(_SINGLE_MACHINE, None)
    # `python -m streamrl.cluster.local` from a checkout that is not installed.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return oom.ray_env(env)  # the memory plan, not Ray's monitor, decides what fits

  def _ray(self) -> list[str]:
    """Ray's command line, with a loopback node address kept (`ray_cli`)."""
    return [sys.executable, "-m", "streamrl.cluster.local"]

  def _command(self, node: NodeSpec, head: bool) -> list[str]:
    cmd = [*self._ray(), "start", "--block", "--disable-usage-stats"]
    cmd += [f"--node-ip-address={self.node_ip_address}"]
    if head:
      cmd += ["--head", f"--port={self.port}", "--include-dashboard=false"]
    else:
      cmd += [f"--address={self.address}"]
    cmd += [f"--num-cpus={node.cpus}", f"--num-gpus={node.gpus}"]
    cmd += [f"--object-store-memory={self.object_store_mb << 20}"]
    if node.resources:
      cmd += [f"--resources={json.dumps(node.resources)}"]
    if node.labels:
      cmd += [f"--labels={json.dumps({k: str(v) for k, v in node.labels.items()})}"]
    return cmd

  def start(self) -> "LocalCluster":
    os.makedirs(self.workdir, exist_ok=True)
    if self.auth and not os.path.isfile(self.token_path):
      with open(os.open(self.token_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    env = self._node_env()
    try:
      for k, node in enumerate(self.nodes):
        log_path = os.path.join(self.workdir, f"{node.name}.log")
        with open(log_path, "w") as out:
          self.procs[node.name] = subprocess.Popen(
              self._command(node, head=k == 0),
              stdout=out,
              stderr=subprocess.STDOUT,
              env=env,
              start_new_session=True,
          )
        self._wait_started(node.name, log_path)
    except BaseException:
      self.stop()
      raise
    return self

  def _wait_started(self, name: str, log_path: str) -> None:
    deadline = time.monotonic() + self.start_timeout_s
    while time.monotonic() < deadline:
      with open(log_path, errors="replace") as f:
        text = f.read()
      if "Ray runtime started" in text:
        return
      if self.procs[name].poll() is not None:
        tail = " ".join(text.strip().splitlines()[-3:])[-400:]
        raise RuntimeError(f"Ray node {name!r} failed to start: {tail} (log: {log_path}).")
      time.sleep(0.5)
    raise TimeoutError(f"Ray node {name!r} did not start within {self.start_timeout_s:.0f} s.")

  def stop(self, timeout_s: float = 30.0) -> None:
    """Stops every node (workers first, the head last)."""
    for name in reversed(list(self.procs)):
      p = self.procs.pop(name)
      if p.poll() is None:
        # `ray start --block` stops its node's processes on SIGTERM (~1 s).
        p.send_signal(signal.SIGTERM)
        try:
          p.wait(timeout_s)
        except subprocess.TimeoutExpired:
          try:
            os.killpg(p.pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
          p.wait()

    forget_address(self.port)
    _sweep_after_stop()

  def __enter__(self) -> "LocalCluster":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def _sweep_after_stop(wait_s: float = 5.0) -> None:
  """Removes the /dev/shm files the stopped nodes' processes left: stopping a node kills its
  workers with their resource trackers, so nothing else unlinks them (`lifecycle.sweep_shm`
  takes only files of dead processes). Workers still exiting get up to `wait_s`."""
  deadline = time.monotonic() + wait_s
  while True:
    lifecycle.sweep_shm()
    left = [n for n in _shm_names() if lifecycle.is_shm_name(n)]
    if not left or time.monotonic() > deadline:
      return
    time.sleep(0.5)


def _shm_names() -> list[str]:
  try:
    return os.listdir(lifecycle.SHM_DIR)
  except OSError:
    return []


def ray_cli(argv: list[str]) -> int:
  """`ray <argv>` with a loopback node or head address kept as given
  (`streamrl.cluster.addresses.loopback_kept`): what each node of a LocalCluster runs."""
  from ray.scripts.scripts import main  # pylint: disable=g-import-not-at-top

  sys.argv = ["ray", *argv]
  with loopback_kept():
    return main()


if __name__ == "__main__":
  sys.exit(ray_cli(sys.argv[1:]))
