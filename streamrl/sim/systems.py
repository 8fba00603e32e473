"""The systems compared in the paper, as simulator configurations.

  verl            colocated, random FIFO, verl's eager-mode decode overhead
  colocation      colocated, random FIFO (the paper's colocation baseline)
  colocation_skew colocated + skewness-aware scheduling (Table 3, row 2)
  streamrl_sync   disaggregated + streaming + skewness-aware ("stream" mode)
  streamrl_async  the same, one-step asynchronous ("async" mode)
  disagg_sync     disaggregated, no streaming ("sync" mode)

Every knob that is not a hardware spec or a model shape lives in
`SystemCalibration`, with its source.
"""

from __future__ import annotations

import dataclasses

from streamrl.sim import costs, hardware
from streamrl.sim.config import SimConfig
from streamrl.sim.costs import GenCalibration, GenCostModel, TrainCostModel
from streamrl.sim.hardware import GpuSpec, ModelSpec

SYSTEMS = (
    "verl",
    "colocation",
    "colocation_skew",
    "streamrl_sync",
    "streamrl_async",
    "disagg_sync",
)
_DISAGG_MODE = {"streamrl_sync": "stream", "streamrl_async": "async", "disagg_sync": "sync"}


@dataclasses.dataclass(frozen=True)
class SystemCalibration:
  """Knobs shared by all cells of an experiment.

  Attributes:
    gen: decode model constants (fitted on the paper's Fig. 7).
    mfu: training model-FLOPs utilisation (fitted on the 7B cells).
    offload_gb_s: colocation's one parameter: effective host<->device
      bandwidth of the per-iteration stage switch (fitted on the 7B cells).
    verl_step_overhead_s: verl's one parameter: host time added to every
      decode step by its rollout engine (fitted on the 7B cells).
    ranker_sigma: simulated ranker noise (from the paper's Table 4 recall).
    num_minibatches: PPO mini-batches per iteration (verl's default 1024/256).
    dispatch_objective: Algorithm 2 objective ("makespan" is the project
      dispatcher's default; the paper prints "sum").
    dispatch_latency_model: Algorithm 2's latency estimate ("paper" formula
      or "simulate": continuous batching replayed per instance).
    reserve_max_output: engine admission policy. False: vLLM (admit on the
      prompt, preempt when the KV cache fills). True: every sequence reserves
      KV for the maximum output length when admitted (no preemption ever),
      which caps the sequences in flight at capacity / (prompt + max_output).
  """

  gen: GenCalibration
  mfu: float = 0.35
  offload_gb_s: float | None = None
  verl_step_overhead_s: float = 0.0
  ranker_sigma: float = 0.0
  num_minibatches: int = 4
  dispatch_objective: str = "makespan"
  critic: bool = True
  dispatch_latency_model: str = "paper"
  reserve_max_output: bool = False


def max_output_of(lengths) -> int:
  """Largest output length a distribution (or a per-iteration tuple of them) can produce."""
  if isinstance(lengths, (tuple, list)):
    return max(int(d.max_output) for d in lengths)
  return int(lengths.max_output)


def gen_cost(
    model: ModelSpec,
    gpu: GpuSpec,
    calib: SystemCalibration,
    lengths,
    *,
    tp: int | None = None,
    reserved_bytes_per_gpu: float = 0.0,
) -> GenCostModel:
  """One generator instance under `calib` (decode model and admission policy) for `lengths`."""
  gen = GenCostModel.for_deployment(
      model, gpu, calib.gen, tp=tp, reserved_bytes_per_gpu=reserved_bytes_per_gpu
  )
  if calib.reserve_max_output:
    gen = dataclasses.replace(gen, reserve_output_tokens=float(max_output_of(lengths)))
  return gen


