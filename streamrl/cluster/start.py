"""Ray as the distributed engine: start or join a cluster, and check what it offers.

Placement is by custom resources used as labels: a node that may host
generator instances offers `generation_pool`, a node that may host the trainer
offers `training_pool`. On one machine `init_ray` starts a local Ray whose
single node offers both; on a real cluster each node type is started with its
own label, e.g.

  ray start --head --resources='{"training_pool": 1}'              # H800 node
  ray start --address=<head>:6379 --resources='{"generation_pool": 8}'  # H20 node

and the run joins it with `--config.cluster.address=<head>:6379`.

Console output: Ray starts with `log_to_driver=False` by default, so what the
actors print (vLLM's engine, Ray's worker chatter) is not forwarded to the
launcher's terminal; it stays in Ray's session directory on each node,
/tmp/ray/session_latest/logs/worker-<id>-<job>-<pid>.{out,err} (the session
directory is printed by `ray status -v`; `ray logs` lists the files). Actors
that call `streamrl.metrics.configure_actor_logging(workdir)` also write their
library logs to <workdir>/libraries.log. An actor's exception still reaches
the launcher through `ray.get`. `cluster.log_to_driver=True` forwards
everything again (for debugging).

A wrong `cluster.address` (unreachable, not a Ray head, no node offering
`generation_pool`) fails fast with a `streamrl.errors.UserError` (for an
unreachable one, an `UnreachableClusterError`, also a ConnectionError).

CPU shares and pinning are in `shares.py`, node addresses in `addresses.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading

from streamrl import oom
from streamrl.cluster.addresses import LOOPBACK, check_node_ip_address, check_reachable, loopback_kept
from streamrl.cluster.config import parse_labels
from streamrl.cluster.shares import CpuShares, plan_cpu_shares
from streamrl.errors import UnreachableClusterError, UserError

log = logging.getLogger(__name__)

GENERATION_POOL = "generation_pool"
TRAINING_POOL = "training_pool"


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
  address: str | None  # None: a local Ray started by init_ray.
  started_locally: bool
  # Known only for a local Ray on this machine.
  shares: CpuShares | None
  generator_cpus: int
  trainer_cpus: int
  resources: dict


# Read once at import: pinning the trainer later narrows this process's own


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    generator_cpus: int = 1,
    trainer_cpus: int = 1,
    trainer_processes: int = 1,
    generation_slots: int = 64,
    timeout_s: float = 30.0,
    log_to_driver: bool = False,
    generation_pool: str = GENERATION_POOL,
    training_pool: str = TRAINING_POOL,
    node_ip_address: str = LOOPBACK,
) -> ClusterInfo:
  """Starts a local Ray (address None or empty) or joins the cluster at
  `address`, and returns where things may run.

  Local: the node offers `generation_pool=generation_slots` (at most that many
  generator instances) and `training_pool=trainer_processes`, and `num_cpus`
  logical CPUs (default generator_cpus + trainer_cpus per trainer process).
  Its address is `node_ip_address`: on 127.0.0.1 every Ray server listens on
  loopback only. Remote: the nodes' own labels and addresses are used, and at
  least one node must offer `generation_pool`.

  `log_to_driver=False` (the default) keeps the actors' stdout/stderr out of
  this process's terminal (see the module docstring for where it goes). Ray's
  own log lines in this process follow `streamrl.metrics.configure_logging`
  (into <workdir>/libraries.log once it has run).

  Raises:
    UnreachableClusterError: `address` does not answer, or not as a Ray head.
    UserError: `address` is malformed, no node offers `generation_pool`, or
      `node_ip_address` is not an address of this machine.
  """
  import ray  # pylint: disable=g-import-not-at-top
  from streamrl import metrics  # pylint: disable=g-import-not-at-top

  metrics.adopt_library_loggers()  # Importing ray attached its console handler to "ray".
  if not address:
    check_node_ip_address(node_ip_address)
  with _token_mode_undone_on_failure(address):
    if address and use_token_auth() and not token_available():
      raise UserError(
          "RAY_AUTH_MODE=token but no Ray auth token was found; copy the head's "
          "~/.ray/auth_token here, or point RAY_AUTH_TOKEN_PATH at it."
      )
    if address and address != "auto":
      host, port = check_reachable(address, min(timeout_s, 10.0))
      if not address.startswith("ray://"):
        _probe_gcs(f"{host}:{port}", min(timeout_s, 10.0))
    want_cpus = num_cpus or generator_cpus + trainer_cpus * trainer_processes
    want = {"CPU": want_cpus, generation_pool: 1, training_pool: trainer_processes}
    if ray.is_initialized() and not address:
      have = ray.cluster_resources()
      short = {k: v for k, v in want.items() if have.get(k, 0) < v}
      if short and _local_ray_started_here():
        # A local Ray of an earlier run in this process, sized for that run:
        # its CPUs would be held by this run's trainer and the generators
        # would wait forever. Start one sized for this run.
        log.info(
            "Restarting this process's local Ray: it offers %s, this run needs %s.", have, want
        )
        ray.shutdown()
      elif short:
        raise UserError(
            f"The Ray already initialised in this process offers {have} but the run needs at least "
            f"{want}; call ray.shutdown() before the run, or ray.init with those resources."
        )
    if ray.is_initialized():
      log.info("Ray is already initialised in this process; reusing it.")
      started_locally = not address
    else:
      if address:
        kwargs = dict(address=address, log_to_driver=log_to_driver)
      else:
        # The memory plan, not Ray's memory monitor, decides what fits (streamrl/oom.py).
        oom.ray_env()
        kwargs = dict(
            # A new Ray of this process's own, even when `ray start` left a
            # cluster's address in /tmp/ray/ray_current_cluster.
            address="local",
            num_cpus=want_cpus,
            resources={generation_pool: generation_slots, training_pool: trainer_processes},
            include_dashboard=False,
            log_to_driver=log_to_driver,
            _node_ip_address=node_ip_address,
            # No idle Python workers started ahead of need (one per CPU by
            # default): every process of a run is an actor or task it starts,
            # and an idle one holds memory the plan does not count.
            _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        )
      try:
        # Kept: a local node on 127.0.0.1, or a head at 127.0.0.1 (launch/cluster.py up).
        with loopback_kept():
          ray.init(**kwargs)
      except Exception as e:  # pylint: disable=broad-except
        if address and "auth" in str(e).lower():
          raise UnreachableClusterError(_TOKEN_REFUSED.format(address=address)) from None
        if not isinstance(e, (ConnectionError, RuntimeError)):
          raise
        if address:
          raise UnreachableClusterError(
              f"Could not join the Ray cluster at {address!r} ({' '.join(str(e).split())[:300]}); check it "
              "with `ray status --address=...` or fix --config.cluster.address."
          ) from e
        raise ConnectionError(f"Could not start a local Ray: {e}") from e
      started_locally = not address
      _LOCAL_RAY["session"] = _ray_session(ray) if started_locally else None
      if not log_to_driver:
        _raylet_reports_to_log(ray)
    resources = ray.cluster_resources()
    if generation_pool not in resources:
      raise UserError(
          f"No node of the Ray cluster at {address!r} offers {generation_pool!r}; start the "
          f"generation nodes with `ray start --resources='{{\"{generation_pool}\": 8}}'` "
          "(or launch/cluster.py up)."
      )
    shares = plan_cpu_shares(generator_cpus, trainer_cpus) if started_locally else None
    return ClusterInfo(
        address=address or None,
        started_locally=started_locally,
        shares=shares,
        generator_cpus=generator_cpus,
        trainer_cpus=trainer_cpus,
        resources=dict(resources),
    )


def _raylet_reports_to_log(ray) -> None:
  """Sends the raylet's reports (a dead worker's paragraph of causes, Ray's
  memory monitor's list of the top consumers), which Ray's driver prints on
  stdout, to the "ray" logger instead: <workdir>/libraries.log, with the rest
  of what Ray says. The run's own error names the process that died
  (streamrl/oom.py); the console keeps StreamRL's lines."""
  worker = ray._private.worker  # pylint: disable=protected-access
  original = getattr(worker.print_to_stdstream, "streamrl_original", worker.print_to_stdstream)
  ray_log = logging.getLogger("ray")

  def print_to_stdstream(data, ignore_prefix):
    if data.get("pid") != "raylet":
      return original(data, ignore_prefix)
    for line in data.get("lines", ()):
      ray_log.warning("(raylet) %s", line)
    return None

  print_to_stdstream.streamrl_original = original
  worker.print_to_stdstream = print_to_stdstream


