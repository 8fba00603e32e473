"""Plans as runs: `launch/plan.py --emit` writes a plan file, `launch/main.py --plan` applies it.

  python launch/plan.py --config=configs/plan/qwen7b_single_dc.py --emit=plan.json
  python launch/main.py --config=configs/ppo.py --plan=plan.json --workdir=W

A plan file is JSON with two parts:

  {"plan":      what the planner chose, for people (and W/plan.json):
                model, pools, GPUs and GPU types of each side, datacenters,
                cross_dc, mode, predicted samples/s, instances and their
                tensor-parallel size, the trainer's processes and mesh, the
                long-tail split, the weight-transfer topology, which cost
                models it came from, and for a CPU stand-in what was scaled;
   "overrides": {"pipeline.mode": "async", "engine.num_instances": 16, ...}}

`overrides` are ordinary StreamRL config keys (streamrl/config/settings.py) with
their values; launch/main.py applies them onto the run config before the
command line's --config.* overrides, so the command line wins. The mapping
(target "gpu"):

  pipeline.mode                      the mode the simulator predicts fastest
  engine.num_instances           generation GPUs / tensor-parallel size
  engine.gpus_per_instance,      the planner's tensor-parallel size
    engine.tensor_parallel_size
  cluster.trainer_gpus               training GPUs
  cluster.trainer_processes          one per machine (GPUs per machine of the
                                     pool's GPU type; the smallest count that
                                     divides the GPUs evenly)
  mesh.data / fsdp / tensor          FSDP over the fewest GPUs (at least one
                                     process's) whose share of the training
                                     state (actor + critic + reference) fits in
                                     half a GPU's memory, data-parallel over
                                     the rest; no tensor parallelism
  cluster.generation_labels,         "datacenter=<pool's DC>,accelerator=<GPU>":
    cluster.training_labels          the Ray node labels our launcher sets
  scheduler.kind,              "skew" (ranker + Algorithm 2) with the
    scheduler.long_tail_alpha       long-tail fraction the planner simulated
  transfer.enabled, .topology,       the checkpoint-transfer service as the
    .fanout, .delta_cross_dc         planner models it: broadcast tree (fanout
                                     2), relay and deltas across datacenters

Target "cpu" is a stand-in of the same plan for one machine without GPUs:
CPU engines (gpus_per_instance 0, tensor_parallel_size 1), a CPU trainer
(trainer_gpus 0, one process, mesh fsdp=-1), at most `max_instances`
generator instances (at least one), no node labels; the mode, scheduler and
transfer settings stay. Its "plan" part still describes the GPU plan and
says what was scaled ("cpu_stand_in").
"""

from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any, Mapping, Sequence

from streamrl.errors import MissingFileError, UserError

FORMAT = "streamrl.plan/1"
TARGETS = ("gpu", "cpu")
# The planner's broadcast model (costs.broadcast_seconds) is a binary tree.
TRANSFER_FANOUT = 2
# Training state (ZeRO-sharded) may take this much of a GPU's memory; the
# rest is for activations.
STATE_FRACTION = 0.5


# ------------------------------------------------------------------ emitting


def trainer_processes(num_gpus: int, gpus_per_machine: int) -> int:
  """One trainer process per machine: the smallest count >= the machines
  `num_gpus` fill that splits them evenly."""
  p = max(1, math.ceil(num_gpus / max(1, gpus_per_machine)))
  while num_gpus % p:
    p += 1
  return p