def colocated_config(
    model: ModelSpec,
    gpu: GpuSpec,
    num_gpus: int,
    lengths,
    calib: SystemCalibration,
    *,
    scheduler: str = "fifo",
    verl: bool = False,
    tp: int | None = None,
    batch_size: int = 1024,
    iterations: int = 4,
    seed: int = 0,
) -> SimConfig:
  """All `num_gpus` GPUs generate, then all train (the colocated baselines)."""
  tp = hardware.default_tp(model, gpu) if tp is None else tp
  gcal = calib.gen
  if verl:
    gcal = dataclasses.replace(gcal, extra_step_s=calib.verl_step_overhead_s)
  # With offloading the rollout has the whole GPU; without it the training
  # state stays resident and shrinks the KV cache.
  reserved = (
      0.0
      if calib.offload_gb_s
      else costs.colocated_state_bytes_per_gpu(model, num_gpus, critic=calib.critic)
  )
  gen = gen_cost(
      model,
      gpu,
      dataclasses.replace(calib, gen=gcal),
      lengths,
      tp=tp,
      reserved_bytes_per_gpu=reserved,
  )
  train = TrainCostModel.for_gpu(model, gpu, calib.mfu, critic=calib.critic)
  switch = costs.colocated_switch_seconds(
      model, gpu, tp, num_gpus, offload_gb_s=calib.offload_gb_s, critic=calib.critic
  )
  return SimConfig(
      mode="verl" if verl else "colocated",
      gen=gen,
      num_instances=max(1, num_gpus // tp),
      train=train,
      trainer_gpus=num_gpus,
      lengths=lengths,
      samples_per_iteration=batch_size,
      num_iterations=iterations,
      mini_batch_size=-(-batch_size // calib.num_minibatches),
      scheduler=scheduler,
      ranker_sigma=calib.ranker_sigma,
      objective=calib.dispatch_objective,
      latency_model=calib.dispatch_latency_model,
      transfer_s=switch,
      seed=seed,
  )


def disaggregated_config(
    mode: str,
    model: ModelSpec,
    gen_gpu: GpuSpec,
    gen_gpus: int,
    train_gpu: GpuSpec,
    train_gpus: int,
    lengths,
    calib: SystemCalibration,
    *,
    cross_dc: bool = False,
    scheduler: str = "skew",
    tp: int | None = None,
    batch_size: int = 1024,
    iterations: int = 4,
    seed: int = 0,
) -> SimConfig:
  """Generation on `gen_gpus` of `gen_gpu`, training on `train_gpus` of `train_gpu`."""
  tp = hardware.default_tp(model, gen_gpu) if tp is None else tp
  if gen_gpus < tp:
    raise ValueError(f"{gen_gpus} generation GPUs cannot hold one {model.name} instance of TP{tp}.")
  gen = gen_cost(model, gen_gpu, calib, lengths, tp=tp)
  train = TrainCostModel.for_gpu(model, train_gpu, calib.mfu, critic=calib.critic)
  transfer = costs.weight_transfer_seconds(
      model,
      gen_gpus,
      gen_gpu.gpus_per_machine,
      inter_dc_link=hardware.INTER_DC_LINK if cross_dc else None,
  )
  return SimConfig(
      mode=mode,
      gen=gen,
      num_instances=gen_gpus // tp,
      train=train,
      trainer_gpus=train_gpus,
      lengths=lengths,
      samples_per_iteration=batch_size,
      num_iterations=iterations,
      mini_batch_size=-(-batch_size // calib.num_minibatches),
      scheduler=scheduler,
      ranker_sigma=calib.ranker_sigma,
      objective=calib.dispatch_objective,
      latency_model=calib.dispatch_latency_model,
      transfer_s=transfer,
      seed=seed,
  )


def system_config(
    system: str,
    model: ModelSpec,
    gpu: GpuSpec,
    num_gpus: int,
    lengths,
    calib: SystemCalibration,
    *,
    gen_gpus: int | None = None,
    **kw,
) -> SimConfig:
  """One of SYSTEMS on `num_gpus` GPUs of one type (gen_gpus: disaggregated split)."""
  if system not in SYSTEMS:
    raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}.")
  if system in ("verl", "colocation", "colocation_skew"):
    return colocated_config(
        model,
        gpu,
        num_gpus,
        lengths,
        calib,
        verl=system == "verl",
        scheduler="skew" if system == "colocation_skew" else "fifo",
        **kw,
    )
  if gen_gpus is None or not 0 < gen_gpus < num_gpus:
    raise ValueError(f"{system} needs a split: 0 < gen_gpus < {num_gpus} (use the planner).")
  return disaggregated_config(
      _DISAGG_MODE[system], model, gpu, gen_gpus, gpu, num_gpus - gen_gpus, lengths, calib, **kw
  )
