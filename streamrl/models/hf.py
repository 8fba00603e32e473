"""Weight conversion between our Flax state and HF checkpoint directories.

One mapping table serves both directions: each entry names a parameter path in
the Flax state, its HF name, and how the array is laid out on each side (HF
Linear weights are [out, in]; our kernels are [in, ...out] with heads split
out). Exported tensors are exactly what vLLM's `load_weights` takes.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import re
import typing
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from streamrl.errors import MissingFileError, UserError
from streamrl.models import safetensors_io
from streamrl.models.config import ModelConfig, RopeScaling

# JAX and Flax are imported by the functions that convert live parameters: the
# generator reads checkpoint configs through this module without loading them.
if typing.TYPE_CHECKING:
  import jax

  from streamrl.models.transformer import Transformer

SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}
_FIX = "convert the model or pick a Qwen2, Qwen3, Llama or Mistral checkpoint."
# Well-known architectures we can't run, each with what our decoder lacks.
REFUSED_ARCHITECTURES = {
    "Gemma2ForCausalLM": (
        "Gemma 2 (Gemma2ForCausalLM) is not supported: its logit soft-capping, alternating "
        "sliding-window layers, extra norms and scaled embeddings are not implemented; " + _FIX
    ),
    "Phi3ForCausalLM": (
        "Phi-3 (Phi3ForCausalLM) is not supported: its fused qkv_proj / gate_up_proj weights "
        "and longrope scaling are not implemented; " + _FIX
    ),
}
# What transformers assumes when config.json leaves a field out, where it
# differs from our defaults (Qwen's window is off unless use_sliding_window).
_SLIDING_WINDOW_DEFAULT = {"mistral": 4096}
_HEAD_DIM_DEFAULT = {"qwen3": 128}


@dataclasses.dataclass(frozen=True)
class _Entry:
  path: tuple
  hf_name: str
  to_hf: Callable[[np.ndarray], np.ndarray]
  from_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x):
  return x


def _layout(cfg: ModelConfig) -> Iterator[_Entry]:
  d, h, k, n = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def split_heads(heads):  # HF [heads*n, d] <-> ours [d, heads, n]
    return (lambda w: w.reshape(d, heads * n).T, lambda w: w.T.reshape(d, heads, n))

  def split_bias(heads):
    return (lambda b: b.reshape(heads * n), lambda b: b.reshape(heads, n))

  transpose = (lambda w: w.T, lambda w: w.T)
  yield _Entry(("trunk", "embedding_vd"), "model.embed_tokens.weight", _identity, _identity)
  for i in range(cfg.num_layers):
    p, hf = ("trunk", "blocks", i), f"model.layers.{i}."
    yield _Entry(p + ("attn_norm", "scale"), hf + "input_layernorm.weight", _identity, _identity)
    yield _Entry(
        p + ("mlp_norm", "scale"), hf + "post_attention_layernorm.weight", _identity, _identity
    )
    for ours, theirs, heads in (("q", "q", h), ("k", "k", k), ("v", "v", k)):
      suffix = "dhn" if ours == "q" else "dkn"
      yield _Entry(
          p + ("attn", f"w_{ours}_{suffix}"),
          hf + f"self_attn.{theirs}_proj.weight",
          *split_heads(heads),
      )
      if cfg.qkv_bias:
        bsuffix = "hn" if ours == "q" else "kn"
        yield _Entry(
            p + ("attn", f"b_{ours}_{bsuffix}"),
            hf + f"self_attn.{theirs}_proj.bias",
            *split_bias(heads),
        )
    if cfg.qk_norm:
      for ours in ("q", "k"):
        yield _Entry(
            p + ("attn", f"{ours}_norm", "scale"),
            hf + f"self_attn.{ours}_norm.weight",
            _identity,
            _identity,
        )
    yield _Entry(
        p + ("attn", "w_o_hnd"),
        hf + "self_attn.o_proj.weight",
        lambda w: w.reshape(h * n, d).T,
        lambda w: w.T.reshape(h, n, d),
    )
    yield _Entry(p + ("mlp", "w_gate_df"), hf + "mlp.gate_proj.weight", *transpose)
    yield _Entry(p + ("mlp", "w_up_df"), hf + "mlp.up_proj.weight", *transpose)
    yield _Entry(p + ("mlp", "w_down_fd"), hf + "mlp.down_proj.weight", *transpose)
  yield _Entry(("trunk", "final_norm", "scale"), "model.norm.weight", _identity, _identity)
  if not cfg.tie_embeddings:
    yield _Entry(("w_head_dv",), "lm_head.weight", *transpose)


def layout_entries(cfg: ModelConfig) -> dict[str, _Entry]:
  """{HF name: how our parameter maps to it} for a model config."""
  return {e.hf_name: e for e in _layout(cfg)}


def get_param(tree, path):
  """The leaf at `path` of a pure-dict parameter tree."""
  return _get(tree, path)


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


class HFTensors(Mapping[str, np.ndarray]):
  """A policy's parameters under their HF names, each converted when read.

  It views the live parameters: read it before the model's next train step
  (which donates them), or `dict()` it to keep a copy. Reading a key copies
  that one parameter to the host, cast to `dtype` on
  its device first (so a bf16 export moves half the bytes and never holds
  an fp32 copy), and lays it out as HF / vLLM expect. Nothing is cached:
  iterating `items()` streams the model one tensor at a time.

  Args:
    model: the Flax policy (sharded or not).
    dtype: the receiver's dtype: "float32", "bfloat16", "float16" or a numpy dtype.
  """

  def __init__(self, model: Transformer, dtype="float32"):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    self.cfg = model.cfg
    self.dtype = safetensors_io.numpy_dtype(dtype)
    self._params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    self._entries = {e.hf_name: e for e in _layout(model.cfg)}

  def __getitem__(self, name: str) -> np.ndarray:
    import jax  # pylint: disable=g-import-not-at-top

    e = self._entries[name]
    value = _get(self._params, e.path)
    if isinstance(value, jax.Array) and value.is_deleted():
      raise RuntimeError(
          f"{name!r} was read after the parameters it views were updated in place (a train "
          "step donates them); read exported weights before the next update, or dict() them."
      )
    if isinstance(value, jax.Array) and value.size > _ON_HOST_ELEMENTS:
      # Cast and HF layout on the device, in one compiled program per tensor kind:
      # only the final bytes leave it, already contiguous.
      return np.asarray(_device_to_hf(self.cfg, _kind(name), np.dtype(self.dtype).name)(value))
    # Norm scales and biases: too small to be worth a compiled program each.
    return np.ascontiguousarray(e.to_hf(np.asarray(value)), dtype=self.dtype)

  def __iter__(self):
    return iter(self._entries)

  def device_tensors(self) -> Iterator[tuple[str, jax.Array]]:
    """(HF name, tensor) in HF layout and the receiver's dtype, left on the
    device: for a consumer on the same device (DLPack to torch, no host copy)."""
    for name, e in self._entries.items():
      value = _get(self._params, e.path)
      yield name, _device_to_hf(self.cfg, _kind(name), np.dtype(self.dtype).name)(value)

  def __len__(self) -> int:
    return len(self._entries)

  def specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (HF shape, dtype)} without reading any parameter."""
    import jax  # pylint: disable=g-import-not-at-top

    out = {}
    for name, e in self._entries.items():
      param = _get(self._params, e.path)
      shape = jax.eval_shape(e.to_hf, jax.ShapeDtypeStruct(np.shape(param), np.float32)).shape
      out[name] = (tuple(shape), self.dtype)
    return out

  def nbytes(self) -> int:
    return sum(int(np.prod(s)) * d.itemsize for s, d in self.specs().values())