def trainer_mesh(model, gpu, num_gpus: int, processes: int, *, critic: bool = True) -> dict:
  """{data, fsdp, tensor} for `num_gpus` trainer GPUs of type `gpu` (see the module doc)."""
  from streamrl.sim import costs  # pylint: disable=g-import-not-at-top

  fsdp = num_gpus
  for d in range(num_gpus // processes, num_gpus + 1):
    if num_gpus % d == 0:
      state = costs.colocated_state_bytes_per_gpu(model, d, critic=critic)
      if state <= STATE_FRACTION * gpu.hbm_bytes:
        fsdp = d
        break
  return {"data": num_gpus // fsdp, "fsdp": fsdp, "tensor": 1}


def _labels(datacenter: str, gpu: str) -> str:
  return f"datacenter={datacenter},accelerator={gpu}"


def build_plan(report, *, target: str = "gpu", max_instances: int = 2, source: str = "") -> dict:
  """The plan file's dict for a `streamrl.planner.run.PlanReport`.

  Raises:
    UserError: an unknown target or max_instances < 1.
  """
  from streamrl.sim import hardware  # pylint: disable=g-import-not-at-top

  if target not in TARGETS:
    raise UserError(f"--emit_target={target!r} is unknown; use one of {TARGETS}.")
  if max_instances < 1:
    raise UserError(f"--max_instances={max_instances} must be >= 1 (one generator at least).")
  b, w = report.result.best, report.workload
  gen_pool, train_pool = report.pool(b.gen_pool), report.pool(b.train_pool)
  gen_spec, train_spec = hardware.get_gpu(b.gen_gpu), hardware.get_gpu(b.train_gpu)
  tp = report.tp
  instances = b.gen_gpus // tp
  processes = trainer_processes(b.train_gpus, train_spec.gpus_per_machine)
  mesh = trainer_mesh(w.model, train_spec, b.train_gpus, processes, critic=w.calib.critic)
  gen_nodes = math.ceil(b.gen_gpus / gen_spec.gpus_per_machine)
  overrides = {
      "pipeline.mode": report.mode,
      "engine.num_instances": instances,
      "engine.gpus_per_instance": tp,
      "engine.tensor_parallel_size": tp,
      "cluster.trainer_gpus": b.train_gpus,
      "cluster.trainer_processes": processes,
      "mesh.data": mesh["data"],
      "mesh.fsdp": mesh["fsdp"],
      "mesh.tensor": mesh["tensor"],
      "cluster.generation_labels": _labels(gen_pool.datacenter, b.gen_gpu),
      "cluster.training_labels": _labels(train_pool.datacenter, b.train_gpu),
      "scheduler.kind": "skew",
      "scheduler.long_tail_alpha": float(report.long_tail["alpha"]),
      "transfer.enabled": True,
      "transfer.topology": "tree",
      "transfer.fanout": TRANSFER_FANOUT,
      "transfer.delta_cross_dc": bool(b.cross_dc),
  }
  plan = {
      "format": FORMAT,
      "target": target,
      "source": source,
      "model": w.model.name,
      "objective": report.result.objective,
      "batch_size": w.batch_size,
      "cost_model": report.cost_model,
      "mode": report.mode,
      "predicted_samples_per_s": {m: round(v, 4) for m, v in report.predicted.items()},
      "generation": {
          "pool": b.gen_pool,
          "datacenter": gen_pool.datacenter,
          "gpu": b.gen_gpu,
          "gpus": b.gen_gpus,
          "instances": instances,
          "tensor_parallel_size": tp,
          "stage_s": round(b.t_gen, 3),
      },
      "training": {
          "pool": b.train_pool,
          "datacenter": train_pool.datacenter,
          "gpu": b.train_gpu,
          "gpus": b.train_gpus,
          "processes": processes,
          "mesh": mesh,
          "stage_s": round(b.t_train, 3),
      },
      "datacenters": sorted({gen_pool.datacenter, train_pool.datacenter}),
      "cross_dc": bool(b.cross_dc),
      "long_tail": {"scheduler": "skew", **report.long_tail},
      "transfer": {
          "topology": "tree",
          "fanout": TRANSFER_FANOUT,
          "generator_nodes": gen_nodes,
          "cross_dc_relay": bool(b.cross_dc),
          "delta_cross_dc": bool(b.cross_dc),
          "predicted_s": round(b.transfer_s, 4),
      },
  }
  if target == "cpu":
    cpu = {
        "engine.num_instances": max(1, min(max_instances, instances)),
        "engine.gpus_per_instance": 0,
        "engine.tensor_parallel_size": 1,
        "cluster.trainer_gpus": 0,
        "cluster.trainer_processes": 1,
        "mesh.data": 1,
        "mesh.fsdp": -1,
        "mesh.tensor": 1,
        "cluster.generation_labels": "",
        "cluster.training_labels": "",
    }
    plan["cpu_stand_in"] = {
        "max_instances": max_instances,
        "scaled": {k: {"plan": overrides[k], "emitted": v} for k, v in cpu.items()},
    }
    overrides.update(cpu)
  check_overrides(overrides)
  return {"plan": plan, "overrides": overrides}


def check_overrides(overrides: Mapping[str, Any], base=None) -> None:
  """Applies `overrides` onto `base` (default: every setting at its default)
  and validates the result as a run would (files not checked).

  Raises:
    UserError: an unknown key, a wrong type, or a value the settings refuse.
  """
  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top
  from streamrl.config import settings  # pylint: disable=g-import-not-at-top

  config = settings.default_config() if base is None else base
  settings.from_config(config_lib.apply_overrides(config, dict(overrides)), check_files=False)


def write_plan(plan: Mapping[str, Any], path: str) -> None:
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise UserError(f"--emit={path} is a directory; name the plan file, e.g. {path}/plan.json.")
  os.makedirs(parent, exist_ok=True)
  with open(path, "w") as f:
    json.dump(plan, f, indent=1)
    f.write("\n")


def summary(plan: Mapping[str, Any]) -> str:
  """One line on an emitted plan."""
  p, o = plan["plan"], plan["overrides"]
  g, t = p["generation"], p["training"]
  planned = (
      f"gen {g['instances']} x TP{g['tensor_parallel_size']} on {g['gpus']} x {g['gpu']} "
      f"({g['datacenter']}) + train {t['gpus']} x {t['gpu']} ({t['datacenter']}) in "
      f"{t['processes']} process(es), mesh data={t['mesh']['data']} fsdp={t['mesh']['fsdp']} "
      f"tensor={t['mesh']['tensor']}"
  )
  if p["target"] == "cpu":
    return (
        f"plan: {p['mode']}, CPU stand-in: {o['engine.num_instances']} CPU generator "
        f"instance(s) + a CPU trainer (planned: {planned})"
    )
  return f"plan: {p['mode']}, {planned}"


# ------------------------------------------------------------------ applying


def _fix(path: str, what: str = "emit the plan again") -> str:
  return f"{what} with python launch/plan.py --config=configs/plan/<name>.py --emit={path}"


def load_plan(path: str) -> dict:
  """A plan file, checked for shape.

  Raises:
    MissingFileError: no such file.
    UserError: not JSON, or no "overrides" object of dotted keys.
  """
  if os.path.isdir(path):
    raise UserError(
        f"--plan={path} is a directory; point it at the file written by python "
        "launch/plan.py --config=configs/plan/<name>.py --emit=plan.json."
    )
  if not os.path.isfile(path):
    raise MissingFileError(f"--plan={path} does not exist; {_fix(path, 'write one')}.")
  with open(path) as f:
    try:
      plan = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise UserError(f"--plan={path} is not valid JSON ({e}); {_fix(path)}.") from None
  if not isinstance(plan, dict) or not isinstance(plan.get("overrides"), dict):
    raise UserError(
        f'--plan={path} has no "overrides" object (a plan file is {{"plan": ..., '
        f'"overrides": {{"key": value, ...}}}}); {_fix(path)}.'
    )
  if "plan" in plan and not isinstance(plan["plan"], dict):
    raise UserError(f'--plan={path}: its "plan" part must be an object; {_fix(path)}.')
  return plan


def _keys(node, prefix: str = "") -> list[str]:
  out = []
  for k in node.keys():
    out.append(prefix + k)
    if hasattr(node[k], "keys"):
      out += _keys(node[k], prefix + k + ".")
  return out


def _has_key(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False
    node = node[part]
  return not hasattr(node, "keys")  # a setting, not a group of them


def apply_plan(
    config,
    plan: Mapping[str, Any],
    cli_overrides: Mapping[str, Any] | Sequence[str] = (),
    *,
    path: str = "plan.json",
):
  """`config` with the plan's overrides, then `cli_overrides` again on top
  (the command line's --config.* values: they win over the plan).

  Raises:
    UserError: one sentence naming the plan key that is not a setting, or
      whose value has the wrong type.
  """
  from streamrl import config as config_lib  # pylint: disable=g-import-not-at-top

  overrides = dict(plan["overrides"])
  for key in overrides:
    if not _has_key(config, key):
      close = difflib.get_close_matches(key, _keys(config), n=1, cutoff=0.6)
      hint = f" (did you mean {close[0]}?)" if close else ""
      raise UserError(
          f"--plan={path} sets {key!r}, which is not a StreamRL setting{hint}; remove it from "
          f'the plan\'s "overrides" or {_fix(path)}.'
      )
  try:
    merged = config_lib.apply_overrides(config, overrides)
  except UserError as e:
    raise UserError(
        f"--plan={path}: {str(e).rstrip('.')}; fix that value in the plan's \"overrides\" or "
        f"{_fix(path)}."
    ) from None
  return config_lib.apply_overrides(merged, cli_overrides)
