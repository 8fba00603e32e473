"""Users' datasets and rewards as verl and TRL write them: nested columns, shard
directories and saved datasets, the three reward signatures, a list of
weighted rewards, the probe before the run, the error-rate stop, prompts too
long for the model, and the chat template's extra variables."""

import json
import logging
import os
import textwrap

import numpy as np
import pytest

from streamrl.config import settings
from streamrl.data import dataset, loader, reward_conventions, rewards
from streamrl.data.tasks import Example
from streamrl.errors import MissingFileError, UserError

pytestmark = [pytest.mark.unit]


def _verl_rows(n=6):
  """GSM8K rows the way verl's preprocessing lays them out: a chat prompt, the
  reference under reward_model, the split and index under extra_info."""
  rows = []
  for i in range(n):
    rows.append(
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Tom has {i} apples and buys 3. How many?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 3)},
            "extra_info": {"split": "train", "index": i},
        }
    )
  return rows


def _write_parquet(path, rows):
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


def _save_to_disk(directory, rows):
  """A directory as `datasets.Dataset.save_to_disk` leaves it: Arrow IPC
  stream shards, dataset_info.json and state.json listing the shards."""
  import pyarrow as pa

  os.makedirs(directory)
  table = pa.Table.from_pylist(rows)
  names = []
  for k, part in enumerate((table.slice(0, len(rows) // 2), table.slice(len(rows) // 2))):
    names.append(f"data-{k:05d}-of-00002.arrow")
    with pa.OSFile(os.path.join(directory, names[-1]), "wb") as sink:
      with pa.ipc.new_stream(sink, part.schema) as writer:
        writer.write_table(part)
  with open(os.path.join(directory, "dataset_info.json"), "w") as f:
    json.dump({"features": {}}, f)
  with open(os.path.join(directory, "state.json"), "w") as f:
    json.dump({"_data_files": [{"filename": n} for n in names], "_split": "train"}, f)
  return directory


# -------------------------------------------------------------------- data
def test_verl_rows_load_with_a_dotted_answer_key_and_keep_the_parent(tmp_path):
  path = _write_parquet(tmp_path / "gsm8k.parquet", _verl_rows())
  examples = dataset.load_file(path, answer_key="reward_model.ground_truth")
  assert [e.answer for e in examples] == ["3", "4", "5", "6", "7", "8"]
  first = examples[0]
  assert first.prompt == ({"role": "user", "content": "Tom has 0 apples and buys 3. How many?"},)
  assert first.fields["reward_model"] == {"style": "rule", "ground_truth": "3"}
  assert first.fields["extra_info"] == {"split": "train", "index": 0}
  assert "prompt" not in first.fields and first.source == "openai/gsm8k"
  # The old failure: a top-level key that is not there names the key.
  with pytest.raises(UserError, match=r"missing key\(s\) \['ground_truth'\]"):
    dataset.load_file(path, answer_key="ground_truth")


def test_non_scalar_answers_pass_through_and_no_answer_is_allowed(tmp_path):
  rows = [
      {"prompt": "find it", "gt": {"target": ["a", "b"], "k": 2}},
      {"prompt": "call the tool", "gt": [1, 2, 3]},
      {"prompt": "is it so", "gt": True},
  ]
  path = tmp_path / "d.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows))
  examples = dataset.load_file(path, answer_key="gt")
  assert [e.answer for e in examples] == [{"target": ["a", "b"], "k": 2}, [1, 2, 3], True]
  json.dumps([e.answer for e in examples])  # JSON-safe
  none = dataset.load_file(path, answer_key="")
  assert [e.answer for e in none] == [None] * 3 and none[0].fields == {"gt": rows[0]["gt"]}


def test_paths_take_shard_directories_lists_and_saved_datasets(tmp_path):
  rows = [{"question": f"q{i}", "answer": str(i)} for i in range(8)]
  shards = tmp_path / "shards"
  shards.mkdir()
  _write_parquet(shards / "part-0.parquet", rows[:3])
  (shards / "part-1.jsonl").write_text("\n".join(json.dumps(r) for r in rows[3:5]))
  (shards / "README.md").write_text("not data")
  saved = _save_to_disk(str(tmp_path / "saved"), rows[5:])
  keys = dict(prompt_key="question")
  assert [e.prompt for e in dataset.load_file(shards, **keys)] == [f"q{i}" for i in range(5)]
  assert [e.answer for e in dataset.load_file(saved, **keys)] == ["5", "6", "7"]
  both = dataset.load_file(f"{shards / 'part-0.parquet'},{saved}", first_id=100, **keys)
  assert [e.prompt for e in both] == ["q0", "q1", "q2", "q5", "q6", "q7"]
  assert [e.prompt_id for e in both] == list(range(100, 106))


def test_each_bad_path_gets_its_own_sentence(tmp_path):
  (tmp_path / "empty").mkdir()
  with pytest.raises(UserError, match=r"has no \.parquet or \.jsonl files"):
    dataset.load_file(tmp_path / "empty")
  (tmp_path / "ok.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}))
  with pytest.raises(MissingFileError, match="nope.parquet' does not exist"):
    dataset.load_file(f"{tmp_path / 'ok.jsonl'},{tmp_path / 'nope.parquet'}")
  with pytest.raises(UserError, match="empty entry"):
    dataset.resolve_paths("a.jsonl,,b.jsonl")
  splits = tmp_path / "dict"
  _save_to_disk(str(splits / "train"), [{"prompt": "p", "answer": "a"}] * 2)
  (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
  with pytest.raises(UserError, match=r"DatasetDict .*'train'.*dict/train"):
    dataset.load_file(splits)
  # The settings check the same paths before anything starts.
  task = settings.Task(kind="file", train_path=str(tmp_path / "empty"))
  with pytest.raises(UserError, match="has no .parquet"):
    task.check_files()


# ----------------------------------------------------------------- rewards
class _Chars:

  def decode(self, ids):
    return "".join(map(chr, ids))


class _S:

  def __init__(self, text, prompt_id=0):
    self.prompt_id, self.token_ids = prompt_id, tuple(ord(c) for c in text)


VERL_REWARD = textwrap.dedent("""
    import re

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
      # A GSM8K-style rule: the number after '####' must equal the reference.
      assert data_source == "openai/gsm8k" and extra_info["split"] == "train"
      found = re.search(r"#### *(-?[0-9]+)", solution_str)
      if found is None:
        return 0.0
      return 1.0 if found.group(1) == ground_truth else 0.1
    """)


def test_a_verl_compute_score_is_called_by_keyword(tmp_path):
  (tmp_path / "gsm8k_reward.py").write_text(VERL_REWARD)
  examples = dataset.load_file(
      _write_parquet(tmp_path / "d.parquet", _verl_rows(2)), answer_key="reward_model.ground_truth"
  )
  by_id = {e.prompt_id: e for e in examples}
  # A .py path alone means its compute_score.
  with rewards.Rewarder(str(tmp_path / "gsm8k_reward.py"), _Chars(), workers=1) as rw:
    assert rw.fns[0].style == reward_conventions.VERL and rw.fns[0].name == "compute_score"
    rw.probe(examples[0])
    score, correct = rw([_S("so #### 3", 0), _S("#### 5", 1), _S("no idea", 1)], by_id)
    metrics = rw.metrics()
  np.testing.assert_allclose(score, [1.0, 0.1, 0.0])
  np.testing.assert_array_equal(correct, [1, 0, 0])
  assert rw.errors == 0 and metrics["reward_fn/compute_score"] == pytest.approx(1.1 / 3)


TRL_REWARDS = textwrap.dedent("""
    import re

    CALLS = {path!r}

    def accuracy_reward(completions, solution, **kwargs):
      with open(CALLS, "a") as f:
        f.write(f"{{len(completions)}}\\n")
      out = []
      for completion, sol in zip(completions, solution):
        text = completion[0]["content"]
        if sol is None:
          out.append(None)  # no reference: this function gives no reward
        else:
          out.append(1.0 if text.strip().endswith(sol) else 0.0)
      return out

    def format_reward(completions, **kwargs):
      pattern = r"^<think>.*?</think>"
      return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]
    """)


def test_trl_rewards_are_batched_weighted_and_logged_each(tmp_path):
  calls = tmp_path / "calls.txt"
  (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS.format(path=str(calls)))
  chat = ({"role": "user", "content": "2+2?"},)
  examples = {
      0: Example(0, chat, "4", "file", fields={"level": 1}),
      1: Example(1, chat, None, "file", fields={"level": 2}),
  }
  spec = f"{tmp_path}/trl_rewards.py:accuracy_reward,{tmp_path}/trl_rewards.py:format_reward"
  texts = [("<think>sum</think>4", 0), ("4", 0), ("<think>x</think>5", 0), ("<think>", 1)]
  with rewards.Rewarder(
      spec, _Chars(), workers=1, weights=(1.0, 0.5), answer_key="solution", batch_size=3
  ) as rw:
    assert [f.style for f in rw.fns] == [reward_conventions.TRL, reward_conventions.TRL]
    rw.probe(examples[0])
    calls.write_text("")
    rw.submit([_S(t, i) for t, i in texts[:3]], examples)  # a full batch: started now
    rw.submit([_S(t, i) for t, i in texts[3:]], examples)  # waits for more
    score, correct = rw([_S(t, i) for t, i in texts], examples)
    metrics = rw.metrics()
  np.testing.assert_allclose(score, [1.5, 1.0, 0.5, 0.0])
  np.testing.assert_array_equal(correct, [1, 1, 0, 0])
  assert rw.errors == 0
  # One call for the full batch, one for the sample that waited.
  assert calls.read_text().split() == ["3", "1"]
  assert metrics["reward_fn/accuracy_reward"] == pytest.approx(2 / 3)  # None is no reward
  assert metrics["reward_fn/format_reward"] == pytest.approx(0.5)


def test_a_trl_list_of_the_wrong_length_is_counted_not_trained_on(tmp_path):
  (tmp_path / "short.py").write_text("def f(prompts, completions, **kw):\n  return [1.0]\n")
  ex = {0: Example(0, "q", "a", "file")}
  with rewards.Rewarder(f"{tmp_path}/short.py:f", _Chars(), workers=0) as rw:
    rw.probe(ex[0])  # one sample, one number: passes
    score, _ = rw([_S("x"), _S("y")], ex)
  np.testing.assert_allclose(score, [0.0, 0.0])
  assert dict(rw.errors_by_kind) == {"Garbage": 2}


@pytest.mark.parametrize(
    "source,match",
    [
        # The silent-zero path of verl's signature with other parameter names.
        (
            "def compute_score(data_source, solution, answer, extra_info=None):\n  return 1.0\n",
            r"called as StreamRL's score\(response, answer, \*\*columns\).*its signature is "
            r"compute_score\(data_source, solution, answer, extra_info=\.\.\.\).*leaves its "
            r"parameter\(s\) \['answer'\] unfilled",
        ),
        (
            "def judge(data_source, text, **kwargs):\n  return 1.0\n",
            r"called as StreamRL's score\(response, answer, \*\*columns\).*its signature is "
            r"judge\(data_source, text, \*\*kwargs\).*raised TypeError: .*multiple values",
        ),
        (
            "def score(response, answer, level):\n  return 1.0\n",
            r"signature is score\(response, answer, level\).*\['level'\] unfilled",
        ),
        ("def score(response, answer):\n  return 'high'\n", r"returned str, not a number"),
        (
            "def score(prompts, completions, **kw):\n  return 1.0\n",
            r"called as TRL's .* returned float, not a list of 1 numbers",
        ),
    ],
)
def test_a_reward_that_cannot_work_is_refused_before_the_run(tmp_path, source, match):
  (tmp_path / "bad.py").write_text(source)
  ex = Example(0, "q", "a", "file", fields={"data_source": "gsm"})
  with rewards.Rewarder(f"{tmp_path}/bad.py:" + source.split("(")[0][4:], _Chars()) as rw:
    with pytest.raises(UserError, match=match) as err:
      rw.probe(ex)
  assert str(err.value).count(". ") == 0  # one sentence


def test_a_built_in_needs_a_string_answer():
  with rewards.Rewarder("exact_match", _Chars(), workers=0, answer_key="gt") as rw:
    rw.probe(Example(0, "q", "a", "file"))
    with pytest.raises(UserError, match=r"'exact_match' .* has a list \(task.answer_key='gt'\)"):
      rw.probe(Example(0, "q", ["a"], "file"))
    with pytest.raises(UserError, match="has no reference answer"):
      rw.probe(Example(0, "q", None, "file"))


def test_a_reward_failing_on_most_first_samples_stops_the_run(tmp_path, caplog):
  (tmp_path / "flaky.py").write_text(
      "def score(response, answer):\n"
      "  if response != answer:\n"
      "    raise KeyError('boom')\n"
      "  return 1.0\n"
      "def other(response, answer):\n"
      "  raise KeyError('also')\n"
  )
  ex = {0: Example(0, "q", "a", "file")}
  caplog.set_level(logging.WARNING, logger=rewards.__name__)
  spec = f"{tmp_path}/flaky.py:score"
  with rewards.Rewarder(spec, _Chars(), workers=0) as rw:
    rw.probe(ex[0])  # the probe's dummy response is the answer: it passes
    rw([_S("a")] * 4 + [_S("b")] * 3, ex)  # 3 of 7: below the window's start
    with pytest.raises(UserError, match=r"failed on 5 of its first 9 samples.*KeyError: 'boom'"):
      rw([_S("b")] * 2, ex)
  # A bound of 1 never stops; each function warns once per kind.
  with rewards.Rewarder(f"{spec},{tmp_path}/flaky.py:other", _Chars(), workers=0) as rw:
    rw.max_error_rate = 1.0
    caplog.clear()
    score, _ = rw([_S("b")] * 20, ex)
  assert score.tolist() == [0.0] * 20 and rw.errors == 40
  warned = [r.getMessage() for r in caplog.records]
  assert len(warned) == 2 and "flaky.py:score" in warned[0] and "flaky.py:other" in warned[1]


def test_reward_lists_and_weights_are_settings():
  task = settings.Task(reward="exact_match, my.py", reward_weights="1, 0.5", answer_key="")
  task.check()
  assert task.reward_names() == ["exact_match", "my.py"] and task.weights() == (1.0, 0.5)
  for bad, match in (
      (dict(reward_weights="1"), "must be 2 comma-separated number"),
      (dict(reward_weights="1,x"), "must be 2 comma-separated number"),
      (dict(max_reward_error_rate=1.5), "max_reward_error_rate"),
      (dict(truncation="cut"), "task.truncation='cut' is unknown"),
      (dict(chat_template_kwargs="enable_thinking=false"), "is not a JSON object"),
  ):
    with pytest.raises(UserError, match=match):
      settings.Task(reward="exact_match,my.py", **bad).check()


# ----------------------------------------------------------------- lengths
class _Letters:
  """encode_prompt: one id per character."""

  def encode_prompt(self, prompt):
    return [ord(c) for c in prompt]


def test_prompts_too_long_are_dropped_cut_or_refused(caplog):
  exs = [Example(i, p, "a", "file") for i, p in enumerate(["abc", "abcdefgh", "xy", "0123456789"])]
  kw = dict(max_model_len=10, max_tokens=4)  # room for 6 prompt tokens
  caplog.set_level(logging.WARNING, logger=loader.__name__)
  kept = loader.fit_prompts(exs, _Letters(), **kw)
  assert [e.prompt_id for e in kept] == [0, 2]
  (line,) = [r.getMessage() for r in caplog.records]
  assert "Dropped 2 of 4 training prompts longer than 6 tokens" in line
  assert "raise engine.max_model_len to at least 14" in line
  cut = {m: loader.fit_prompts(exs, _Letters(), truncation=m, **kw)[3] for m in ("left", "right")}
  assert bytes(cut["left"].prompt_token_ids).decode() == "456789"
  assert bytes(cut["right"].prompt_token_ids).decode() == "012345"
  middle = loader.fit_prompts(exs, _Letters(), truncation="middle", **kw)
  assert [bytes(e.prompt_token_ids or b"").decode() for e in middle] == [
      "",
      "abcfgh",
      "",
      "012789",
  ]
  # The cut ids are what the generator gets.
  requests, _ = loader.make_requests(middle[1:2], _Letters(), 1)
  assert bytes(requests[0][1]).decode() == "abcfgh"
  with pytest.raises(UserError, match=r"2 of 4 training prompts are longer than 6 tokens"):
    loader.fit_prompts(exs, _Letters(), truncation="error", **kw)


def test_chat_template_kwargs_reach_the_template(tmp_path):
  pytest.importorskip("transformers")
  from streamrl.data import tokenizer as tok

  tok.save_hf_tokenizer(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = (
      "{% for m in messages %}{{ m['content'] }}{% endfor %}"
      "{% if enable_thinking is defined and not enable_thinking %}=nothink{% endif %}"
  )
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  plain = tok.Tokenizer(str(tmp_path))
  quiet = tok.Tokenizer(str(tmp_path), chat_template_kwargs={"enable_thinking": False})
  assert plain.render(plain.messages("abc")) == "abc"
  assert quiet.render(quiet.messages("abc")) == "abc=nothink"
  assert tok.decode(quiet.encode_prompt("abc")) == "abc=nothink"


def test_relative_paths_in_lists_resolve_against_the_config(tmp_path):
  from streamrl import config as config_lib

  for name in ("a.jsonl", "b.parquet", "verl_reward.py", "trl.py"):
    (tmp_path / name).write_text("")
  cfg = settings.default_config()
  cfg.task.train_path = "a.jsonl,b.parquet"
  cfg.task.reward = "verl_reward.py,trl.py:format_reward,exact_match"
  out = config_lib.resolve_paths(cfg, str(tmp_path))
  assert out.task.train_path == f"{tmp_path}/a.jsonl,{tmp_path}/b.parquet"
  assert out.task.reward == f"{tmp_path}/verl_reward.py,{tmp_path}/trl.py:format_reward,exact_match"
