"""JSONL loader: good file, malformed rows, missing file."""

import json
import logging

import pytest

from streamrl.data import dataset

pytestmark = [pytest.mark.unit]


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


def test_parquet_rows_with_chat_prompts_and_columns_for_the_reward(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  table = pa.table(
      {
          "question": [json.dumps(None), "Half of 3?", "Seven"],
          "messages": [chat, [{"role": "user", "content": "1+1?"}], None],
          "solution": ["4", "1.5", "7"],
          "data_source": ["gsm", "math", "gsm"],
          "level": [1, 2, 3],
      }
  )
  pq.write_table(table, tmp_path / "d.parquet")
  examples = dataset.load_file(
      tmp_path / "d.parquet", prompt_key="messages", answer_key="solution", max_bad_fraction=0.4
  )
  # The third row's prompt is null: counted and skipped like a bad JSONL line.
  assert [ex.prompt_id for ex in examples] == [0, 1]
  assert examples[0].prompt == tuple(chat) and examples[1].answer == "1.5"
  assert examples[0].fields == {"question": "null", "data_source": "gsm", "level": 1}
  assert [ex.source for ex in examples] == ["gsm", "math"]
  assert {ex.task for ex in examples} == {"file"}


def test_a_jsonl_chat_prompt_must_be_messages(tmp_path):
  rows = [
      {"prompt": [{"role": "user", "content": "hi"}], "answer": "a"},
      {"prompt": [{"role": "user"}], "answer": "b"},
      {"prompt": [], "answer": "c"},
      {"prompt": "plain", "answer": "d", "meta": {"k": [1, 2]}},
  ]
  path = _write(tmp_path / "c.jsonl", [json.dumps(r) for r in rows])
  examples = dataset.load_file(path)
  assert [ex.answer for ex in examples] == ["a", "d"]
  assert examples[1].fields == {"meta": {"k": [1, 2]}}


def test_a_parquet_path_that_is_not_parquet_is_a_user_error(tmp_path):
  from streamrl.errors import UserError

  (tmp_path / "x.parquet").write_text("not parquet")
  with pytest.raises(UserError, match="not a readable Parquet file"):
    dataset.load_file(tmp_path / "x.parquet")


def test_eval_rows_come_from_their_own_file(tmp_path):
  from streamrl.config import settings
  from streamrl.trainer import setup

  for name, n in (("train", 30), ("test", 5)):
    rows = [{"q": f"{name} {i}", "a": str(i)} for i in range(n)]
    _write(tmp_path / f"{name}.jsonl", [json.dumps(r) for r in rows])
  s = settings.Settings()
  task = dict(kind="file", prompt_key="q", answer_key="a", num_eval=3)
  s = s.replace(task=settings.Task(train_path=str(tmp_path / "train.jsonl"), **task))
  train_ex, eval_ex = setup.load_examples(s)
  assert len(train_ex) == 27 and [e.prompt for e in eval_ex] == ["train 0", "train 1", "train 2"]
  s = s.replace(
      task=settings.Task(
          train_path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "test.jsonl"), **task
      )
  )
  train_ex, eval_ex = setup.load_examples(s)
  assert len(train_ex) == 30 and [e.prompt for e in eval_ex] == ["test 0", "test 1", "test 2"]
  assert {e.prompt_id for e in train_ex}.isdisjoint(e.prompt_id for e in eval_ex)
