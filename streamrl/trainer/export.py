"""The trained policy as a Hugging Face model directory.

  python launch/export.py --workdir=W --out=DIR [--step=N] [--overwrite]

  export_checkpoint(W, DIR, step=None)   # checkpoint N (default: newest) of run W
  export_policy(trainer.policy(), model_dir=policy_dir, out=DIR, dtype=s.model.dtype)

A run with `checkpoint.export_hf` writes its final policy as <workdir>/hf
itself (`export_trained`), and a LoRA run its adapter as <workdir>/adapter.

DIR then holds what `transformers.AutoModelForCausalLM.from_pretrained(DIR)`
and `vllm.LLM(DIR)` read:

  config.json              the architecture (`hf.save_hf`), with the run's policy
                           directory's bos / eos / pad ids
  model.safetensors        the actor in `model.dtype` (the generators' dtype)
  generation_config.json   the policy directory's own, else its token ids
  tokenizer files          copied from the policy directory, whichever it has

From a workdir, the run's saved config (<workdir>/config.json) says where its
policy directory is (`model.path`, or the warm-started tiny model cached in
the workdir), and only the actor's parameters are read from the checkpoint
(an Orbax partial restore, onto the host): no trainer, mesh or optimizer
state is built, so the export runs on any machine that can read the files.

DIR is written next to itself under a temporary name and renamed into place,
so a crash never leaves half a model there; a DIR that exists and is not
empty is refused unless `overwrite`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
import tokenizers
from flax import nnx

from streamrl.config import settings as settings_lib
from streamrl.data import tokenizer as tokenizer_lib
from streamrl.errors import MissingFileError, UserError
from streamrl.models import hf, lora as lora_lib
from streamrl.models.transformer import Transformer
from streamrl.trainer import setup

log = logging.getLogger(__name__)

HF_DIR = "hf"  # <workdir>/hf: the trained policy, for transformers and vLLM.
ADAPTER_DIR = "adapter"  # <workdir>/adapter: a LoRA run's adapter alone (PEFT).

# Tokenizer files a model directory may ship (sentencepiece, BPE, WordPiece,
# chat templates); each one present is copied as it is.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Named chat templates (transformers keeps them in this folder).
TOKENIZER_DIRS = ("additional_chat_templates",)
GENERATION_CONFIG = "generation_config.json"
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Where the actor's arrays sit in a checkpoint: `RLTrainer.checkpoint_arrays()`
# is {"state": TrainState}, and this is the key path (jax.tree_util.keystr)
# of its `actor` field, as `Checkpointer.save` records it in the layout.
_ACTOR = "['state'].actor"


# ------------------------------------------------------------- the run's files
def checkpoint_steps(workdir: str) -> list[int]:
  """The checkpointed steps of a run, ascending (empty when there are none)."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return []
  return sorted(
      int(d)
      for d in os.listdir(directory)
      if d.isdigit() and os.path.isdir(os.path.join(directory, d, "arrays"))
  )


def pick_step(workdir: str, step: int | None) -> int:
  steps = checkpoint_steps(workdir)
  if not steps:
    raise MissingFileError(
        f"{workdir} has no checkpoints (nothing under {workdir}/checkpoints); train first, "
        "or pass the workdir of a run that saved one."
    )
  if step is None:
    return steps[-1]
  if int(step) not in steps:
    raise UserError(
        f"{workdir} has no checkpoint of step {step}; pick one of the saved steps "
        f"{', '.join(map(str, steps))}."
    )
  return int(step)


