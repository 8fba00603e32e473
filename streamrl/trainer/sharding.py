"""The mesh and the logical -> physical axis mapping.

Model parameters carry logical axis names (`logical_axes` metadata); the
config says how big each mesh axis is and which mesh axes each logical name
is split over. Everything about placement lives here and in the config.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from streamrl.models import lora

MESH_AXES = ("data", "fsdp", "tensor")

# Data parallel over (data, fsdp); parameters fully sharded over fsdp on their
# embed dimension and split over tensor on heads / MLP width (Megatron style).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("norm", None),
)


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence | None = None) -> Mesh:
  """A Mesh with axes (data, fsdp, tensor); a size of -1 takes what is left.

  In one process, fixed sizes whose product is below the device count use
  the first devices; across processes the mesh must cover every device.
  """
  devices = list(devices if devices is not None else jax.devices())
  unknown = set(axis_sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f"Unknown mesh axes {sorted(unknown)}; use {MESH_AXES}.")
  sizes = [int(axis_sizes.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError("At most one mesh axis may be -1.")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices can't be split into mesh {dict(axis_sizes)}.")
    sizes[sizes.index(-1)] = len(devices) // known
  need = int(np.prod(sizes))
  if need < len(devices) and jax.process_count() == 1:
    # A fixed mesh smaller than the host: train on its first devices (a
    # debugging run on part of a machine; tests on 1 of 8 faked CPU devices).
    devices = devices[:need]
  if need != len(devices):
    raise ValueError(
        f"Mesh {dict(zip(MESH_AXES, sizes))} needs {need} devices but "
        f"{len(devices)} are available; change config.mesh so the sizes multiply to "
        f"{len(devices)}."
    )
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None], rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> P:
  """Maps logical axis names to a PartitionSpec.

  A mesh axis is used at most once per array, and a dimension that does not
  divide evenly by its mesh axes stays replicated (tiny models on 8 devices).
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(axes):
    target = table.get(name) if name is not None else None
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    targets = tuple(t for t in targets if t not in used and mesh.shape[t] > 1)
    size = int(np.prod([mesh.shape[t] for t in targets])) if targets else 1
    if not targets or (shape is not None and shape[i] % size):
      out.append(None)
      continue
    used.update(targets)
    out.append(targets[0] if len(targets) == 1 else targets)
  return P(*out)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for every variable of an nnx State, from its logical axes."""

  def one(var):
    axes = var.get_metadata().get("logical_axes")
    value = var.get_value()
    if axes is None:
      return var.replace(NamedSharding(mesh, P()))
    return var.replace(NamedSharding(mesh, logical_to_spec(axes, rules, mesh, value.shape)))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_module(module: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.Module:
  """Places a module's variables on the mesh according to their logical axes.

  In place, one variable at a time: each variable's host array is dropped as
  soon as its placed copy exists, so placing a loaded checkpoint holds one
  whole copy of the weights plus one tensor, never two whole copies (the
  caller must hold no other reference to the arrays). Returns `module`."""
  shardings = dict(nnx.to_flat_state(state_shardings(nnx.state(module), mesh, rules)))
  for path, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Variable) and path in shardings:
      var.value = jax.device_put(var.value, shardings[path].value)
  return module


def init_sharded(build, mesh: Mesh, *args, rules=DEFAULT_RULES) -> nnx.Module:
  """`build(*args)` (a new module), created directly in its sharding.

  The module is traced abstractly first (nnx.eval_shape) to read its
  variables' logical axes; then one jit with those out_shardings runs the
  constructor, so each device only ever holds its own shards -- there is
  never a full unsharded copy on one device. `args` (arrays or nnx State,
  e.g. weights to copy in) keep the sharding they have.

  Randomness must come in through `args` (a key, see `random_init`): a key
  made inside `build` is a compile-time constant, and XLA would evaluate the
  whole random initialisation while compiling (constant folding).
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(build, *args))
  shardings = state_shardings(abstract, mesh, rules)
  state = jax.jit(lambda *a: nnx.state(build(*a)), out_shardings=shardings)(*args)
  return nnx.merge(graphdef, state)


def random_init(build, mesh: Mesh, seed: int, initializer, rules=DEFAULT_RULES) -> nnx.Module:
  """The module `build(rngs)` makes, with fresh random weights from `seed`,
  each parameter created directly in its sharding.

  Parameter i is `initializer(name)(fold_in(key(seed), i), shape, dtype)`,
  made by a small jitted program per distinct (initializer, shape, dtype,
  sharding) with the key a traced argument: nothing is a compile-time
  constant, so XLA has nothing to fold, and a model compiles only as many
  programs as it has distinct parameter shapes (one program for the whole
  constructor would compile every parameter's random generator).
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
  shardings = state_shardings(abstract, mesh, rules)
  key = jax.random.key(seed)
  index = iter(range(1 << 30))

  def one(path, var, sharding_var):
    name = next(k.key for k in reversed(path) if isinstance(getattr(k, "key", None), str))
    value = var.get_value()
    make = _leaf_init(initializer(name), value.shape, value.dtype, sharding_var.get_value())
    return var.replace(make(key, np.uint32(next(index))))

  is_var = lambda x: isinstance(x, nnx.Variable)
  state = jax.tree_util.tree_map_with_path(one, abstract, shardings, is_leaf=is_var)
  return nnx.merge(graphdef, state)


@functools.lru_cache(maxsize=None)
def _leaf_init(init, shape, dtype, sharding):
  return jax.jit(
      lambda key, i: init(jax.random.fold_in(key, i), shape, dtype), out_shardings=sharding
  )


def batch_sharding(
    mesh: Mesh, ndim: int, rules=DEFAULT_RULES, shape: Sequence[int] | None = None
) -> NamedSharding:
  """Shards the leading (batch) dimension over the data-parallel axes
  (replicated when `shape` says the batch doesn't divide evenly)."""
  spec = logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh, shape)
  return NamedSharding(mesh, spec)


def adapter_shardings(adapters: Mapping, params) -> dict:
  """`adapters` (`lora.init_adapters`) placed like the weights they adapt.

  `a` [in, r] is split as the weight's first input dimension and `b` [r, out]
  as its first output dimension (where it divides evenly): the placement the
  train step's outputs take, so a fresh or restored adapter runs the same
  programs, with the same sums, as a trained one. `params` is the policy's
  parameter State; unsharded weights leave the adapter as it is.
  """
  out = {}
  for key, ab in adapters.items():
    layer, target = key.split(".")
    module, name, n_in, _ = lora.TARGETS[target]
    weight = params["trunk"]["blocks"][int(layer)][module][name]
    s = getattr(weight, "value", weight).sharding
    if not isinstance(s, NamedSharding):
      out[key] = ab
      continue
    spec = tuple(s.spec) + (None,) * (len(weight.shape) - len(s.spec))
    out[key] = {
        "a": _split_one(ab["a"], s.mesh, spec[0], 0),
        "b": _split_one(ab["b"], s.mesh, spec[n_in], 1),
    }
  return out


def _split_one(x: jax.Array, mesh: Mesh, axes, dim: int) -> jax.Array:
  """`x` [m, n] on `mesh`, split over mesh `axes` along `dim` where it divides evenly."""
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  size = int(np.prod([mesh.shape[m] for m in names]))
  parts = [None, None]
  if names and x.shape[dim] % size == 0:
    parts[dim] = axes
  return jax.device_put(x, NamedSharding(mesh, P(*parts)))
