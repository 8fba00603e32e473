"""LoRA adapters on the decoder's projections, as plain pytrees.

The policy's own parameters stay as they are (frozen when LoRA is on); an
adapter is a dict `{"<layer>.<target>": {"a": [in, r], "b": [r, out]}}` and
the weight a forward pass reads is

  W' = W + scale * (a @ b).reshape(W.shape),   scale = alpha / rank,

with `in` and `out` the weight's input and output dimensions flattened in
the order the HF layout flattens them (streamrl/models/hf.py). `b` starts at
zero, so a fresh adapter is the base model exactly, and the base model with
the adapter off is the reference policy: no second copy.

The trainer never forms W': its forward passes take the adapter by layer
(`by_layer`) and add x a b beside each x W (`transformer.project`), so
neither a merged weight nor its weight-sized gradient exists in a step.
`merged` builds W' where a whole model is wanted (exports, an HF policy).

For the generators an adapter travels as PEFT-named tensors
(`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight` [r, in],
`...lora_B.weight` [out, r]) with the scale folded into B, so any PEFT
reader (vLLM's LoRA loader, `peft`) applies it with lora_alpha = r and
needs no other setting; `write_peft_dir` adds the adapter_config.json.

No torch or vLLM here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Mapping

import numpy as np

from streamrl.models import safetensors_io

# JAX is imported by the functions that build or read live adapters: the
# generator writes PEFT directories through this module without loading it.
if typing.TYPE_CHECKING:
  import jax

# target -> (module, parameter, leading dims that are the input, HF module name)
TARGETS = {
    "q": ("attn", "w_q_dhn", 1, "self_attn.q_proj"),
    "k": ("attn", "w_k_dkn", 1, "self_attn.k_proj"),
    "v": ("attn", "w_v_dkn", 1, "self_attn.v_proj"),
    "o": ("attn", "w_o_hnd", 2, "self_attn.o_proj"),
    "gate": ("mlp", "w_gate_df", 1, "mlp.gate_proj"),
    "up": ("mlp", "w_up_df", 1, "mlp.up_proj"),
    "down": ("mlp", "w_down_fd", 1, "mlp.down_proj"),
}
# The adapter slots vLLM's LoRA kernels come in (its `max_lora_rank` choices).
LORA_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORA_RANK = LORA_SLOTS[-1]
PEFT_PREFIX = "base_model.model.model.layers."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.([a-z_]+\.[a-z_]+)\.lora_([AB])\.weight$"
)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """Which projections carry adapters, their rank and scale (hashable: a
  static argument of the jitted steps)."""

  rank: int
  alpha: float
  targets: tuple[str, ...]

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def slot(rank: int) -> int:
  """The smallest of vLLM's LoRA slots that holds adapters of `rank`."""
  return next(r for r in LORA_SLOTS if r >= rank)


def parse_targets(targets: str) -> tuple[str, ...]:
  """`trainer.lora_targets` ("all" or a comma list of TARGETS) -> a tuple in TARGETS order."""
  names = list(TARGETS) if targets.strip() == "all" else [t.strip() for t in targets.split(",")]
  unknown = [t for t in names if t not in TARGETS]
  if unknown or not names:
    raise ValueError(
        f"trainer.lora_targets={targets!r} names {unknown or 'nothing'}; use 'all' or a comma "
        f"list of {list(TARGETS)}."
    )
  return tuple(t for t in TARGETS if t in names)


def _split(shape: tuple[int, ...], n_in: int) -> tuple[int, int]:
  return math.prod(shape[:n_in]), math.prod(shape[n_in:])


def _weight(params, layer: int, target: str):
  module, name, _, _ = TARGETS[target]
  return params["trunk"]["blocks"][layer][module][name]


def init_adapters(params, num_layers: int, spec: LoraSpec, key: jax.Array) -> dict:
  """A fresh adapter for the policy parameters `params` (an nnx.State or a
  pure dict): `a` ~ N(0, 1/in), `b` = 0, fp32."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  out = {}
  for layer in range(num_layers):
    for target in spec.targets:
      shape = tuple(np.shape(_weight(params, layer, target)))
      fan_in, fan_out = _split(shape, TARGETS[target][2])
      key, sub = jax.random.split(key)
      out[f"{layer}.{target}"] = {
          "a": jax.random.normal(sub, (fan_in, spec.rank), jnp.float32) / math.sqrt(fan_in),
          "b": jnp.zeros((spec.rank, fan_out), jnp.float32),
      }
  return out


def delta(ab: Mapping, shape: tuple[int, ...], scale: float, dtype) -> jax.Array:
  """scale * a @ b in the weight's shape and `dtype`."""
  return (scale * (ab["a"] @ ab["b"])).reshape(shape).astype(dtype)


