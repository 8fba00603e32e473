"""JSONL prompt datasets for real models (GSM8K / MATH style).

One JSON object per line: `{"prompt": "...", "answer": "..."}` (the key names
are arguments, e.g. `prompt_key="question"` for raw GSM8K). A numeric answer
is turned into its string form. Blank lines are ignored.

Malformed rows — not JSON, not an object, a missing key, a prompt that is not
a non-empty string, an answer that is neither string nor number — are
**counted and skipped**, with a warning naming each line (the first
`_MAX_LINE_WARNINGS` of them, then one summary). A file that is mostly broken
is not a dataset: if more than `max_bad_fraction` (default 50%) of the rows
are malformed, or none is usable, loading stops with one sentence naming the
file, the count and the first bad line. Problems with the file itself are
`streamrl.errors.UserError`s (a missing file a `MissingFileError`, which is
also a FileNotFoundError), so a launch script prints just that sentence.
"""

from __future__ import annotations

import json
import logging
import os

from streamrl.data.tasks import Example
from streamrl.errors import MissingFileError, UserError

_log = logging.getLogger(__name__)
_MAX_LINE_WARNINGS = 10


def _parse_row(line: str, prompt_key: str, answer_key: str) -> tuple[str, str]:
  """(prompt, answer) of one line; ValueError with the reason otherwise."""
  try:
    row = json.loads(line)
  except json.JSONDecodeError as err:
    raise ValueError(f"not valid JSON ({err.msg})") from None
  if not isinstance(row, dict):
    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
  missing = [k for k in (prompt_key, answer_key) if k not in row]
  if missing:
    raise ValueError(f"missing key(s) {missing}")
  prompt, answer = row[prompt_key], row[answer_key]
  if not isinstance(prompt, str) or not prompt.strip():
    raise ValueError(f"{prompt_key!r} must be a non-empty string")
  if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
    raise ValueError(f"{answer_key!r} must be a string or a number")
  return prompt, str(answer)


def load_jsonl(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    max_bad_fraction: float = 0.5,
    first_id: int = 0,
) -> list[Example]:
  """Reads a JSONL prompt file into Examples (task="jsonl").

  Args:
    path: the .jsonl file.
    prompt_key, answer_key: field names in each row.
    max_bad_fraction: largest tolerated fraction of malformed rows, in [0, 1).
    first_id: prompt ids are `first_id, first_id + 1, ...` over the kept rows.

  Raises:
    MissingFileError: the file does not exist (a UserError and a
      FileNotFoundError).
    UserError: the path is a directory, the file is not UTF-8 text, or it
      has no rows, no usable row, or too many bad ones.
    ValueError: `max_bad_fraction` is out of range.
  """
  path = os.fspath(path)
  if os.path.isdir(path):
    raise UserError(
        f"Dataset path {path!r} is a directory; point the dataset path config key at a "
        "JSONL file."
    )
  if not os.path.isfile(path):
    raise MissingFileError(
        f"Dataset file {path!r} does not exist; point the dataset path "
        'config key at a JSONL file with one {"prompt": ..., "answer": '
        "...} object per line."
    )
  if not 0.0 <= max_bad_fraction < 1.0:
    raise ValueError(f"max_bad_fraction={max_bad_fraction} must be in [0, 1).")
  examples: list[Example] = []
  bad: list[tuple[int, str]] = []
  lineno = 0
  try:
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          prompt, answer = _parse_row(line, prompt_key, answer_key)
        except ValueError as err:
          bad.append((lineno, str(err)))
          if len(bad) <= _MAX_LINE_WARNINGS:
            _log.warning("Skipping malformed row at %s line %d: %s.", path, lineno, err)
          continue
        examples.append(
            Example(prompt_id=first_id + len(examples), prompt=prompt, answer=answer, task="jsonl")
        )
  except UnicodeDecodeError:
    raise UserError(
        f"Dataset file {path!r} is not UTF-8 text (after line {lineno}); " "save it as UTF-8 JSONL."
    ) from None
  total = len(examples) + len(bad)
  if total == 0:
    raise UserError(f"Dataset file {path!r} has no rows; add one JSON object per line.")
  if bad:
    if len(bad) > _MAX_LINE_WARNINGS:
      _log.warning(
          "Skipped %d malformed rows in %s in all (lines %s, ...).",
          len(bad),
          path,
          [n for n, _ in bad[:20]],
      )
    if not examples or len(bad) / total > max_bad_fraction:
      lineno, reason = bad[0]
      raise UserError(
          f"Dataset file {path!r} has {len(bad)} malformed rows out of "
          f"{total} (more than {max_bad_fraction:.0%}; first at line "
          f"{lineno}: {reason}); fix the file so each line is a JSON object "
          f"with string {prompt_key!r} and {answer_key!r} fields."
      )
  return examples
