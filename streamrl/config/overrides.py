"""Overrides of a run config: `key=value` strings or a mapping, checked against its fields.

  config = apply_overrides(get_config(), ["optimizer.lr=3e-6", "trainer.num_iterations=2"])
  config = apply_overrides(config, {"kl.coef": 0.0})

String overrides are parsed the way `config_flags.DEFINE_config_file` parses
`--config.key=value` (by the type of the field being overridden: absl's
int/float/bool parsers, tuples from "(1, 8)" or "1", strings as they are);
two additions: a field that is None takes any Python literal, and "None" sets
such a field back to None. Index paths (`a.b[0]`) are not supported here.
Typed values are checked by `checks.coerce`, the same routine that checks a
config's values against the settings. A bad key or value is a `UserError`
(also a ValueError) of one sentence naming the fix.
"""

from __future__ import annotations

import ast
import copy
import difflib
from typing import Any, Mapping, Sequence

import ml_collections
from absl import flags
from ml_collections.config_flags import tuple_parser

from streamrl.config import renames
from streamrl.config.checks import coerce
from streamrl.errors import UserError

_NoneType = type(None)
_TYPE_NAMES = {
    int: "an int",
    float: "a float",
    bool: "a bool (true/false)",
    str: "a string",
    tuple: "a tuple like '(1, 8)'",
}


def is_node(x: Any) -> bool:
  return isinstance(x, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict, dict))


def all_keys(node: Any, prefix: str = "") -> list[str]:
  """Every dotted path in `node`: sub-dicts and leaves."""
  out = []
  for key in node.keys():
    path = f"{prefix}{key}"
    out.append(path)
    if is_node(node[key]):
      out.extend(all_keys(node[key], path + "."))
  return out


def _unknown_key(config: Any, key: str) -> UserError:
  parts = key.split(".")
  node, depth = config, 0  # Deepest existing ancestor of the key.
  while (
      depth < len(parts) - 1
      and is_node(node)
      and parts[depth] in node
      and is_node(node[parts[depth]])
  ):
    node, depth = node[parts[depth]], depth + 1
  prefix = ".".join(parts[:depth])
  if depth < len(parts) - 1 and is_node(node) and parts[depth] in node:
    leaf = ".".join(parts[: depth + 1])
    return UserError(f"unknown config key {key!r}; {leaf} is a value, not a group of keys.")
  # Siblings first: a shared "trainer." prefix would make any trainer.* key look close.
  close = []
  if depth == len(parts) - 1:
    close = [
        f"{prefix}.{m}" if prefix else m
        for m in difflib.get_close_matches(parts[-1], list(node.keys()), n=3, cutoff=0.6)
    ]
  if not close:  # A misplaced or misspelled parent: match the last component anywhere.
    by_last: dict[str, list[str]] = {}
    for k in all_keys(config):
      by_last.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    for m in difflib.get_close_matches(parts[-1], list(by_last), n=3, cutoff=0.6):
      close.extend(by_last[m])
    close = close[:3]
  if close:
    return UserError(f"unknown config key {key!r}; did you mean {', '.join(close)}?")
  names = sorted(node.keys())
  shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
  where = f"under {prefix}" if prefix else "at the top level"
  return UserError(f"unknown config key {key!r}; the keys {where} are: {shown}.")


def locate(config: Any, key: str) -> tuple[Any, str]:
  """(parent node, leaf name) of dotted `key`, or ValueError naming close keys."""
  parts = key.split(".")
  if not all(parts):
    raise UserError(f"malformed config key {key!r}; use dotted names like optimizer.lr.")
  node = config
  for i, part in enumerate(parts):
    if not is_node(node) or part not in node:
      raise _unknown_key(config, key)
    if i == len(parts) - 1:
      return node, part
    node = node[part]
  raise AssertionError("unreachable")


def field_type(node: Any, name: str) -> type:
  if isinstance(node, ml_collections.ConfigDict):
    return node.get_type(name)  # FieldReference(None, field_type=str) -> str
  return type(node[name])


def _wrong_type(key: str, want: type, got: Any, current: Any) -> UserError:
  want_name = _TYPE_NAMES.get(want, f"a {getattr(want, '__name__', want)}")
  return UserError(f"cannot set {key} to {got!r}: it expects {want_name} (currently {current!r}).")


def _parse_string(key: str, raw: str, want: type, current: Any) -> Any:
  """Parses `raw` for a field of type `want` the way config_flags does."""
  if current is None and raw in ("None", "none"):
    return None
  try:
    if want is bool:
      return flags.BooleanParser().parse(raw)
    if want is int:
      return flags.IntegerParser().parse(raw)
    if want is float:
      return flags.FloatParser().parse(raw)
    if want is tuple:
      return tuple_parser.TupleParser().parse(raw)
    if want is str:
      return raw
  except (ValueError, TypeError, SyntaxError):
    raise _wrong_type(key, want, raw, current) from None
  if want is _NoneType or want is object:
    try:
      return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      return raw  # Like config_flags: an unparsable literal is a string.
  if isinstance(want, type) and issubclass(want, (ml_collections.ConfigDict, dict)):
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = None
    if not isinstance(value, dict):
      raise _wrong_type(key, dict, raw, current)
    return value
  return raw  # Anything else (enums, ...): let ConfigDict's own type check decide.


def _check_value(key: str, value: Any, want: type, current: Any) -> Any:
  """A typed (not string) override, checked strictly by `checks.coerce`."""
  if value is None:
    return None  # ConfigDict itself refuses None where the field does not allow it.
  try:
    return coerce(value, want)
  except TypeError:
    raise _wrong_type(key, want, value, current) from None


def _has(config: Any, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not is_node(node) or part not in node:
      return False
    node = node[part]
  return True


def renamed(config: Any, key: str) -> str:
  """`key`, or its new name when it is a key renamed in 0.1 (streamrl/config/renames.py)
  that `config` only has under the new name (printing one line that says so)."""
  new = renames.OLD_TO_NEW.get(key)
  if new is None or _has(config, key) or not _has(config, new):
    return key
  return renames.new_key(key)


def _split_override(item: str) -> tuple[str, str]:
  if not isinstance(item, str) or "=" not in item:
    raise UserError(f"override {item!r} must look like key=value, e.g. optimizer.lr=3e-6.")
  key, raw = item.split("=", 1)
  return key.strip(), raw


def apply_overrides(
    config: ml_collections.ConfigDict, overrides: Sequence[str] | Mapping[str, Any]
) -> ml_collections.ConfigDict:
  """A copy of `config` with overrides applied; `config` itself is untouched.

  Args:
    config: the base config (locked or not; no new keys can be added either way).
    overrides: ["optimizer.lr=3e-6", ...] strings parsed by field type, or a
      {"optimizer.lr": 3e-6} mapping of Python values (a string value for a
      non-string field is parsed like the command line).

  Raises:
    ValueError: one sentence naming an unknown key and its nearest valid keys,
      or a key, the type it expects and the value that was given.
  """
  from_strings = not isinstance(overrides, Mapping)
  items = [_split_override(o) for o in overrides] if from_strings else list(overrides.items())
  out = copy.deepcopy(config)
  for key, value in items:
    key = renamed(out, key)
    parent, name = locate(out, key)
    want = field_type(parent, name)
    current = parent[name]
    if isinstance(value, str) and (from_strings or want is not str):
      value = _parse_string(key, value, want, current)
    else:
      value = _check_value(key, value, want, current)
    try:
      parent[name] = value
    except (TypeError, ValueError) as e:
      raise UserError(f"cannot set {key} to {value!r}: {e}") from None
  return out