def by_layer(adapters: Mapping, spec: LoraSpec, num_layers: int) -> list[dict]:
  """The adapter as the model's projections take it (`transformer.project`):
  per layer, target -> {"a": a, "b": scale * b}. Traceable: the train step
  calls it inside its jitted loss, so gradients reach `a` and `b`."""
  out = [{} for _ in range(num_layers)]
  for key, ab in adapters.items():
    layer, target = key.split(".")
    out[int(layer)][target] = {"a": ab["a"], "b": spec.scale * ab["b"]}
  return out


def merged(base, adapters: Mapping, spec: LoraSpec):
  """`base` (the policy's parameter State) with each adapted weight replaced
  by W + scale * a @ b; everything else is `base`'s own arrays (traceable)."""
  import jax  # pylint: disable=g-import-not-at-top

  def add(path, leaf):
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    if len(keys) >= 5 and keys[0] == "trunk" and keys[1] == "blocks":
      layer, module, name = keys[2], keys[3], keys[4]
      for target in spec.targets:
        if TARGETS[target][:2] == (module, name):
          ab = adapters.get(f"{layer}.{target}")
          if ab is not None:
            return leaf + delta(ab, leaf.shape, spec.scale, leaf.dtype)
    return leaf

  return jax.tree_util.tree_map_with_path(add, base)


def peft_tensors(adapters: Mapping, spec: LoraSpec, dtype="float32") -> dict[str, np.ndarray]:
  """The adapter as PEFT-named host arrays in `dtype`, the scale folded into B."""
  import jax  # pylint: disable=g-import-not-at-top

  np_dtype = safetensors_io.numpy_dtype(dtype)
  out = {}
  for key, ab in adapters.items():
    layer, target = key.split(".")
    name = f"{PEFT_PREFIX}{layer}.{TARGETS[target][3]}"
    a = np.asarray(jax.device_get(ab["a"]), np.float32)
    b = np.asarray(jax.device_get(ab["b"]), np.float32)
    out[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.T, dtype=np_dtype)
    out[f"{name}.lora_B.weight"] = np.ascontiguousarray((spec.scale * b).T, dtype=np_dtype)
  return out


def is_adapter(names) -> bool:
  """Whether tensor names are a PEFT adapter's (not a whole model's)."""
  names = list(names)
  return bool(names) and all(_PEFT_NAME.match(n) for n in names)


def peft_config(names, base_model: str = "") -> dict:
  """adapter_config.json for PEFT tensors with the scale folded in (alpha = r)."""
  modules = sorted({_PEFT_NAME.match(n).group(2).split(".")[1] for n in names})
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model,
      "target_modules": modules,
      "bias": "none",
      "lora_dropout": 0.0,
      "fan_in_fan_out": False,
      "use_rslora": False,
  }


def write_peft_dir(tensors: Mapping[str, np.ndarray], directory: str, base_model: str = "") -> str:
  """Writes PEFT tensors (`peft_tensors`) as an adapter directory; returns it.

  The rank is read from the tensors (every lora_A is [r, in]) and written as
  both `r` and `lora_alpha`, since the scale is in B already."""
  names = list(tensors)
  if not is_adapter(names):
    bad = next((n for n in names if not _PEFT_NAME.match(n)), "no tensors")
    raise ValueError(f"{bad!r} is not a PEFT LoRA tensor name; pass `lora.peft_tensors` output.")
  ranks = {int(np.shape(tensors[n])[0]) for n in names if n.endswith("lora_A.weight")}
  if len(ranks) != 1:
    raise ValueError(f"the adapter's lora_A tensors have ranks {sorted(ranks)}; expected one.")
  (rank,) = ranks
  os.makedirs(directory, exist_ok=True)
  config = peft_config(names, base_model) | {"r": rank, "lora_alpha": rank}
  with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
  safetensors_io.save(os.path.join(directory, ADAPTER_WEIGHTS), tensors)
  return directory
