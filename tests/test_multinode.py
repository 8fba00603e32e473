"""A run across Ray nodes: a head plus a training node and a generation node
in two datacenters, all on this machine (streamrl/local_cluster.py), joined
the way a user joins a real cluster (token authentication on)."""

import json
import os
import subprocess
import sys

import pytest
import ray

from streamrl.cluster import local as local_cluster
from tests.test_loopback import exposed, listening

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

REPO = os.path.join(os.path.dirname(__file__), "..")
TINY = json.loads(open(os.path.join(os.path.dirname(__file__), "tiny_run.json")).read())


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return [r for r in rows if "samples/count" in r]


def _main(workdir, overrides, env):
  args = [sys.executable, os.path.join(REPO, "launch", "main.py")]
  args += ["--config=" + os.path.join(REPO, "configs", "ppo.py"), f"--workdir={workdir}"]
  args += [f"--config.{k}={v}" for k, v in overrides.items()]
  return subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def two_dc_cluster(tmp_path_factory):
  if ray.is_initialized():
    ray.shutdown()
  c = local_cluster.LocalCluster(
      local_cluster.default_nodes(generation_slots=4),
      workdir=str(tmp_path_factory.mktemp("cluster")),
  )
  with c:
    yield c


def test_the_nodes_listen_on_loopback_only(two_dc_cluster):
  c = two_dc_cluster
  found = listening([p.pid for p in c.procs.values()])
  assert exposed(found) == {}, found
  assert {"gcs_server", "raylet"} <= {name for name, _ in found.values()}, found
  # Ray's own clients reach the head at 127.0.0.1 too, with c.env().
  assert len(_nodes(c)) == len(c.nodes)


def test_a_run_without_the_token_is_refused_in_one_line(two_dc_cluster, tmp_path):
  c = two_dc_cluster
  # As a user who forgot the token: no RAY_AUTH_MODE, no token file.
  env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
  env["RAY_AUTH_TOKEN_PATH"] = str(tmp_path / "no_token")
  res = _main(str(tmp_path / "w"), {"pipeline.mode": "sync", "cluster.address": c.address}, env)
  assert res.returncode == 2, res.stderr[-2000:]
  err = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
  assert len(err) == 1 and "token" in err[0], res.stderr[-2000:]


def test_sync_run_across_nodes_and_datacenters(two_dc_cluster, tmp_path):
  c = two_dc_cluster
  workdir = str(tmp_path / "run")
  overrides = {
      **TINY,
      "trainer.num_iterations": 3,
      "pipeline.mode": "sync",
      "cluster.address": c.address,
      "engine.num_instances": 2,
      # Placed by node labels as well as by pool.
      "cluster.generation_labels": "datacenter=dc1,pool=generation",
      "cluster.training_labels": "datacenter=dc0",
      "transfer.enabled": True,
      # Beyond loopback: every receiver checks the run's secret.
      "transfer.bind": "0.0.0.0",
      "transfer.delta_cross_dc": True,
      "transfer.cross_dc_bytes_per_s": 200e6,
  }
  res = _main(
      workdir,
      {k: json.dumps(v) if isinstance(v, bool) else v for k, v in overrides.items()},
      c.env(),
  )
  assert res.returncode == 0, res.stderr[-3000:]
  with open(os.path.join(workdir, "placement.json")) as f:
    placement = json.load(f)
  trainer, gens = placement["trainer"], placement["generators"]
  nodes = {n["NodeID"]: n["Labels"] for n in _nodes(c)}
  # The trainer on the training node (dc0), both generators on the generation node (dc1).
  assert nodes[trainer["node_id"]]["pool"] == "training" and trainer["datacenter"] == "dc0"
  assert len(gens) == 2
  for g in gens.values():
    assert nodes[g["node_id"]]["pool"] == "generation" and g["datacenter"] == "dc1"
  rows = _metrics(workdir)
  assert len(rows) == 3
  for r in rows:
    # Every request's sample arrived once, generated with the weights of its iteration (sync).
    assert r["samples/count"] == TINY["trainer.prompts_per_iteration"]
    assert r["samples/duplicated"] == 0
    assert r["staleness/max"] == 0
  # Each version crossed the dc0 -> dc1 edge once (to the relay, which served
  # the other dc1 generator), through the emulated link.
  last = rows[-1]
  assert last["transfer/cross_dc_streams_total"] == 3
  assert last["transfer/local_streams_total"] == 0
  assert last["transfer/cross_dc_bytes_total"] > 0


def _nodes(c):
  """The cluster's nodes as Ray reports them (asked from a subprocess, which
  joins with the cluster's token)."""
  code = (
      "import json, ray; ray.init(address=%r, log_to_driver=False); print(json.dumps(ray.nodes()))"
  )
  res = subprocess.run(
      [sys.executable, "-c", code % c.address],
      env={**os.environ, **c.env()},
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert res.returncode == 0, res.stderr[-2000:]
  return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_training_node_holds_a_slot_and_its_cpus_per_trainer_process():
  from streamrl import cluster as cluster_lib

  _, trainer, _ = local_cluster.default_nodes(trainer_cpus=1, training_slots=2)
  assert trainer.cpus == 2 and trainer.resources == {cluster_lib.TRAINING_POOL: 2}
  _, trainer, _ = local_cluster.default_nodes()
  assert trainer.cpus == 1 and trainer.resources == {cluster_lib.TRAINING_POOL: 1}