def _check_actor_layout(step_dir: str, abstract, model_dir: str) -> None:
  """UserError unless the checkpoint's actor has exactly `abstract`'s arrays.

  Reads the layout `Checkpointer.save` records (key path -> shape) rather
  than trusting a partial restore, which would silently leave out arrays the
  template lacks (a bias, say)."""
  info_dir = os.path.join(step_dir, "info")
  if not os.path.isdir(info_dir):
    raise UserError(
        f"checkpoint {step_dir} was not written by streamrl's Checkpointer, so its actor "
        "cannot be found; export a checkpoint of a StreamRL run."
    )
  layout = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(info_dir)["layout"]
  saved = {k[len(_ACTOR) :]: v for k, v in layout.items() if k.startswith(_ACTOR + "[")}
  wanted = {
      jax.tree_util.keystr(path): list(leaf.shape)
      for path, leaf in jax.tree_util.tree_leaves_with_path(abstract)
  }
  for key in list(wanted) + [k for k in saved if k not in wanted]:
    if key not in saved:
      problem = "has no"
    elif key not in wanted:
      problem = f"has an array the model of {model_dir} lacks,"
    elif list(saved[key]) != wanted[key]:
      problem = f"has shape {tuple(saved[key])} (not {tuple(wanted[key])}) for"
    else:
      continue
    raise UserError(
        f"checkpoint {step_dir} {problem} the actor's {key}: it was not trained from the "
        f"policy directory {model_dir} as it is now; export it with the one the run used."
    )


def _restore(step_dir: str, abstract, model_dir: str):
  """The checkpoint's actor arrays shaped like `abstract`, as numpy."""
  _check_actor_layout(step_dir, abstract, model_dir)
  item = {"state": {"actor": abstract}}
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  restored = ocp.PyTreeCheckpointer().restore(
      os.path.join(step_dir, "arrays"),
      args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
  )
  return restored["state"]["actor"]


def restore_adapter(workdir: str, model_dir: str, step: int, spec: lora_lib.LoraSpec) -> dict:
  """The LoRA adapter of checkpoint `step` of a run with `trainer.lora_rank`
  (`spec`), as numpy arrays (`streamrl.models.lora`)."""
  cfg = hf.read_config(model_dir)
  _, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  abstract = jax.eval_shape(
      lambda: lora_lib.init_adapters(params, cfg.num_layers, spec, jax.random.key(0))
  )
  step_dir = os.path.join(os.path.abspath(workdir), "checkpoints", str(step))
  return _restore(step_dir, abstract, model_dir)


def restore_actor(
    workdir: str, model_dir: str, step: int, lora: lora_lib.LoraSpec | None = None
) -> Transformer:
  """The actor of checkpoint `step` as a Transformer with host (numpy) weights.

  Reads only the actor's arrays (`RLTrainer.checkpoint_arrays()["state"].actor`)
  of the step's Orbax item; the optimizer state and the critic stay on disk.
  The model's shapes come from `model_dir`'s config.json. A LoRA run's
  checkpoint (`lora`: its `trainer.lora_spec()`) holds the adapter: it is
  merged into `model_dir`'s weights.
  """
  if lora is not None:
    adapters = restore_adapter(workdir, model_dir, step, lora)
    _, base = hf.load_hf(model_dir)
    graphdef, params = nnx.split(base, nnx.Param)
    return nnx.merge(graphdef, jax.device_get(lora_lib.merged(params, adapters, lora)))
  cfg = hf.read_config(model_dir)
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param
  )
  step_dir = os.path.join(os.path.abspath(workdir), "checkpoints", str(step))
  return nnx.merge(graphdef, _restore(step_dir, abstract, model_dir))


# --------------------------------------------------------------------- writing
def check_out(out: str, *, overwrite: bool, model_dir: str) -> str:
  out = os.path.abspath(out)
  if os.path.exists(out):
    if not os.path.isdir(out):
      raise UserError(f"the output {out} is a file; pass a directory path (a new one is made).")
    if os.listdir(out) and not overwrite:
      raise UserError(
          f"the output {out} exists and is not empty; pass another directory, or "
          "overwrite it (launch/export.py --overwrite)."
      )
  if os.path.realpath(out) == os.path.realpath(model_dir):
    raise UserError(f"the output {out} is the run's own policy directory; pass another directory.")
  return out