# The session directory of the local Ray that init_ray itself started in this
# process (None when the current Ray is someone else's).
_LOCAL_RAY: dict = {"session": None}


def _ray_session(ray) -> str | None:
  try:
    return ray._private.worker.global_worker.node.get_session_dir_path()  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return None


def _local_ray_started_here() -> bool:
  import ray  # pylint: disable=g-import-not-at-top

  session = _LOCAL_RAY["session"]
  return session is not None and session == _ray_session(ray)


_TOKEN_REFUSED = (
    "The Ray cluster at {address!r} uses token authentication and refused this process; "
    "copy the head's ~/.ray/auth_token here (or set RAY_AUTH_TOKEN_PATH to it) and run again."
)


def _probe_gcs(address: str, timeout_s: float) -> None:
  """Asks the address for Ray's GCS in a helper thread: a port that answers
  but isn't a Ray head would otherwise keep ray.init retrying for minutes,
  and an abandoned ray.init would leave this process's Ray state half set."""
  from ray._raylet import GcsClient  # pylint: disable=g-import-not-at-top

  result: dict = {}

  def target():
    try:
      GcsClient(address=address).internal_kv_get(b"streamrl-probe", None, timeout=timeout_s)
    except BaseException as e:  # pylint: disable=broad-except
      result["error"] = e

  t = threading.Thread(target=target, name="ray-gcs-probe", daemon=True)
  t.start()
  t.join(timeout_s)
  if "error" in result and "auth" in str(result["error"]).lower():
    raise UnreachableClusterError(_TOKEN_REFUSED.format(address=address))
  if t.is_alive() or "error" in result:
    why = (
        f"no answer within {timeout_s:.0f} s"
        if t.is_alive()
        else f"{result['error'].__class__.__name__}: {str(result['error'])[:200]}"
    )
    raise UnreachableClusterError(
        f"{address!r} answers but is not a reachable Ray head ({why}); check it with "
        "`ray status --address=...` or fix --config.cluster.address."
    )


