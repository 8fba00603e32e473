"""Prompt datasets from files: JSONL, Parquet or Arrow rows (GSM8K / MATH style).

A row is an object with a prompt and an answer under the keys `prompt_key`
and `answer_key` (`task.prompt_key`, `task.answer_key`; raw GSM8K is
`prompt_key="question"`). A key may be a dotted path into nested columns
(verl's `reward_model.ground_truth`), and `answer_key` may be empty for rows
without a reference answer (format or judge rewards). The prompt is a
non-empty string or a chat: a list of `{"role": ..., "content": ...}`
messages, rendered with the tokenizer's chat template
(streamrl/data/tokenizer.py). A string or numeric answer becomes its string
form; a list or an object (search and tool tasks) is passed on as it is.
Every other top-level column reaches the reward function (`Example.fields`;
which of them a function receives depends on its signature,
streamrl/data/reward_conventions.py); a `data_source` column also splits the accuracy
by source.

A path (`task.train_path`, `task.eval_path`) is a file, a directory of
`.parquet` / `.jsonl` shards, several of these comma-separated, or a
directory `datasets.save_to_disk` wrote (its Arrow files, read with pyarrow).
`.parquet` files are read with pyarrow; `.arrow` files as Arrow IPC streams;
anything else as JSONL (one object per line, blank lines ignored).

Malformed rows — not JSON, not an object, a missing key, a prompt that is
neither a non-empty string nor a list of messages, a null or non-finite
answer — are **counted and skipped**, with a warning naming each row (the
first `_MAX_LINE_WARNINGS` of them, then one summary). A file that is mostly
broken is not a dataset: if more than `max_bad_fraction` (default 50%) of
the rows are malformed, or none is usable, loading stops with one sentence
naming the file, the count and the first bad row. Problems with the file
itself are `streamrl.errors.UserError`s (a missing file a
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
# task.truncation: what becomes of a prompt too long for the model (loader.fit_prompts).
TRUNCATION_MODES = ("drop", "left", "right", "middle", "error")


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


def lookup(row: dict, key: str) -> Any:
  """`row[key]`, or for a dotted key (`reward_model.ground_truth`) the value
  down that path of nested objects; KeyError when a step is missing. A column
  whose own name has a dot is found first."""
  if key in row:
    return row[key]
  value: Any = row
  for part in key.split("."):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(key)
    value = value[part]
  return value


def parse_row(row: Any, prompt_key: str, answer_key: str) -> tuple[Any, Any, dict]:
  """(prompt, answer, other fields) of one row; ValueError with the reason.

  `prompt_key` and `answer_key` may be dotted paths into nested columns. A
  string or number answer comes back as a string (what the built-in rewards
  compare); a list, an object or a bool comes back as it is (plain Python,
  JSON-safe) for the user's reward; an empty `answer_key` (no reference
  answer) gives None. The fields are the row's other top-level columns: a
  column the prompt or answer was found inside (`reward_model`) stays among
  them, a column that was the prompt or the answer itself does not.
  """
  if not isinstance(row, dict):
    raise ValueError(f"expected an object, got {type(row).__name__}")
  keys = [k for k in (prompt_key, answer_key) if k]
  missing = []
  values = {}
  for k in keys:
    try:
      values[k] = lookup(row, k)
    except KeyError:
      missing.append(k)
  if missing:
    raise ValueError(f"missing key(s) {missing}")
  prompt = values[prompt_key]
  if isinstance(prompt, list):
    prompt = _messages(prompt, prompt_key)
  elif not isinstance(prompt, str) or not prompt.strip():
    raise ValueError(f"{prompt_key!r} must be a non-empty string or a list of chat messages")
  answer = values[answer_key] if answer_key else None
  if answer_key and answer is None:
    raise ValueError(f"{answer_key!r} is null")
  if isinstance(answer, float) and not math.isfinite(answer):
    raise ValueError(f"{answer_key!r} is {answer}")
  if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
    answer = str(answer)
  fields = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
  return prompt, answer, fields


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


def _arrow_rows(path: str) -> Iterator[tuple[int, Any]]:
  """(row number, row dict) of an Arrow file `datasets.save_to_disk` wrote
  (the IPC stream format; the IPC file format is read too)."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top

  try:
    source = pa.memory_map(path)
    try:
      reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
      source.seek(0)
      reader = pa.ipc.open_file(source)
      batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
      batches = iter(reader)
  except Exception as err:  # pylint: disable=broad-except
    raise UserError(
        f"Dataset file {path!r} is not a readable Arrow file ({err}); save the dataset again "
        "with datasets.Dataset.save_to_disk or to_parquet."
    ) from None
  n = 0
  for batch in batches:
    for row in batch.to_pylist():
      n += 1
      yield n, _json_safe(row)


_SHARD_SUFFIXES = (".parquet", ".jsonl")
_SETTING = "task.train_path (or task.eval_path)"