def _token_ids(model_dir: str) -> dict:
  """bos / eos / pad ids of `model_dir`: config.json's, the missing ones
  looked up from the tokenizer's special tokens (None where neither has one)."""
  with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  ids = {k: config.get(k) for k in _TOKEN_IDS}
  tokenizer_json = os.path.join(model_dir, "tokenizer.json")
  if all(v is not None for v in ids.values()) or not os.path.isfile(tokenizer_json):
    return ids
  special = tokenizer_lib.template_tokens(model_dir)
  tok = tokenizers.Tokenizer.from_file(tokenizer_json)
  for key in _TOKEN_IDS:
    token = special.get(key.removesuffix("_id"))
    if ids[key] is None and token is not None:
      ids[key] = tok.token_to_id(token)
  return ids


def _write(model: Transformer, directory: str, model_dir: str, dtype: str, tensors) -> None:
  ids = _token_ids(model_dir)
  hf.save_hf(model, directory, dtype=dtype, tensors=tensors, **ids)
  for name in TOKENIZER_FILES:
    src = os.path.join(model_dir, name)
    if os.path.isfile(src):
      shutil.copyfile(src, os.path.join(directory, name))
  for name in TOKENIZER_DIRS:
    src = os.path.join(model_dir, name)
    if os.path.isdir(src):
      shutil.copytree(src, os.path.join(directory, name))
  generation = os.path.join(model_dir, GENERATION_CONFIG)
  if os.path.isfile(generation):
    shutil.copyfile(generation, os.path.join(directory, GENERATION_CONFIG))
  else:
    with open(os.path.join(directory, GENERATION_CONFIG), "w", encoding="utf-8") as f:
      json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)


def _move_into_place(tmp: str, out: str) -> None:
  if not os.path.isdir(out) or not os.listdir(out):
    os.replace(tmp, out)  # rename(2) takes the place of a missing or empty directory
    return
  # Replacing a full directory takes two renames; the old copy goes only once
  # the new one is in place.
  old = f"{tmp}.old"
  os.replace(out, old)
  try:
    os.replace(tmp, out)
  except BaseException:
    os.replace(old, out)
    raise
  shutil.rmtree(old, ignore_errors=True)


