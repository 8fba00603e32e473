"""JSONL loader: good file, malformed rows, missing file."""

import json
import logging

import pytest

from streamrl.data import dataset


def _write(path, lines):
  path.write_text("\n".join(lines) + "\n")
  return path


def test_good_file(tmp_path):
  rows = [
      {"prompt": "What is 2+2?", "answer": "4"},
      {"prompt": "Half of 3?", "answer": 1.5},
      {"prompt": "Seven", "answer": 7, "extra": "ignored"},
  ]
  path = _write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows] + [""])
  examples = dataset.load_file(path, first_id=10)
  assert [ex.prompt_id for ex in examples] == [10, 11, 12]
  assert [ex.answer for ex in examples] == ["4", "1.5", "7"]
  assert examples[0].prompt == "What is 2+2?"
  assert {ex.task for ex in examples} == {"file"}


def test_custom_keys(tmp_path):
  path = _write(tmp_path / "g.jsonl", [json.dumps({"question": "q?", "answer": "#### 3"})])
  examples = dataset.load_file(path, prompt_key="question")
  assert examples[0].prompt == "q?" and examples[0].answer == "#### 3"


def test_malformed_rows_are_skipped_with_line_numbers(tmp_path, caplog):
  lines = [json.dumps({"prompt": f"p{i}", "answer": str(i)}) for i in range(6)]
  lines[1] = "{not json"
  lines[3] = json.dumps({"prompt": "no answer"})
  lines.insert(4, json.dumps([1, 2]))
  lines.insert(5, json.dumps({"prompt": "", "answer": "1"}))
  path = _write(tmp_path / "d.jsonl", lines)
  caplog.set_level(logging.WARNING, logger=dataset.__name__)
  examples = dataset.load_file(path)
  assert [ex.prompt for ex in examples] == ["p0", "p2", "p4", "p5"]
  assert [ex.prompt_id for ex in examples] == [0, 1, 2, 3]
  messages = " ".join(r.getMessage() for r in caplog.records)
  for lineno in (2, 4, 5, 6):
    assert f"line {lineno}:" in messages
  assert "line 1:" not in messages and "line 3:" not in messages


def test_mostly_malformed_file_stops(tmp_path):
  lines = ["garbage"] * 3 + [json.dumps({"prompt": "p", "answer": "a"})] * 2
  path = _write(tmp_path / "d.jsonl", lines)
  with pytest.raises(ValueError, match=r"3 malformed rows out of 5.*line 1"):
    dataset.load_file(path)
  # A looser threshold accepts the same file.
  assert len(dataset.load_file(path, max_bad_fraction=0.7)) == 2


def test_all_malformed_or_empty_stops(tmp_path):
  path = _write(tmp_path / "bad.jsonl", ["nope"])
  with pytest.raises(ValueError, match="1 malformed rows out of 1"):
    dataset.load_file(path, max_bad_fraction=0.99)
  empty = tmp_path / "empty.jsonl"
  empty.write_text("\n\n")
  with pytest.raises(ValueError, match="has no rows"):
    dataset.load_file(empty)


def test_missing_file(tmp_path):
  missing = tmp_path / "nope.jsonl"
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    dataset.load_file(missing)