def _saved_dataset_files(path: str) -> list[str]:
  """The Arrow files of a `datasets.save_to_disk` directory, in order."""
  if os.path.isfile(os.path.join(path, "dataset_dict.json")):
    splits = sorted(
        d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "state.json"))
    )
    raise UserError(
        f"Dataset path {path!r} holds a DatasetDict (splits {splits}); point {_SETTING} at "
        f"one split's directory, e.g. {os.path.join(path, splits[0] if splits else 'train')!r}."
    )
  with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
    state = json.load(f)
  names = [d.get("filename") for d in state.get("_data_files", []) if isinstance(d, dict)]
  if not names:
    names = sorted(n for n in os.listdir(path) if n.endswith(".arrow"))
  files = [os.path.join(path, n) for n in names if n]
  missing = [f for f in files if not os.path.isfile(f)]
  if not files or missing:
    raise UserError(
        f"Dataset directory {path!r} was written by datasets.save_to_disk but its Arrow files "
        f"{[os.path.basename(f) for f in missing] or '(none)'} are missing; save it again."
    )
  return files


def resolve_paths(spec: str | os.PathLike) -> list[str]:
  """The data files a `task.train_path` / `task.eval_path` value names.

  The value is one path or several, comma-separated (verl's `train_files`);
  each is a `.parquet` or JSONL file, a directory of `.parquet` / `.jsonl`
  shards (read in name order), or a directory `datasets.save_to_disk` wrote
  (its Arrow files, from its state.json).

  Raises:
    MissingFileError: a path does not exist.
    UserError: a directory holds no data files, or a saved dataset is
      incomplete or a DatasetDict.
  """
  spec = os.fspath(spec)
  parts = [p.strip() for p in spec.split(",")] if "," in spec else [spec]
  if not all(parts):
    raise UserError(
        f"Dataset path list {spec!r} has an empty entry; separate the files with single "
        f"commas in {_SETTING}."
    )
  files: list[str] = []
  for path in parts:
    if os.path.isdir(path):
      if os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(
          os.path.join(path, "dataset_dict.json")
      ):
        files.extend(_saved_dataset_files(path))
        continue
      shards = sorted(n for n in os.listdir(path) if n.endswith(_SHARD_SUFFIXES))
      if not shards:
        raise UserError(
            f"Dataset directory {path!r} has no .parquet or .jsonl files (nor a "
            f"datasets.save_to_disk state.json); point {_SETTING} at the files, or at a "
            "directory holding them."
        )
      files.extend(os.path.join(path, n) for n in shards)
    elif os.path.isfile(path):
      files.append(path)
    else:
      raise MissingFileError(
          f"Dataset file {path!r} does not exist; point {_SETTING} at a JSONL file with one "
          '{"prompt": ..., "answer": ...} object per line, a Parquet file, a directory of '
          "them, or a datasets.save_to_disk directory."
      )
  return files


def _rows(path: str) -> tuple[str, Iterator[tuple[int, Any]]]:
  if path.endswith(".parquet"):
    return "row", _parquet_rows(path)
  if path.endswith(".arrow"):
    return "row", _arrow_rows(path)
  return "line", _jsonl_rows(path)


def load_file(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_bad_fraction: float = 0.5,
    first_id: int = 0,
) -> list[Example]:
  """Reads JSONL, Parquet or Arrow prompt files into Examples (task="file").

  Args:
    path: what `resolve_paths` reads: a .jsonl (any other suffix too),
      .parquet or saved-dataset file or directory, or several, comma-separated.
    prompt_key, answer_key: columns (dotted paths into nested ones) of each
      row; an empty `answer_key` when the rows have no reference answer.
    max_bad_fraction: largest tolerated fraction of malformed rows, in [0, 1).
    first_id: prompt ids are `first_id, first_id + 1, ...` over the kept rows.

  Raises:
    MissingFileError: a file does not exist (a UserError and a
      FileNotFoundError).
    UserError: a directory without data files, an unreadable file, or no
      rows, no usable row, or too many bad ones.
    ValueError: `max_bad_fraction` is out of range.
  """
  if not 0.0 <= max_bad_fraction < 1.0:
    raise ValueError(f"max_bad_fraction={max_bad_fraction} must be in [0, 1).")
  spec = os.fspath(path)
  files = resolve_paths(spec)
  examples: list[Example] = []
  bad: list[tuple[str, str]] = []
  for file in files:
    where, rows = _rows(file)
    for n, row in rows:
      try:
        if isinstance(row, ValueError):
          raise row
        prompt, answer, fields = parse_row(row, prompt_key, answer_key)
      except ValueError as err:
        at = f"{where} {n}" if len(files) == 1 else f"{file} {where} {n}"
        bad.append((at, str(err)))
        if len(bad) <= _MAX_LINE_WARNINGS:
          _log.warning("Skipping malformed row at %s %s %d: %s.", file, where, n, err)
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
  name = "Dataset file" if len(files) == 1 else "Dataset"
  if total == 0:
    raise UserError(f"{name} {spec!r} has no rows; add one JSON object per line.")
  if bad:
    if len(bad) > _MAX_LINE_WARNINGS:
      _log.warning(
          "Skipped %d malformed rows in %s in all (%s, ...).",
          len(bad),
          spec,
          [k for k, _ in bad[:20]],
      )
    if not examples or len(bad) / total > max_bad_fraction:
      at, reason = bad[0]
      answer = f" and a {answer_key!r} field" if answer_key else ""
      raise UserError(
          f"{name} {spec!r} has {len(bad)} malformed rows out of "
          f"{total} (more than {max_bad_fraction:.0%}; first at {at}: {reason}); fix the "
          f"file so each row is an object with a {prompt_key!r} (string or chat messages)"
          f"{answer}, or point task.prompt_key / task.answer_key at the right columns "
          "(dotted for nested ones)."
      )
  return examples
