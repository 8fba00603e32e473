"""Orbax checkpoints of a training run: arrays, JSON metadata and a fingerprint.

  ckpt = Checkpointer(f"{workdir}/checkpoints", keep=3, fingerprint={"algo": "ppo", ...})
  if (step := ckpt.latest_step()) is not None:
    step, arrays, meta = ckpt.restore(abstract_arrays)   # onto the template's shardings
  ...
  ckpt.save(step, {"actor": actor_state, "opt": opt_state, "rng": key}, {"data": it_state, ...})

Each step directory holds three Orbax items:
  arrays  a pytree of jax/numpy arrays (params, optimizer states, typed or raw
          PRNG keys; nnx.State trees work as they are);
  meta    JSON chosen by the caller (data-iterator state, counters, weight version);
  info    JSON written here: the run's fingerprint and the arrays' layout
          (key path -> shape), so a resume against the wrong config or a
          changed model fails with one sentence instead of an Orbax error.

A directory whose checkpoints carry another fingerprint is refused at
construction, before anything is written or deleted there: resuming an
incompatible run, or letting `keep` rotate its checkpoints away, would both
destroy someone's results. That refusal, and a directory path that runs
into a file, are `streamrl.errors.UserError`s (the fix is another --workdir).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from streamrl.errors import UserError, nearest_existing

_log = logging.getLogger(__name__)

_FORMAT = 1  # Bump when the on-disk layout written here changes.


def _json_default(x: Any) -> Any:
  """Lets numpy scalars/arrays (common in counters) through json.dumps."""
  if isinstance(x, np.generic):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"{type(x).__name__} is not JSON-serialisable")


def _to_json(value: Any, what: str) -> Any:
  """`value` as it will read back from JSON (tuples become lists), or ValueError."""
  try:
    return json.loads(json.dumps(value, default=_json_default))
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"the checkpoint {what} must be JSON-serialisable ({e}); pass plain "
        "dicts/lists of str, int, float, bool or None."
    ) from None


def _first_difference(saved: Any, given: Any, path: str = "") -> tuple[str, Any, Any] | None:
  """(dotted key, saved value, given value) of the first difference, or None."""
  if isinstance(saved, dict) and isinstance(given, dict):
    missing = object()
    # Given order first (the caller's notion of "first"), then keys only on disk.
    for key in list(given) + [k for k in saved if k not in given]:
      sub = f"{path}.{key}" if path else str(key)
      a, b = saved.get(key, missing), given.get(key, missing)
      if a is missing or b is missing:
        return sub, (None if a is missing else a), (None if b is missing else b)
      diff = _first_difference(a, b, sub)
      if diff is not None:
        return diff
    return None
  return None if saved == given else (path or "<root>", saved, given)


def drop_defaults(tree: Any, defaults: Any) -> Any:
  """`tree` without the leaves equal to `defaults`' at the same path (empty
  dicts dropped too): a fingerprint that names only what a run changed, so
  adding a setting never stops an older workdir from resuming."""
  if not isinstance(tree, dict) or not isinstance(defaults, dict):
    return tree
  out = {}
  for key, value in tree.items():
    if key in defaults and _to_json(value, "fingerprint") == _to_json(defaults[key], "fingerprint"):
      continue
    value = drop_defaults(value, defaults.get(key))
    if value != {}:
      out[key] = value
  return out


def _layout(tree: Any) -> dict[str, list[int]]:
  """{key path: shape} of every array leaf (arrays, ShapeDtypeStructs, scalars)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): [int(d) for d in np.shape(leaf)] for path, leaf in leaves}


def _check_not_under_file(directory: str) -> None:
  """UserError if `directory`, or its nearest existing parent, is not a directory."""
  path = nearest_existing(directory)
  if not os.path.isdir(path):
    raise UserError(
        f"cannot keep checkpoints in {directory}: {path} is a file, not a directory; "
        "pass a --workdir that is a directory (or a new path)."
    )


def _abstract(leaf: Any) -> Any:
  """Restore target for one template leaf: jax arrays keep their sharding, numpy stays numpy."""
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf


class Checkpointer:
  """Saves and restores one run's checkpoints under `directory`; see the module docstring.

  Args:
    directory: where the step directories go (created on first use).
    keep: how many of the newest checkpoints to keep; older ones are deleted
      after each save.
    fingerprint: JSON-able dict of everything that must match to resume
      (model shapes, algorithm, critic on/off, ...). Compared after a JSON
      round trip, so tuples and lists are equal.
    defaults: the fingerprint of a run at every default; leaves equal to it
      are left out on both sides (a checkpoint written with a full
      fingerprint, or before a field existed, compares the same).

  Raises:
    UserError: `directory` already holds a checkpoint with another
      fingerprint (or one not written by this class), or it (or a parent)
      is a file; nothing is modified.
  """

  def __init__(
      self, directory: str, *, keep: int = 3, fingerprint: dict, defaults: dict | None = None
  ):
    if int(keep) < 1:
      raise ValueError(f"keep must be >= 1, got {keep}.")
    if not isinstance(fingerprint, dict):
      raise ValueError(f"fingerprint must be a dict, got {type(fingerprint).__name__}.")
    directory = os.fspath(directory)
    # Remote paths (gs://...) go to Orbax as they are.
    self.directory = directory if "://" in directory else os.path.abspath(directory)
    self.keep = int(keep)
    self.defaults = _to_json(defaults or {}, "fingerprint defaults")
    self.fingerprint = drop_defaults(_to_json(fingerprint, "fingerprint"), self.defaults)
    if "://" not in self.directory:
      _check_not_under_file(self.directory)
    # Check with a read-only manager first: the read-write one may create
    # directories, and a refused directory must stay exactly as it was.
    self._check_compatible()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self.keep, create=True, enable_async_checkpointing=False
        ),
    )

  # ------------------------------------------------------------------ queries

  def _readonly_steps(self) -> list[int]:
    if not epath.Path(self.directory).is_dir():
      return []
    with ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(read_only=True)
    ) as m:
      return sorted(m.all_steps())

  def _read_info(self, manager: ocp.CheckpointManager, step: int) -> dict | None:
    if not (epath.Path(self.directory) / str(step) / "info").is_dir():
      return None  # Not written by this class (or by an older layout).
    return manager.restore(step, args=ocp.args.Composite(info=ocp.args.JsonRestore()))["info"]

  def _check_compatible(self) -> None:
    steps = self._readonly_steps()
    if not steps:
      return
    with ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(read_only=True)
    ) as m:
      for step in reversed(steps):
        info = self._read_info(m, step)
        if info is None:
          raise UserError(
              f"{self.directory} holds a checkpoint (step {step}) that was not written by "
              "streamrl's Checkpointer; use a new --workdir."
          )
        saved = drop_defaults(info.get("fingerprint"), self.defaults)
        diff = _first_difference(saved, self.fingerprint)
        if diff is not None:
          key, was, now = diff
          raise UserError(
              f"{self.directory} holds checkpoints of an incompatible run (step {step}): "
              f"{key!s} is {json.dumps(was)} there but {json.dumps(now)} now; use a new "
              "--workdir (or the config that wrote them) — nothing there was changed."
          )

  def all_steps(self) -> list[int]:
    """Steps on disk, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest step on disk, or None for a fresh directory."""
    return self._manager.latest_step()

  # -------------------------------------------------------------- save/restore

  def save(self, step: int, arrays: Any, meta: dict) -> bool:
    """Writes checkpoint `step` and returns once it is on disk.

    Args:
      step: the training step (iteration) this state is *after*.
      arrays: pytree of jax/numpy arrays (sharded jax arrays are written by
        their owners; nnx.State and typed PRNG keys are fine).
      meta: JSON-able dict (numpy scalars are converted).

    Returns:
      True if written; False if `step` is already on disk (left untouched —
      e.g. a final save right after a periodic one).

    Raises:
      ValueError: `meta` is not JSON-able, or `step` is older than the newest
        checkpoint (keep-last-N would delete it at once).
    """
    step = int(step)
    meta_json = _to_json(meta, "meta")
    steps = self.all_steps()
    if step in steps:
      _log.info("checkpoint step %d already in %s; not saving it again", step, self.directory)
      return False
    if steps and step < steps[-1]:
      raise UserError(
          f"cannot save step {step} into {self.directory}: it already holds the newer step "
          f"{steps[-1]}; resume from it or use a new --workdir."
      )
    info = {"format": _FORMAT, "fingerprint": self.fingerprint, "layout": _layout(arrays)}
    self._manager.save(
        step,
        args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays),
            meta=ocp.args.JsonSave(meta_json),
            info=ocp.args.JsonSave(info),
        ),
        force=True,
    )
    # Synchronous by construction (async disabled), and waited on anyway: a
    # crash right after save() must never lose this checkpoint.
    self._manager.wait_until_finished()
    return True

  def restore(self, abstract_arrays: Any, step: int | None = None) -> tuple[int, Any, dict]:
    """Reads checkpoint `step` (default: the newest) onto the template's shardings.

    Args:
      abstract_arrays: pytree with the structure of the saved `arrays`; leaves
        are jax.ShapeDtypeStruct (with `sharding=`) or concrete arrays used as
        templates (jax arrays: restored with their sharding; numpy: as numpy).

    Returns:
      (step, arrays, meta).

    Raises:
      FileNotFoundError: no checkpoint (or not that step) in the directory.
      ValueError: the template's structure or shapes differ from what was
        saved; the message names the first differing array.
    """
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {self.directory}; check latest_step() before restoring."
        )
      step = steps[-1]
    elif int(step) not in steps:
      raise FileNotFoundError(
          f"no checkpoint for step {step} in {self.directory} (steps there: {steps})."
      )
    step = int(step)
    info = self._read_info(self._manager, step)
    if info is None:
      raise UserError(
          f"checkpoint step {step} in {self.directory} was not written by streamrl's "
          "Checkpointer; use a new --workdir."
      )
    diff = _first_difference(drop_defaults(info["fingerprint"], self.defaults), self.fingerprint)
    if diff is not None:  # Only reachable if files changed since __init__.
      raise UserError(
          f"checkpoint step {step} in {self.directory} has another fingerprint at {diff[0]}; "
          "use a new --workdir."
      )
    self._check_layout(info["layout"], _layout(abstract_arrays), step)
    target = jax.tree.map(_abstract, abstract_arrays)
    out = self._manager.restore(
        step,
        args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()
        ),
    )
    return step, out["arrays"], out["meta"]

  def _check_layout(
      self, saved: dict[str, list[int]], wanted: dict[str, list[int]], step: int
  ) -> None:
    for key in list(wanted) + [k for k in saved if k not in wanted]:
      if key not in saved:
        problem = "is not in the checkpoint"
      elif key not in wanted:
        problem = "is in the checkpoint but not in the restore template"
      elif list(saved[key]) != list(wanted[key]):
        problem = f"has shape {tuple(saved[key])} in the checkpoint but {tuple(wanted[key])} in the template"
      else:
        continue
      raise UserError(
          f"cannot restore step {step} from {self.directory}: array {key} {problem}; the model "
          "or optimizer changed since it was saved — use a new --workdir."
      )

  def close(self) -> None:
    self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_arrays(directory: str, step: int | None = None) -> dict[str, np.ndarray]:
  """The arrays of checkpoint `step` (default: newest) as host numpy, by key path.

  No template and no mesh needed: for inspecting or comparing checkpoints
  (e.g. of runs on different meshes or process counts).
  """
  directory = os.path.abspath(directory)
  steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
  if not steps:
    raise FileNotFoundError(f"no checkpoint in {directory}.")
  step = steps[-1] if step is None else int(step)
  path = os.path.join(directory, str(step), "arrays")
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(path)
  tree = getattr(tree, "item_metadata", tree)
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  restored = ckptr.restore(path, restore_args=args)
  leaves, _ = jax.tree_util.tree_flatten_with_path(restored)
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}
