"""What the simulator runs on: GPU types, network links, model shapes.

Every constant is a hardware spec (the paper's Table 1, its network setup) or
a public model shape (Qwen2.5 configs); the cost models (costs.py) turn them
into seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

# ---------------------------------------------------------------------------
# Hardware (paper Table 1) and links.


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """One GPU type.

  Attributes:
    name: e.g. "H800".
    bf16_tflops: dense bf16 peak, TFLOP/s.
    hbm_gb: memory per GPU, GB (1e9 bytes).
    hbm_tb_s: memory bandwidth per GPU, TB/s.
    nvlink_gb_s: intra-node GPU-GPU bandwidth per GPU, GB/s.
    cost_per_machine: relative price of one machine (Table 1: H20 machine = 1).
    gpus_per_machine: GPUs per machine.
  """

  name: str
  bf16_tflops: float
  hbm_gb: float
  hbm_tb_s: float
  nvlink_gb_s: float
  cost_per_machine: float
  gpus_per_machine: int = 8

  @property
  def flops(self) -> float:
    return self.bf16_tflops * 1e12

  @property
  def hbm_bytes(self) -> float:
    return self.hbm_gb * 1e9

  @property
  def hbm_bytes_s(self) -> float:
    return self.hbm_tb_s * 1e12

  @property
  def cost_per_gpu(self) -> float:
    return self.cost_per_machine / self.gpus_per_machine


# Table 1 of the paper (hardware specs and relative machine cost).
GPUS: dict[str, GpuSpec] = {
    "H800": GpuSpec(
        "H800", bf16_tflops=989.5, hbm_gb=80, hbm_tb_s=3.35, nvlink_gb_s=400, cost_per_machine=2.85
    ),
    "H20": GpuSpec(
        "H20", bf16_tflops=148, hbm_gb=96, hbm_tb_s=4.0, nvlink_gb_s=900, cost_per_machine=1.00
    ),
}


def get_gpu(name: str, gpus: Mapping[str, GpuSpec] | None = None) -> GpuSpec:
  """Looks up a GPU type; unknown names raise a one-sentence ValueError."""
  table = GPUS if gpus is None else gpus
  if name not in table:
    raise ValueError(
        f"GPU type {name!r} has no cost model; use one of {sorted(table)} "
        "or add a GpuSpec for it."
    )
  return table[name]


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """A network link: bandwidth in GB/s (1e9 bytes/s) and one-hop latency in s."""

  bandwidth_gb_s: float
  latency_s: float = 10e-6

  def __post_init__(self):
    if not self.bandwidth_gb_s > 0:
      raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.bandwidth_gb_s}.")


# Paper setup: main cluster nodes have 8 x 200 Gbps RoCE (200 GB/s per node);
# cloud nodes 100 Gbps TCP (12.5 GB/s per node); the inter-DC link 80 Gbps.
MAIN_NODE_LINK = LinkSpec(bandwidth_gb_s=8 * 200 / 8, latency_s=10e-6)
CLOUD_NODE_LINK = LinkSpec(bandwidth_gb_s=100 / 8, latency_s=50e-6)
INTER_DC_LINK = LinkSpec(bandwidth_gb_s=80 / 8, latency_s=5e-3)

# ---------------------------------------------------------------------------
# Models.


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Shape of a decoder-only transformer (enough to count bytes and FLOPs)."""

  name: str
  num_layers: int
  hidden_size: int
  intermediate_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab_size: int
  tie_embeddings: bool = False
  bytes_per_param: int = 2  # bf16 weights for inference and transfer.

  @property
  def num_params(self) -> int:
    d, i, h, k, hd = (
        self.hidden_size,
        self.intermediate_size,
        self.num_heads,
        self.num_kv_heads,
        self.head_dim,
    )
    attn = d * h * hd + 2 * d * k * hd + h * hd * d + h * hd + 2 * k * hd
    layer = attn + 3 * d * i + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * layer + emb + d

  @property
  def compute_params(self) -> int:
    """Parameters that cost 2 FLOPs per token (all but the embedding lookup)."""
    n = self.num_params - self.vocab_size * self.hidden_size
    return n + (self.vocab_size * self.hidden_size if self.tie_embeddings else 0)

  @property
  def weight_bytes(self) -> float:
    return float(self.num_params * self.bytes_per_param)

  @property
  def kv_bytes_per_token(self) -> float:
    """K and V for every layer, bf16."""
    return float(2 * self.num_layers * self.num_kv_heads * self.head_dim * 2)

  @property
  def attn_dim(self) -> int:
    return self.num_heads * self.head_dim

  def forward_flops(self, tokens: np.ndarray | float) -> np.ndarray | float:
    """FLOPs of one forward pass over sequences of `tokens` tokens each.

    2 * N_c per token for the matmuls plus causal attention: per layer QK^T
    and AV each cost T^2 * d_attn FLOPs over the lower triangle, i.e.
    2 * L * d_attn * T^2 per sequence.
    """
    t = np.asarray(tokens, dtype=np.float64)
    return 2.0 * self.compute_params * t + 2.0 * self.num_layers * self.attn_dim * t * t

  @classmethod
  def from_model_config(cls, config: Any, name: str = "model") -> "ModelSpec":
    """From a `streamrl.models.ModelConfig` (or anything with its fields)."""
    return cls(
        name=name,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        tie_embeddings=bool(config.tie_embeddings),
    )


# Public Qwen2.5 configs (config.json of each checkpoint).
MODELS: dict[str, ModelSpec] = {
    "qwen2.5-7b": ModelSpec(
        "qwen2.5-7b",
        num_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=152064,
    ),
    "qwen2.5-32b": ModelSpec(
        "qwen2.5-32b",
        num_layers=64,
        hidden_size=5120,
        intermediate_size=27648,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=152064,
    ),
    "qwen2.5-72b": ModelSpec(
        "qwen2.5-72b",
        num_layers=80,
        hidden_size=8192,
        intermediate_size=29568,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=152064,
    ),
}


def get_model(name: str) -> ModelSpec:
  if name not in MODELS:
    raise ValueError(
        f"model {name!r} is unknown; use one of {sorted(MODELS)} or build a ModelSpec."
    )
  return MODELS[name]


def default_tp(model: ModelSpec, gpu: GpuSpec, max_weight_fraction: float = 0.25) -> int:
  """Smallest power-of-two TP whose weight share is <= max_weight_fraction of HBM.

  Why 25 %: rollouts of 20K tokens need most of the memory for KV cache; this
  rule gives the usual deployments (7B: TP1, 32B: TP4, 72B: TP8 on 80 GB).
  """
  tp = 1
  while model.weight_bytes / tp > max_weight_fraction * gpu.hbm_bytes and tp < gpu.gpus_per_machine:
    tp *= 2
  return tp
