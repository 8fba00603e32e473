"""A run on one machine listens on loopback only (127.0.0.1, ::1), nowhere else.

Here: a local Ray as streamrl starts it (`cluster.init_ray`) with a trainer of
two processes joined into one JAX runtime the way `experiment.run_on_actor`
joins them (coordination service and gloo collectives), and the address
choices behind them. A whole run's listeners are checked in
tests/test_experiment.py (the async run), a multi-node cluster's in
tests/test_multinode.py.
"""

import os
import sys
import threading
import types

import psutil
import pytest
import ray

from streamrl import cluster, experiment
from streamrl.errors import UserError
from streamrl.generator import vllm_engine
from streamrl.trainer import runtime

pytestmark = [pytest.mark.ray]


# ----------------------------------------------------------------- helpers
def listening(roots=None) -> dict[tuple[str, int], tuple[str, int]]:
  """{(address, port): (process name, pid)} of every TCP socket listening in
  the process trees of `roots` (pids; default: this process)."""
  pids = set()
  for root in roots or [os.getpid()]:
    try:
      p = psutil.Process(root)
      pids |= {p.pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.NoSuchProcess:
      continue
  out = {}
  for c in psutil.net_connections(kind="inet"):
    if c.status == psutil.CONN_LISTEN and c.pid in pids:
      try:
        name = psutil.Process(c.pid).name()
      except psutil.NoSuchProcess:
        name = "?"
      out[(c.laddr.ip, c.laddr.port)] = (name, c.pid)
  return out


def exposed(found: dict) -> dict:
  """The listeners of `found` that other machines could reach."""
  return {k: v for k, v in found.items() if not cluster.is_loopback(k[0])}


class ListenerWatch:
  """Collects `listening()` every `every_s` seconds while the block runs,
  so that listeners of processes that end before it does are seen too."""

  def __init__(self, every_s: float = 1.0, roots=None):
    self.every_s, self.roots, self.seen = every_s, roots, {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="listener-watch", daemon=True)

  def _watch(self):
    while not self._stop.is_set():
      self.seen.update(listening(self.roots))
      self._stop.wait(self.every_s)

  def __enter__(self) -> "ListenerWatch":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()
    self.seen.update(listening(self.roots))


# -------------------------------------------------------- address choices
def test_loopback_is_127_x_and_ipv6_loopback_in_any_spelling():
  for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "::ffff:127.0.0.1", "localhost"):
    assert cluster.is_loopback(host), host
  for host in ("0.0.0.0", "::", "", "192.0.2.2", "::ffff:192.0.2.2", "vm"):
    assert not cluster.is_loopback(host), host


def test_ray_keeps_a_loopback_address_only_inside_loopback_kept():
  from ray._private import services

  resolve = services.resolve_ip_for_localhost
  with cluster.loopback_kept():
    assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    assert services.canonicalize_bootstrap_address("127.0.0.1:6379") == "127.0.0.1:6379"
    assert services.resolve_ip_for_localhost("10.1.2.3") == "10.1.2.3"
  assert services.resolve_ip_for_localhost is resolve


def test_the_coordinator_is_on_the_node_address_and_binds_only_it(monkeypatch):
  assert cluster.node_address() == "127.0.0.1"  # outside Ray
  host, _, port = runtime.coordinator_address("127.0.0.1").rpartition(":")
  assert host == "127.0.0.1" and int(port) > 0
  assert runtime.coordinator_address("::1").startswith("[::1]:")
  # What initialize asks of JAX (stand-ins: no runtime starts in this process).
  calls = {}
  fake = types.SimpleNamespace(
      config=types.SimpleNamespace(update=lambda *a: None),
      distributed=types.SimpleNamespace(initialize=lambda *a, **kw: calls.update(kw)),
      process_index=lambda: 0,
      process_count=lambda: 2,
      local_device_count=lambda: 1,
      device_count=lambda: 2,
  )
  monkeypatch.setitem(sys.modules, "jax", fake)  # what initialize imports
  monkeypatch.setattr(runtime, "_gloo_listens_on", lambda host: calls.update(gloo=host))
  runtime.initialize("127.0.0.1:4321", 2, 0, timeout_s=5, host="127.0.0.1")
  assert calls["coordinator_bind_address"] == "127.0.0.1:4321"  # JAX's default: [::]:4321
  assert calls["gloo"] == "127.0.0.1"


def test_a_node_ip_address_is_refused_where_it_cannot_apply():
  with pytest.raises(UserError, match="cluster.node_ip_address='10.0.0.2'.*drop"):
    cluster.Cluster(address="10.0.0.1:6379", node_ip_address="10.0.0.2").check()
  cluster.Cluster(address="10.0.0.1:6379").check()  # the default is fine
  was_up = ray.is_initialized()
  with pytest.raises(UserError, match="neither 127.0.0.1 nor an address of this machine"):
    cluster.init_ray(None, node_ip_address="203.0.113.9")  # TEST-NET-3: nobody's
  assert ray.is_initialized() == was_up  # refused before Ray started


def test_vllm_gets_the_node_address_unless_the_user_chose_one():
  env = {}
  added = vllm_engine.listen_on_node_address(env)
  assert env == added and env["VLLM_HOST_IP"] == "127.0.0.1"
  assert env["GLOO_SOCKET_IFNAME"] == cluster.interface_of("127.0.0.1")
  mine = {"VLLM_HOST_IP": "10.9.8.7", "GLOO_SOCKET_IFNAME": "eth9"}
  assert vllm_engine.listen_on_node_address(dict(mine)) == {}


# ------------------------------------------------------- what a run starts
@pytest.fixture(scope="module")
def local_ray():
  if ray.is_initialized():
    ray.shutdown()
  yield cluster.init_ray(None, generator_cpus=1, trainer_cpus=1, trainer_processes=2)
  ray.shutdown()


def test_a_local_ray_and_a_two_process_trainer_listen_on_loopback_only(local_ray, tmp_path):
  c = cluster.Cluster(trainer_processes=2)
  actor_cls = ray.remote(experiment.TrainerActor)
  options = experiment.trainer_actor_options(c)
  actors = [actor_cls.options(**options).remote(None, 1, k, 2, 1) for k in range(2)]
  logs = [str(tmp_path / experiment.log_name(k, 2)) for k in range(2)]
  queues = []
  try:
    coordinator = ray.get(actors[0].coordinator_address.remote())
    assert coordinator.startswith("127.0.0.1:"), coordinator
    # As run_on_actor does: logs, coordinator, jax.distributed + gloo, queues.
    processes, queues = experiment._start_processes(actors, c, str(tmp_path), logs)
    assert [p["process_index"] for p in processes] == [0, 1]
    found = listening()
  finally:
    for a in actors:
      ray.kill(a, no_restart=True)
    for q in queues:
      for one in q:
        one.shutdown(force=True)
  assert exposed(found) == {}, found
  assert {"gcs_server", "raylet"} <= {name for name, _ in found.values()}, found
  # Each trainer process: its Ray worker and gloo; process 0 the coordination service too.
  count = [sum(pid == p["pid"] for _, pid in found.values()) for p in processes]
  assert count[0] == count[1] + 1 and count[1] >= 2, found
