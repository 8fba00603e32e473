"""Prompt datasets from files: JSONL or Parquet rows (GSM8K / MATH style).

A row is an object with a prompt and an answer under the keys `prompt_key`
and `answer_key` (`task.prompt_key`, `task.answer_key`; raw GSM8K is
`prompt_key="question"`). The prompt is a non-empty string or a chat: a list
of `{"role": ..., "content": ...}` messages, rendered with the tokenizer's
chat template (streamrl/data/tokenizer.py). A numeric answer is turned into
its string form. Every other column reaches the reward function as a keyword
(`Example.fields`); a `data_source` column also splits the accuracy by
source. `.parquet` files are read with pyarrow; anything else as JSONL (one
object per line, blank lines ignored).

Malformed rows — not JSON, not an object, a missing key, a prompt that is
neither a non-empty string nor a list of messages, an answer that is neither
string nor number — are **counted and skipped**, with a warning naming each
row (the first `_MAX_LINE_WARNINGS` of them, then one summary). A file that
is mostly broken is not a dataset: if more than `max_bad_fraction` (default
50%) of the rows are malformed, or none is usable, loading stops with one
sentence naming the file, the count and the first bad row. Problems with the
file itself are `streamrl.errors.UserError`s (a missing file a
`MissingFileError`, also a FileNotFoundError), so a launch script prints
just that sentence.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Iterator

from streamrl.data.tasks import Example
from streamrl.errors import MissingFileError, UserError

_log = logging.getLogger(__name__)
_MAX_LINE_WARNINGS = 10
TASK = "file"  # Example.task of a dataset row.
SOURCE_KEY = "data_source"


def _messages(prompt: list, key: str) -> tuple[dict, ...]:
  out = []
  for m in prompt:
    if not (
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    ):
      raise ValueError(f"{key!r} is a list but not of {{'role': str, 'content': str}} messages")
    out.append(dict(m))
  if not out:
    raise ValueError(f"{key!r} is an empty list of messages")
  return tuple(out)


def _json_safe(value: Any) -> Any:
  """Parquet cells as plain Python (numpy scalars and arrays become lists)."""
  if hasattr(value, "tolist"):
    return value.tolist()
  if isinstance(value, dict):
    return {k: _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  return value


def parse_row(row: Any, prompt_key: str, answer_key: str) -> tuple[Any, str, dict]:
  """(prompt, answer, other fields) of one row; ValueError with the reason."""
  if not isinstance(row, dict):
    raise ValueError(f"expected an object, got {type(row).__name__}")
  missing = [k for k in (prompt_key, answer_key) if k not in row]
  if missing:
    raise ValueError(f"missing key(s) {missing}")
  prompt, answer = row[prompt_key], row[answer_key]
  if isinstance(prompt, list):
    prompt = _messages(prompt, prompt_key)
  elif not isinstance(prompt, str) or not prompt.strip():
    raise ValueError(f"{prompt_key!r} must be a non-empty string or a list of chat messages")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ValueError(f"{answer_key!r} must be a string or a number")
  if isinstance(answer, float) and not math.isfinite(answer):
    raise ValueError(f"{answer_key!r} is {answer}")
  fields = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
  return prompt, str(answer), fields


def _jsonl_rows(path: str) -> Iterator[tuple[int, Any]]:
  """(line number, parsed object or the ValueError) per non-blank line."""
  lineno = 0
  try:
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
          yield lineno, ValueError(f"not valid JSON ({err.msg})")
  except UnicodeDecodeError:
    raise UserError(
        f"Dataset file {path!r} is not UTF-8 text (after line {lineno}); save it as UTF-8 JSONL."
    ) from None


def _parquet_rows(path: str) -> Iterator[tuple[int, Any]]:
  """(row number, row dict) of a Parquet file, one record batch at a time."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  try:
    reader = pq.ParquetFile(path)
  except Exception as err:  # pylint: disable=broad-except
    raise UserError(
        f"Dataset file {path!r} is not a readable Parquet file ({err}); write it with "
        "pandas.DataFrame.to_parquet or pyarrow."
    ) from None
  n = 0
  for batch in reader.iter_batches(batch_size=1024):
    for row in batch.to_pylist():
      n += 1
      yield n, _json_safe(row)


def load_file(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_bad_fraction: float = 0.5,
    first_id: int = 0,
) -> list[Example]:
  """Reads a JSONL or Parquet prompt file into Examples (task="file").

  Args:
    path: the .jsonl (any other suffix too) or .parquet file.
    prompt_key, answer_key: field names in each row.
    max_bad_fraction: largest tolerated fraction of malformed rows, in [0, 1).
    first_id: prompt ids are `first_id, first_id + 1, ...` over the kept rows.

  Raises:
    MissingFileError: the file does not exist (a UserError and a
      FileNotFoundError).
    UserError: the path is a directory, the file is unreadable, or it has no
      rows, no usable row, or too many bad ones.
    ValueError: `max_bad_fraction` is out of range.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    raise UserError(
        f"Dataset path {path!r} is a directory; point task.train_path (or task.eval_path) at "
        "a JSONL or Parquet file."
    )
  if not os.path.isfile(path):
    raise MissingFileError(
        f"Dataset file {path!r} does not exist; point task.train_path (or task.eval_path) at "
        'a JSONL file with one {"prompt": ..., "answer": ...} object per line, or a Parquet file.'
    )
  if not 0.0 <= max_bad_fraction < 1.0:
    raise ValueError(f"max_bad_fraction={max_bad_fraction} must be in [0, 1).")
  parquet = path.endswith(".parquet")
  where = "row" if parquet else "line"
  examples: list[Example] = []
  bad: list[tuple[int, str]] = []
  for n, row in _parquet_rows(path) if parquet else _jsonl_rows(path):
    try:
      if isinstance(row, ValueError):
        raise row
      prompt, answer, fields = parse_row(row, prompt_key, answer_key)
    except ValueError as err:
      bad.append((n, str(err)))
      if len(bad) <= _MAX_LINE_WARNINGS:
        _log.warning("Skipping malformed row at %s %s %d: %s.", path, where, n, err)
      continue
    source = fields.get(SOURCE_KEY)
    examples.append(
        Example(
            prompt_id=first_id + len(examples),
            prompt=prompt,
            answer=answer,
            task=TASK,
            fields=fields,
            source=str(source) if isinstance(source, (str, int)) else None,
        )
    )
  total = len(examples) + len(bad)
  if total == 0:
    raise UserError(f"Dataset file {path!r} has no rows; add one JSON object per line.")
  if bad:
    if len(bad) > _MAX_LINE_WARNINGS:
      _log.warning(
          "Skipped %d malformed rows in %s in all (%ss %s, ...).",
          len(bad),
          path,
          where,
          [k for k, _ in bad[:20]],
      )
    if not examples or len(bad) / total > max_bad_fraction:
      k, reason = bad[0]
      raise UserError(
          f"Dataset file {path!r} has {len(bad)} malformed rows out of "
          f"{total} (more than {max_bad_fraction:.0%}; first at {where} "
          f"{k}: {reason}); fix the file so each row is an object "
          f"with a {prompt_key!r} (string or chat messages) and a {answer_key!r} field."
      )
  return examples