def export_policy(
    model: Transformer,
    *,
    model_dir: str,
    out: str,
    dtype: str = "float32",
    overwrite: bool = False,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> str:
  """Writes `model` as the Hugging Face directory `out` (see the module docstring).

  Args:
    model: the policy (the live, possibly sharded actor, or `restore_actor`'s);
      read one tensor at a time (`hf.HFTensors`), so read it before the next
      train step donates its parameters.
    model_dir: the run's policy directory, whose tokenizer files, token ids
      and generation config go with the weights.
    out: the directory to write; created with its parents.
    dtype: the safetensors' dtype ("float32", "bfloat16", "float16"): the
      run's `model.dtype`.
    overwrite: replace `out` if it exists and is not empty.
    tensors: the model's Hugging Face tensors in `dtype`, when they were
      gathered already (a multi-process trainer's `export_weights()` file,
      whose shards live in several processes); `model` then gives only the
      architecture.

  Returns:
    `out` as an absolute path.

  Raises:
    UserError: `out` is a file, is not empty (without `overwrite`), or is
      `model_dir` itself.
  """
  return _write_whole(
      out, overwrite, model_dir, lambda tmp: _write(model, tmp, model_dir, dtype, tensors)
  )


def export_adapter(
    tensors: Mapping[str, np.ndarray], *, model_dir: str, out: str, overwrite: bool = False
) -> str:
  """Writes a LoRA adapter (`lora.peft_tensors`) as the PEFT directory `out`
  (adapter_config.json naming `model_dir` as its base, adapter_model.safetensors,
  and the base's tokenizer files); returns `out` as an absolute path."""

  def write(tmp):
    lora_lib.write_peft_dir(tensors, tmp, base_model=os.path.abspath(model_dir))
    for name in TOKENIZER_FILES:
      src = os.path.join(model_dir, name)
      if os.path.isfile(src):
        shutil.copyfile(src, os.path.join(tmp, name))

  return _write_whole(out, overwrite, model_dir, write)


def _write_whole(out: str, overwrite: bool, model_dir: str, write) -> str:
  """`write(tmp)` into a fresh sibling directory of `out`, which then takes `out`'s place."""
  out = check_out(out, overwrite=overwrite, model_dir=model_dir)
  parent, name = os.path.split(out)
  os.makedirs(parent, exist_ok=True)
  tmp = os.path.join(parent, f".{name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  os.makedirs(tmp)
  try:
    write(tmp)
    _move_into_place(tmp, out)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out


# ---------------------------------------------------------------- the run's
def export_trained(
    s: settings_lib.Settings, workdir: str, trainer, model_dir: str, *, multi_process: bool
) -> None:
  """The trained policy as a Hugging Face directory, <workdir>/hf (replaced
  whole on a rerun), and a LoRA run's adapter alone as <workdir>/adapter.

  `trainer` is the run's `RLTrainer`, or with `multi_process` its
  `protocol.Leader`, whose shards live in several processes: every process
  writes its own into one weights file (the collective `export_weights`, as
  for a weight push), which process 0 saves. (Reading the final checkpoint
  instead would hang: Orbax waits for every process of the run at each
  restore.)
  """
  out = os.path.join(workdir, HF_DIR)
  if trainer.lora:  # the adapter alone too, beside the merged policy
    export_adapter(
        trainer.export_weights(s.model.dtype),
        model_dir=model_dir,
        out=os.path.join(workdir, ADAPTER_DIR),
        overwrite=True,
    )
  weights = trainer.export_weights() if multi_process else None
  try:
    export_policy(
        trainer.policy(),
        model_dir=model_dir,
        out=out,
        dtype=s.model.dtype,
        overwrite=True,
        tensors=None if weights is None else weights.tensors(),
    )
  finally:
    if weights is not None:
      weights.unlink()
  log.info("Trained policy exported to %s", out)


def read_settings(workdir: str) -> settings_lib.Settings:
  """The settings a run saved in <workdir>/config.json.

  Raises:
    MissingFileError: no such directory, or no config.json in it.
    UserError: config.json is not a run config this version reads.
  """
  if not os.path.isdir(workdir):
    raise MissingFileError(
        f"workdir {workdir} does not exist; pass the --workdir of a training run."
    )
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise MissingFileError(
        f"{workdir} has no config.json, so it is not the workdir of a training run; pass "
        "the --workdir that launch/main.py wrote."
    )
  try:
    with open(path, encoding="utf-8") as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}).") from None
  # The data and profile files the run read need not exist where it is exported.
  return settings_lib.from_config(config, check_files=False)


def export_checkpoint(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    overwrite: bool = False,
    merge_lora: bool = True,
) -> int:
  """Writes the actor of run `workdir`'s checkpoint `step` (default: the
  newest) as the Hugging Face directory `out`, in the run's `model.dtype`.
  A LoRA run's actor is its policy directory with the adapter merged in, or
  with `merge_lora=False` the adapter alone as a PEFT directory (vLLM's
  `LoRARequest` and `peft` load it on the run's policy directory).

  Returns:
    The step exported.

  Raises:
    UserError: no such workdir (or not a run's), no checkpoints, no
      checkpoint of `step` (the message lists the saved ones), the run's
      policy directory is gone, or `out` is refused (`export_policy`).
  """
  s = read_settings(workdir)
  step = pick_step(workdir, step)
  model_dir = setup.saved_policy_dir(s, workdir)
  check_out(out, overwrite=overwrite, model_dir=model_dir)  # before the restore
  spec = s.trainer.lora_spec()
  if spec is not None and not merge_lora:
    adapters = restore_adapter(workdir, model_dir, step, spec)
    export_adapter(
        lora_lib.peft_tensors(adapters, spec, s.model.dtype),
        model_dir=model_dir,
        out=out,
        overwrite=overwrite,
    )
    return step
  if spec is None and not merge_lora:
    raise UserError(
        f"run {workdir} trained full weights (trainer.lora_rank=0): it has no adapter; "
        "export it without --nomerge_lora."
    )
  model = restore_actor(workdir, model_dir, step, spec)
  export_policy(model, model_dir=model_dir, out=out, dtype=s.model.dtype, overwrite=overwrite)
  return step