def _kind(name: str) -> str:
  """Tensors converted alike share one conversion: every layer's as layer 0's,
  v_proj's as k_proj's and up_proj's as gate_proj's (same shapes and layout)."""
  name = re.sub(r"\.layers\.\d+\.", ".layers.0.", name)
  return name.replace("v_proj.", "k_proj.").replace("up_proj.", "gate_proj.")


# Tensors of at most this many elements are converted on the host (norms, biases).
_ON_HOST_ELEMENTS = 1 << 16


@functools.lru_cache(maxsize=None)
def _device_to_hf(cfg: ModelConfig, kind: str, dtype: str):
  """A jitted function: our parameter -> the HF tensor `kind`, cast to `dtype`."""
  import jax  # pylint: disable=g-import-not-at-top

  to_hf = layout_entries(cfg)[kind].to_hf
  return jax.jit(lambda w: to_hf(w.astype(dtype)))


def to_hf_tensors(model: Transformer, dtype="float32") -> dict[str, np.ndarray]:
  """Flax policy -> {HF parameter name: numpy array}, ready for vLLM (all in memory)."""
  return dict(HFTensors(model, dtype))


def from_hf_tensors(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=np.float32
) -> Transformer:
  """{HF name: array} -> a Flax policy with exactly those weights, in `dtype`
  (None: each as the checkpoint stores it)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from streamrl.models.transformer import Transformer  # pylint: disable=g-import-not-at-top

  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  expected = nnx.to_pure_dict(state)
  pure: dict = {}
  for e in _layout(cfg):
    if e.hf_name not in tensors:
      raise UserError(
          f"Checkpoint is missing {e.hf_name!r}; it does not look like a "
          f"{cfg.family} checkpoint with this config.json."
      )
    value = np.asarray(e.from_hf(np.asarray(tensors[e.hf_name])), dtype=dtype)
    want = _get(expected, e.path).shape
    if value.shape != want:
      raise UserError(
          f"Parameter {e.hf_name!r} has shape {tensors[e.hf_name].shape}, which "
          f"does not match config.json (expected {want} after conversion); "
          "check that config.json belongs to these weights."
      )
    _set(pure, e.path, value)
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def hf_config_dict(
    cfg: ModelConfig, *, bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0
) -> dict:
  """The config.json of `cfg`, which transformers and vLLM load as the same model.

  RoPE is written the transformers-4 way (`rope_theta`, `rope_scaling`),
  which transformers 5 reads into its `rope_parameters` too.
  """
  arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[cfg.family]
  out = {
      "architectures": [arch],
      "model_type": cfg.family,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "rope_theta": cfg.rope_theta,
      "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "max_position_embeddings": cfg.max_position_embeddings,
      "hidden_act": "silu",
      "torch_dtype": "float32",
      "bos_token_id": bos_token_id,
      "eos_token_id": eos_token_id,
      "pad_token_id": pad_token_id,
  }
  if cfg.rope_scaling is not None:
    out["rope_scaling"] = cfg.rope_scaling.hf_dict()
  if cfg.family == "llama":
    out["attention_bias"] = False
    out["mlp_bias"] = False
  if cfg.family == "qwen3":
    out["attention_bias"] = False
    out["use_sliding_window"] = False
  if cfg.family in ("qwen3", "mistral"):
    out["sliding_window"] = None  # both default to 4096 when it is absent
  return out


def _rope_scaling(hf: Mapping, rope: Mapping) -> RopeScaling | None:
  """The scaling in `rope` (HF's `rope_parameters` / `rope_scaling`; None: default RoPE)."""
  if not isinstance(rope, Mapping) or (rope and all(isinstance(v, Mapping) for v in rope.values())):
    raise UserError(
        f"RoPE parameters {rope!r} (one set per layer type) are not supported; use a "
        "checkpoint with one RoPE for all layers."
    )
  rope_type = rope.get("rope_type") or rope.get("type") or "default"
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
  if partial not in (None, 1.0):
    raise UserError(
        f"partial_rotary_factor={partial} (RoPE on part of each head) is not supported; use a "
        "checkpoint that rotates the whole head."
    )
  if rope_type == "default":
    return None
  if rope_type not in ("linear", "llama3"):
    raise UserError(
        f"RoPE scaling {rope_type!r} is not supported; use a checkpoint with default, "
        "'linear' or 'llama3' RoPE."
    )
  try:
    factor = float(rope["factor"])
    if rope_type == "linear":
      return RopeScaling("linear", factor)
    return RopeScaling(
        "llama3",
        factor,
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        # What transformers falls back on when the field is absent.
        original_max_position_embeddings=int(
            rope.get("original_max_position_embeddings", hf.get("max_position_embeddings", 4096))
        ),
    )
  except KeyError as e:
    raise UserError(
        f"{rope_type!r} RoPE scaling lacks {e.args[0]!r}; fix rope_scaling in config.json."
    ) from None
  except ValueError as e:
    raise UserError(f"Bad {rope_type!r} RoPE scaling in config.json: {e}") from None


def config_from_hf(hf: Mapping) -> ModelConfig:
  """Parses an HF config.json dict, refusing architectures we can't run."""
  archs = hf.get("architectures") or []
  refused = next((REFUSED_ARCHITECTURES[a] for a in archs if a in REFUSED_ARCHITECTURES), None)
  if refused:
    raise UserError(refused)
  family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
  if family is None:
    raise UserError(
        f"Unsupported architecture {archs or hf.get('model_type')!r}; StreamRL "
        f"runs {sorted(SUPPORTED_ARCHITECTURES)} — convert the model or pick one of those."
    )
  if family == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise UserError(
        "Llama checkpoints with attention_bias/mlp_bias are not supported; "
        "use a checkpoint without biases."
    )
  if family == "qwen3" and hf.get("attention_bias"):
    raise UserError(
        "Qwen3 checkpoints with attention_bias=true are not supported; use a checkpoint "
        "without q/k/v/o biases (every released Qwen3 has none)."
    )
  window = hf.get("sliding_window", _SLIDING_WINDOW_DEFAULT.get(family))
  # Qwen configs carry a window that only use_sliding_window (default false)
  # turns on; transformers' Mistral has no such switch and uses any window.
  if family in ("qwen2", "qwen3"):
    slides = window is not None and hf.get("use_sliding_window", False) is not False
  else:
    slides = window is not None
  if slides:
    raise UserError(
        f"Sliding-window attention ({archs[0]}, sliding_window={window}) is not supported; "
        "use a checkpoint with full attention (sliding_window: null)."
    )
  # transformers 5 writes rope_theta inside rope_parameters, 4 next to rope_scaling.
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_scaling = _rope_scaling(hf, rope)
  theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
  heads = hf["num_attention_heads"]
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=hf["hidden_size"],
      intermediate_size=hf["intermediate_size"],
      num_layers=hf["num_hidden_layers"],
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or _HEAD_DIM_DEFAULT.get(family) or hf["hidden_size"] // heads,
      rope_theta=float(theta),
      rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      qkv_bias=family == "qwen2",
      max_position_embeddings=hf.get("max_position_embeddings", 4096),
      family=family,
      qk_norm=family == "qwen3",
      rope_scaling=rope_scaling,
  )


