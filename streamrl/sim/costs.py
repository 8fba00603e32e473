"""Cost models of the simulator: generation, training, weight transfer, in seconds.

Everything here is a small, explicit physical model over the specs of
hardware.py; every other constant is a value fitted from the paper's PTL
curve (Fig. 7) with the assumption named next to it.

Generation (decode) cost of one instance running B sequences whose contexts
sum to S tokens, per decode step (all sequences advance one token):

    step(B, S) = a + b * B + c * S
    a = L * o * (1 + tp_comm)  +  W / (TP * BW * eps_m)      # launch + weight read
    b = 2 * N_c / (TP * F * eta_c)                            # per-sequence GEMM work
    c = kv_bytes_per_token / (TP * BW * eps_m)                # KV-cache read

L layers, W weight bytes, N_c compute parameters, F peak bf16 FLOP/s per GPU,
BW HBM bandwidth per GPU. Decode is memory-bandwidth bound at small B (the `a`
term) and grows with batch and context (the `b` and `c` terms). The constants o
(per-layer step overhead: kernel launches, scheduling) and eta_c (GEMM
efficiency in decode) are fitted to the paper's 7B/H800 curve under two stated
assumptions (eps_m = 0.8 of peak HBM bandwidth is reachable; the curve was
measured at about 1K tokens of context per sequence); see
`calibrate_from_ptl_curve` (experiments/RESULTS.md has how close the fit is).

Training cost: FLOPs / (GPUs * F * MFU) with 2 * N FLOPs per token for a
forward-only pass and 6 * N for forward + backward, plus causal attention
(2 * L * d_attn * T^2 per sequence of T tokens per forward).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from streamrl.scheduling import LatencyProfile
from streamrl.sim.hardware import (
    CLOUD_NODE_LINK,
    GPUS,
    MAIN_NODE_LINK,
    MODELS,
    GpuSpec,
    LinkSpec,
    ModelSpec,
    default_tp,
)

# ---------------------------------------------------------------------------
# Generation.


@dataclasses.dataclass(frozen=True)
class GenCalibration:
  """Constants of the decode model that do not come from a spec sheet.

  Attributes:
    layer_overhead_s: per-layer, per-decode-step fixed cost (kernel launch,
      scheduling), seconds. Fitted from Fig. 7 (see calibrate_from_ptl_curve).
    decode_compute_eff: fraction of peak FLOP/s reached by decode GEMMs; also
      used for prefill. Fitted from Fig. 7.
    mem_bw_eff: reachable fraction of peak HBM bandwidth (assumed 0.8).
    tp_allreduce_s: latency of one tensor-parallel all-reduce (2 per layer per
      step), seconds (assumed 15 us over NVLink).
    gpu_mem_util: fraction of HBM the engine may use (vLLM default 0.9).
    max_num_seqs: engine cap on sequences in flight (vLLM default 256).
    extra_step_s: host-side time added to every decode step (scheduling,
      sampling, Python) by a less optimised engine; 0 for ours, the verl
      baseline's one efficiency knob.
  """

  layer_overhead_s: float
  decode_compute_eff: float
  mem_bw_eff: float = 0.8
  tp_allreduce_s: float = 15e-6
  gpu_mem_util: float = 0.9
  max_num_seqs: int = 256
  extra_step_s: float = 0.0


def calibrate_from_ptl_curve(
    profile: LatencyProfile,
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    tp: int = 1,
    context_tokens: float = 1024.0,
    mem_bw_eff: float = 0.8,
) -> GenCalibration:
  """Fits (layer_overhead_s, decode_compute_eff) to a measured PTL(BS) curve.

  Fits PTL(B) = a + b * B by least squares in relative error, then splits
    a = L * o + W / (TP * BW * mem_bw_eff)          -> o
    b = 2 N_c / (TP * F * eta) + ctx * kv / (TP * BW * mem_bw_eff)   -> eta
  with `context_tokens` the (assumed) context per sequence during profiling.
  """
  bs = np.asarray(profile.batch_sizes, dtype=np.float64)
  y = np.asarray(profile.ptl_s, dtype=np.float64)
  if bs.size < 2:
    raise ValueError("calibration needs a PTL curve with at least two batch sizes.")
  w = 1.0 / y
  design = np.stack([np.ones_like(bs), bs], axis=1) * w[:, None]
  (a, b), *_ = np.linalg.lstsq(design, y * w, rcond=None)
  bw = tp * gpu.hbm_bytes_s * mem_bw_eff
  weight_s = model.weight_bytes / bw
  comm = 2 * model.num_layers * 15e-6 if tp > 1 else 0.0
  o = (a - weight_s - comm) / model.num_layers
  kv_s = context_tokens * model.kv_bytes_per_token / bw
  compute_s = b - kv_s
  if o <= 0 or compute_s <= 0:
    raise ValueError(
        "the PTL curve is faster than the memory-bandwidth bound of this model and "
        "GPU; check that profile, model and GPU match."
    )
  eta = 2.0 * model.compute_params / (tp * gpu.flops * compute_s)
  return GenCalibration(
      layer_overhead_s=float(o), decode_compute_eff=float(eta), mem_bw_eff=mem_bw_eff
  )


@dataclasses.dataclass(frozen=True)
class GenCostModel:
  """Cost of one generator instance (TP GPUs running one engine).

  step_time(B, S) = step_fixed_s + per_seq_s * B + per_ctx_token_s * S.

  Attributes:
    step_fixed_s: a (s per decode step).
    per_seq_s: b (s per sequence per step).
    per_ctx_token_s: c (s per context token in the batch per step).
    prefill_s_per_token: s per prompt token prefilled.
    kv_capacity_tokens: KV-cache capacity of the instance, tokens.
    max_num_seqs: cap on sequences in flight.
    reserve_output_tokens: admission policy. 0 (vLLM): a sequence is admitted
      when its prompt fits in the free KV cache; when the cache fills up the
      newest sequence is preempted and recomputed later. > 0 (reserving
      engines, e.g. TensorRT-LLM's guaranteed-no-evict scheduler): a sequence
      is admitted only if its prompt plus this many output tokens fit next to
      the reservations of the sequences already running, so nothing is ever
      preempted but fewer sequences run at once (with the maximum output
      length reserved, at most capacity / (prompt + max_output) of them).
    gpus: GPUs per instance (TP).
    gpu: GPU type name (for costs); "" for measured models.
    name: label.
  """

  step_fixed_s: float
  per_seq_s: float
  per_ctx_token_s: float
  prefill_s_per_token: float
  kv_capacity_tokens: float
  max_num_seqs: int = 256
  gpus: int = 1
  gpu: str = ""
  name: str = ""
  reserve_output_tokens: float = 0.0

  def __post_init__(self):
    if not (self.reserve_output_tokens >= 0 and math.isfinite(self.reserve_output_tokens)):
      raise ValueError(
          f"reserve_output_tokens must be a finite number >= 0, got {self.reserve_output_tokens}."
      )
    if not (
        self.step_fixed_s > 0
        and self.per_seq_s >= 0
        and self.per_ctx_token_s >= 0
        and self.prefill_s_per_token >= 0
    ):
      raise ValueError("generation cost terms must be >= 0 (and the fixed step cost > 0).")
    if not self.kv_capacity_tokens > 0:
      raise ValueError(
          f"{self.name or 'instance'}: the weights leave no memory for the KV cache; "
          "use a larger tensor-parallel degree."
      )

  def max_concurrent(self, prompt_tokens: float) -> int:
    """Sequences of `prompt_tokens` that can run at once (engine cap and KV reservations)."""
    if self.reserve_output_tokens <= 0:
      return self.max_num_seqs
    fit = int(self.kv_capacity_tokens // (prompt_tokens + 1 + self.reserve_output_tokens))
    return max(1, min(self.max_num_seqs, fit))

  def step_time(self, batch: float, context_sum: float) -> float:
    return self.step_fixed_s + self.per_seq_s * batch + self.per_ctx_token_s * context_sum

  def decode_time(self, batch: int, context_sum: float, steps: int) -> float:
    """Seconds for `steps` decode steps with constant batch (context grows by batch per step)."""
    n = steps
    return (
        n * (self.step_fixed_s + self.per_seq_s * batch + self.per_ctx_token_s * context_sum)
        + self.per_ctx_token_s * batch * n * (n - 1) / 2.0
    )

  def latency_profile(
      self,
      context_tokens: float,
      batch_sizes: Sequence[int] = (1, 8, 16, 32, 64, 128, 256, 512),
      *,
      growing_context: bool = False,
  ) -> LatencyProfile:
    """PTL(BS) at a fixed per-sequence context, for the Algorithm 2 dispatcher.

    `growing_context`: the profile also carries the cost per context token
    (`context_s_per_token`), for a replay that adds the tokens generated so
    far itself; `context_tokens` is then the prompt alone.
    """
    ptl = tuple(self.step_time(b, b * context_tokens) for b in batch_sizes)
    return LatencyProfile(
        batch_sizes=tuple(batch_sizes),
        ptl_s=ptl,
        prefill_s_per_token=self.prefill_s_per_token,
        name=self.name,
        context_s_per_token=self.per_ctx_token_s if growing_context else 0.0,
    )

  @classmethod
  def for_deployment(
      cls,
      model: ModelSpec,
      gpu: GpuSpec,
      calib: GenCalibration,
      *,
      tp: int | None = None,
      reserved_bytes_per_gpu: float = 0.0,
  ) -> "GenCostModel":
    """Scales the calibrated decode model to `model` on `gpu` with `tp` GPUs.

    reserved_bytes_per_gpu: memory held by something else during generation
    (colocated training state), which shrinks the KV cache.
    """
    tp = default_tp(model, gpu) if tp is None else int(tp)
    if tp < 1:
      raise ValueError(f"tensor-parallel degree must be >= 1, got {tp}.")
    bw = tp * gpu.hbm_bytes_s * calib.mem_bw_eff
    comm = 2 * model.num_layers * calib.tp_allreduce_s if tp > 1 else 0.0
    a = (
        model.num_layers * calib.layer_overhead_s
        + calib.extra_step_s
        + comm
        + model.weight_bytes / bw
    )
    b = 2.0 * model.compute_params / (tp * gpu.flops * calib.decode_compute_eff)
    c = model.kv_bytes_per_token / bw
    kv_bytes = (
        tp * (gpu.hbm_bytes * calib.gpu_mem_util - reserved_bytes_per_gpu) - model.weight_bytes
    )
    return cls(
        step_fixed_s=a,
        per_seq_s=b,
        per_ctx_token_s=c,
        prefill_s_per_token=b,
        kv_capacity_tokens=kv_bytes / model.kv_bytes_per_token,
        max_num_seqs=calib.max_num_seqs,
        gpus=tp,
        gpu=gpu.name,
        name=f"{model.name}/{gpu.name}/tp{tp}",
    )

  @classmethod
  def from_profile(
      cls,
      profile: LatencyProfile,
      *,
      kv_capacity_tokens: float = math.inf,
      max_num_seqs: int = 256,
      gpus: int = 1,
      per_ctx_token_s: float = 0.0,
      context_tokens: float = 0.0,
      name: str = "",
  ) -> "GenCostModel":
    """Fits step_time = a + b * B to a measured LatencyProfile (the `from_measured` path).

    If `per_ctx_token_s` is known, the measured points (taken at
    `context_tokens` per sequence) are first corrected for the KV term.
    """
    bs = np.asarray(profile.batch_sizes, dtype=np.float64)
    y = np.asarray(profile.ptl_s, dtype=np.float64) - per_ctx_token_s * bs * context_tokens
    if bs.size == 1:
      a, b = float(y[0]), 0.0
    else:
      w = 1.0 / np.maximum(y, 1e-12)
      design = np.stack([np.ones_like(bs), bs], axis=1) * w[:, None]
      (a, b), *_ = np.linalg.lstsq(design, y * w, rcond=None)
      if b < 0:  # A noisy, flat profile: keep the mean as a constant cost.
        a, b = float(np.mean(y)), 0.0
    return cls(
        step_fixed_s=float(a),
        per_seq_s=float(max(b, 0.0)),
        per_ctx_token_s=per_ctx_token_s,
        prefill_s_per_token=profile.prefill_s_per_token,
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=max_num_seqs,
        gpus=gpus,
        name=name or profile.name,
    )


def paper_calibration() -> GenCalibration:
  """Calibration fitted on the paper's Fig. 7 curve (Qwen2.5-7B, one H800)."""
  return calibrate_from_ptl_curve(LatencyProfile.from_paper(), MODELS["qwen2.5-7b"], GPUS["H800"])


# ---------------------------------------------------------------------------
# Training.


@dataclasses.dataclass(frozen=True)
class TrainCostModel:
  """Trainer time from FLOPs (or from measured seconds per token).

  Per sequence of T tokens (prompt + output):
    forward work (on arrival)    = fwd_passes * model.forward_flops(T)
    update work (per mini-batch) = update_passes * 3 * model.forward_flops(T)
  seconds = flops / (num_gpus * flops_per_s_per_gpu), plus a fixed
  fwd_overhead_s / update_overhead_s per unit of work the trainer starts.

  Defaults are PPO with actor, critic and reference of the same size:
  forward-only passes = reference logprobs, old logprobs, values (3 x 2N);
  updates = actor and critic (2 x 6N).

  Measured trainers (`from_measured`) set fwd_s_per_token / upd_s_per_token:
  seconds per token on one "GPU" (the whole measured trainer), replacing FLOPs.
  """

  model: ModelSpec | None
  flops_per_s_per_gpu: float = 1.0
  fwd_passes: int = 3
  update_passes: int = 2
  fwd_overhead_s: float = 0.0
  update_overhead_s: float = 0.0
  fwd_s_per_token: float | None = None
  upd_s_per_token: float | None = None
  name: str = ""

  def __post_init__(self):
    if self.model is None and (self.fwd_s_per_token is None or self.upd_s_per_token is None):
      raise ValueError(
          "a TrainCostModel needs a model shape (FLOPs) or measured seconds per token."
      )

  def forward_seconds(self, tokens: np.ndarray) -> np.ndarray:
    """[n] one-GPU seconds of per-sample forward-only work (divide by GPUs)."""
    t = np.asarray(tokens, dtype=np.float64)
    if self.fwd_s_per_token is not None:
      return self.fwd_s_per_token * t
    return self.fwd_passes * np.asarray(self.model.forward_flops(t)) / self.flops_per_s_per_gpu

  def update_seconds(self, tokens: np.ndarray) -> np.ndarray:
    """[n] one-GPU seconds of per-sample update work (fwd + bwd = 3 forwards)."""
    t = np.asarray(tokens, dtype=np.float64)
    if self.upd_s_per_token is not None:
      return self.upd_s_per_token * t
    return (
        self.update_passes
        * 3.0
        * np.asarray(self.model.forward_flops(t))
        / self.flops_per_s_per_gpu
    )

  def iteration_seconds(self, tokens: np.ndarray, num_gpus: int, num_minibatches: int = 1) -> float:
    """Time to train on a whole batch on `num_gpus` GPUs (no overlap with generation)."""
    work = float(np.sum(self.forward_seconds(tokens)) + np.sum(self.update_seconds(tokens)))
    return work / num_gpus + self.fwd_overhead_s + self.update_overhead_s * num_minibatches

  @classmethod
  def for_gpu(
      cls, model: ModelSpec, gpu: GpuSpec, mfu: float, *, critic: bool = True
  ) -> "TrainCostModel":
    if not 0 < mfu <= 1:
      raise ValueError(f"MFU must be in (0, 1], got {mfu}.")
    return cls(
        model=model,
        flops_per_s_per_gpu=gpu.flops * mfu,
        fwd_passes=3 if critic else 2,
        update_passes=2 if critic else 1,
        name=f"{model.name}/{gpu.name}/mfu{mfu:.2f}",
    )

  @classmethod
  def from_measured(
      cls,
      *,
      fwd_s_per_token: float,
      upd_s_per_token: float,
      fwd_overhead_s: float = 0.0,
      update_overhead_s: float = 0.0,
      name: str = "measured",
  ) -> "TrainCostModel":
    """From trainer measurements (seconds per token of all forward-only passes / of one update)."""
    for k, v in (("fwd_s_per_token", fwd_s_per_token), ("upd_s_per_token", upd_s_per_token)):
      if not (v >= 0 and math.isfinite(v)):
        raise ValueError(
            f"measured {k} must be a finite number >= 0, got {v}; re-run the trainer profile."
        )
    for k, v in (("fwd_overhead_s", fwd_overhead_s), ("update_overhead_s", update_overhead_s)):
      if not (v >= 0 and math.isfinite(v)):
        raise ValueError(
            f"measured {k} must be a finite number >= 0, got {v}; re-run the trainer profile."
        )
    return cls(
        model=None,
        fwd_s_per_token=float(fwd_s_per_token),
        upd_s_per_token=float(upd_s_per_token),
        fwd_overhead_s=float(fwd_overhead_s),
        update_overhead_s=float(update_overhead_s),
        name=name,
    )


# ---------------------------------------------------------------------------
# Weight transfer.


def broadcast_seconds(nbytes: float, num_receivers: int, link: LinkSpec) -> float:
  """Pipelined (chunked) tree broadcast of `nbytes` to `num_receivers` nodes.

  Bandwidth term once (chunks stream down the tree), latency once per level.
  """
  if num_receivers <= 0:
    return 0.0
  depth = math.ceil(math.log2(num_receivers + 1))
  return nbytes / (link.bandwidth_gb_s * 1e9) + depth * link.latency_s


def weight_transfer_seconds(
    model: ModelSpec,
    num_gen_gpus: int,
    gpus_per_node: int = 8,
    *,
    local_link: LinkSpec = MAIN_NODE_LINK,
    inter_dc_link: LinkSpec | None = None,
    remote_link: LinkSpec = CLOUD_NODE_LINK,
) -> float:
  """Trainer -> all generator GPUs.

  In one DC: the trainer's shards feed several broadcast trees in parallel
  (one per shard), so every generator node receives the full weights once
  over its NIC: one pipelined broadcast of W bytes over node links.
  Across DCs: only the trainer's DP rank 0 sends W bytes over the inter-DC
  link to one remote node, which re-broadcasts inside its DC.
  """
  nodes = max(1, math.ceil(num_gen_gpus / gpus_per_node))
  w = model.weight_bytes
  if inter_dc_link is None:
    return broadcast_seconds(w, nodes, local_link)
  return (
      w / (inter_dc_link.bandwidth_gb_s * 1e9)
      + inter_dc_link.latency_s
      + broadcast_seconds(w, nodes - 1, remote_link)
  )


def colocated_state_bytes_per_gpu(model: ModelSpec, num_gpus: int, *, critic: bool = True) -> float:
  """Training state per GPU of a colocated deployment (ZeRO-sharded over all GPUs).

  Actor and critic: bf16 params + fp32 master + Adam m, v + bf16 grads = 16
  bytes per parameter; reference: bf16 params, 2 bytes.
  """
  per_param = 16 + (16 if critic else 0) + 2
  return per_param * model.num_params / num_gpus


def colocated_switch_seconds(
    model: ModelSpec,
    gpu: GpuSpec,
    tp: int,
    num_gpus: int,
    *,
    offload_gb_s: float | None,
    critic: bool = True,
) -> float:
  """Per-iteration cost of time-multiplexing one set of GPUs between the stages.

  The inference weights are resharded from the training layout over NVLink;
  with `offload_gb_s` set, the training state is also moved off the GPU for
  the rollout and back for training (2 x state bytes per GPU) and the
  inference weights are loaded, at an effective host<->device bandwidth of
  `offload_gb_s` GB/s. The rollout then has the whole GPU for its KV cache.
  """
  reshard = model.weight_bytes / tp / (gpu.nvlink_gb_s * 1e9)
  if offload_gb_s is None:
    return reshard
  if not offload_gb_s > 0:
    raise ValueError(f"offload bandwidth must be > 0 GB/s, got {offload_gb_s}.")
  moved = (
      2 * colocated_state_bytes_per_gpu(model, num_gpus, critic=critic) + model.weight_bytes / tp
  )
  return reshard + moved / (offload_gb_s * 1e9)