def init_ray_for(c, gpus_needed: int = 0, trainer_processes: int = 1) -> ClusterInfo:
  """Starts or joins Ray as `c` (a `Cluster`) says, and
  checks that the cluster has the `gpus_needed` GPUs and the training-pool
  slots for `trainer_processes` the run will ask for (an actor asking for
  more than exist would wait forever)."""
  info = init_ray(
      c.address or None,
      generator_cpus=c.generator_cpus,
      trainer_cpus=c.trainer_cpus,
      trainer_processes=trainer_processes,
      timeout_s=c.connect_timeout_s,
      generation_pool=c.generation_pool,
      training_pool=c.training_pool,
      node_ip_address=c.node_ip_address,
  )
  check_gpus(gpus_needed, info.resources)
  import ray  # pylint: disable=g-import-not-at-top

  check_placement(c, ray.nodes())
  slots = int(info.resources.get(c.training_pool, 0))
  if trainer_processes > slots:
    raise UserError(
        f"cluster.trainer_processes={trainer_processes} needs that many {c.training_pool!r} "
        f"slots but the Ray cluster offers {slots}; start the training nodes with "
        f"`ray start --resources='{{\"{c.training_pool}\": 1}}'` or lower trainer_processes."
    )
  return info


DATACENTER_LABEL = "datacenter"
DEFAULT_DATACENTER = "dc0"


def where_am_i() -> dict:
  """This process's Ray node: {"node_id", "datacenter", "labels", "host"}
  (datacenter from the node's `datacenter` label, "dc0" without one or
  outside Ray)."""
  out = {"host": socket.gethostname(), "node_id": None, "labels": {}}
  try:
    import ray  # pylint: disable=g-import-not-at-top

    if ray.is_initialized():
      ctx = ray.get_runtime_context()
      out["node_id"] = ctx.get_node_id()
      labels = ctx.get_node_labels() or {}
      out["labels"] = {k: v for k, v in labels.items() if not k.startswith("ray.io/")}
  except Exception:  # pylint: disable=broad-except
    pass  # Outside Ray: no node.
  out["datacenter"] = str(out["labels"].get(DATACENTER_LABEL, DEFAULT_DATACENTER))
  return out


def token_available() -> bool:
  """Whether this process can present a Ray auth token (RAY_AUTH_TOKEN,
  RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)."""
  if os.environ.get("RAY_AUTH_TOKEN"):
    return True
  path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
  return os.path.isfile(path)


@contextlib.contextmanager
def _token_mode_undone_on_failure(address):
  """A join that fails leaves this process as it was: RAY_AUTH_MODE=token set
  by `use_token_auth` for the attempt is removed again, so that a local Ray
  started later in the process does not expect a token."""
  set_here = bool(address) and "RAY_AUTH_MODE" not in os.environ
  try:
    yield
  except BaseException:
    if set_here:
      os.environ.pop("RAY_AUTH_MODE", None)
    raise


def use_token_auth() -> bool:
  """Joining a cluster: turns on Ray's token authentication for this process
  (RAY_AUTH_MODE=token) when a token is available and the mode is not set.
  A cluster started with token auth (Ray's `ray start --head` default in
  2.60) refuses a process without it; one without auth accepts it anyway."""
  if "RAY_AUTH_MODE" in os.environ:
    return os.environ["RAY_AUTH_MODE"] == "token"
  if token_available():
    os.environ["RAY_AUTH_MODE"] = "token"
    return True
  return False


def check_placement(c, nodes: list[dict]) -> None:
  """Some alive node offers each side's pool with each side's labels (`c`: a
  `Cluster`; `nodes`: `ray.nodes()`), so that no actor
  waits forever for a node that does not exist."""
  for side, pool, text in (
      ("generation", c.generation_pool, c.generation_labels),
      ("training", c.training_pool, c.training_labels),
  ):
    want = parse_labels(text)
    if not want:
      continue
    ok = any(
        n.get("Alive")
        and n.get("Resources", {}).get(pool, 0) > 0
        and all(n.get("Labels", {}).get(k) == v for k, v in want.items())
        for n in nodes
    )
    if not ok:
      raise UserError(
          f"No Ray node offers {pool!r} with the labels cluster.{side}_labels={text!r}; "
          f"start one with `ray start --resources='{{\"{pool}\": 1}}' --labels=...` or "
          "fix the labels."
      )


def check_gpus(needed: int, resources: dict) -> None:
  have = int(resources.get("GPU", 0))
  if needed > have:
    raise UserError(
        f"The run asks for {needed} GPUs (cluster.trainer_gpus + engine.num_instances x "
        f"engine.gpus_per_instance) but the Ray cluster has {have}; lower those settings "
        "or add GPU nodes."
    )