def read_config(model_dir: str) -> ModelConfig:
  """The ModelConfig of the HF checkpoint directory `model_dir`.

  Raises:
    MissingFileError: no such directory, or no config.json in it (a
      UserError, also a FileNotFoundError).
    UserError: config.json is not JSON, or describes a model we can't run.
  """
  path = os.path.join(model_dir, "config.json")
  if not os.path.isdir(model_dir):
    raise MissingFileError(
        f"Model directory {model_dir!r} does not exist; pass a local HF checkpoint "
        "directory (config.json + *.safetensors) or leave it empty for the tiny default."
    )
  if not os.path.isfile(path):
    raise MissingFileError(
        f"{model_dir!r} has no config.json; point to an HF checkpoint directory."
    )
  try:
    with open(path) as f:
      hf_config = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(
        f"{path} is not valid JSON ({e.msg} at line {e.lineno}); point to an HF checkpoint "
        "directory with an intact config.json."
    ) from None
  if not isinstance(hf_config, dict):
    raise UserError(
        f"{path} holds a {type(hf_config).__name__}, not a JSON object; point to an HF "
        "checkpoint directory."
    )
  missing = [
      k
      for k in (
          "vocab_size",
          "hidden_size",
          "intermediate_size",
          "num_hidden_layers",
          "num_attention_heads",
      )
      if k not in hf_config
  ]
  if missing and any(a in SUPPORTED_ARCHITECTURES for a in hf_config.get("architectures") or []):
    raise UserError(
        f"{path} lacks {', '.join(missing)}; point to a complete HF checkpoint directory."
    )
  return config_from_hf(hf_config)


