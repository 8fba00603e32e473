"""The small checks each part's config runs on its own fields.

Every part of a run owns a frozen dataclass of its settings next to the code
that reads it (`streamrl/rl/config.py`, `streamrl/trainer/config.py`, ...).
Its field `x` of part `p` is the config key `p.x` (`--config.p.x=...`), and
its `check()` validates the fields with these helpers, each failing with one
sentence that names the key and the fix. Rules that relate two parts live in
`streamrl/settings.py` (`CROSS_PART_RULES`).
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
