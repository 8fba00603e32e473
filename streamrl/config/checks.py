"""The small checks each part's config runs on its own fields, and the one type check.

Every part of a run owns a frozen dataclass of its settings next to the code
that reads it (`streamrl/rl/config.py`, `streamrl/trainer/config.py`, ...).
Its field `x` of part `p` is the config key `p.x` (`--config.p.x=...`), and
its `check()` validates the fields with these helpers, each failing with one
sentence that names the key and the fix. Rules that relate two parts live in
`streamrl/config/settings.py` (`CROSS_PART_RULES`). `coerce` is the one
routine that checks a typed value against a field's type, for the settings
and for overrides alike.
"""

from __future__ import annotations

from typing import Any, Iterable

from streamrl.errors import UserError


def need(ok: bool, message: str) -> None:
  """UserError(`message`) unless `ok`."""
  if not ok:
    raise UserError(message)


def one_of(key: str, value: Any, options: Iterable) -> None:
  options = tuple(options)
  need(value in options, f"{key}={value!r} is unknown; use one of {options}.")


def positive(key: str, value: float, *, zero_ok: bool = False) -> None:
  ok = value >= 0 if zero_ok else value > 0
  need(ok, f"{key}={value!r} must be {'>= 0' if zero_ok else '> 0'}; fix --config.{key}.")


def in_range(key: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
  """`low <= value <= high` (`low < value` when `low_open`)."""
  ok = (low < value if low_open else low <= value) and value <= high
  bracket = "(" if low_open else "["
  need(ok, f"{key}={value!r} must be in {bracket}{low}, {high}]; fix --config.{key}.")


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple}


def coerce(value: Any, want: type | str) -> Any:
  """`value` as a field of type `want` (a type, or its name as a dataclass
  annotation reads under `from __future__ import annotations`), strictly: an
  int becomes a float and a list a tuple where those are wanted, and
  nothing else changes type (no bool for a number, no float for an int).
  Values for other types pass unchanged.

  Raises:
    TypeError: `value` is not of type `want`.
  """
  want = _TYPES.get(want, want)
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if want is tuple and isinstance(value, list):
    return tuple(value)
  if want in (int, float, str, bool, tuple):
    if (want is not bool and isinstance(value, bool)) or not isinstance(value, want):
      raise TypeError(f"{value!r} is not {want.__name__}")
  return value