def load_hf_tensors(model_dir: str) -> dict[str, np.ndarray]:
  files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
  if not files:
    raise MissingFileError(
        f"{model_dir!r} has no *.safetensors files; save the checkpoint with "
        "safe_serialization=True."
    )
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    tensors.update(safetensors_io.load(f))
  return tensors


def load_hf(model_dir: str, dtype=np.float32) -> tuple[ModelConfig, Transformer]:
  """Loads any local Qwen2 / Qwen3 / Llama / Mistral HF checkpoint directory into Flax,
  its weights in `dtype` (None: as stored, e.g. a frozen LoRA base that needs no fp32
  copy)."""
  cfg = read_config(model_dir)
  tensors = load_hf_tensors(model_dir)
  if (
      cfg.tie_embeddings
      and "lm_head.weight" in tensors
      and not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
  ):
    raise UserError(
        f"{model_dir!r} says tie_word_embeddings but has a separate "
        "lm_head.weight; fix config.json."
    )
  return cfg, from_hf_tensors(cfg, tensors, dtype)


def save_hf(
    model: Transformer,
    model_dir: str,
    *,
    dtype="float32",
    tensors: Mapping[str, np.ndarray] | None = None,
    **config_kwargs,
) -> str:
  """Writes config.json + model.safetensors (in `dtype`) into `model_dir`.

  `tensors`: the model's Hugging Face tensors already in `dtype`, when they
  were gathered elsewhere (a multi-process trainer's weights file); `model`
  then gives only the architecture."""
  os.makedirs(model_dir, exist_ok=True)
  config = hf_config_dict(model.cfg, **config_kwargs)
  config["torch_dtype"] = str(safetensors_io.numpy_dtype(dtype))
  with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  safetensors_io.save(
      os.path.join(model_dir, "model.safetensors"),
      HFTensors(model, dtype) if tensors is None else tensors,
      metadata={"format": "pt"},
  )
  return model_dir
