"""MetricsWriter (read back with TensorBoard's own reader), save_config, Progress, percentiles,
the results table, and the console/library-log split of configure_logging."""

import glob
import io
import json
import math
import os
import struct
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from streamrl.errors import UserError
from streamrl.metrics import (
    Log,
    MetricsWriter,
    Progress,
    percentiles,
    read_final_metrics,
    results_table,
    save_config,
)

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _accumulator(logdir):
  acc = event_accumulator.EventAccumulator(
      logdir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0}
  )
  acc.Reload()
  return acc


def test_event_file_holds_scalars_histogram_and_text(tmp_path):
  lengths = np.array([3, 5, 5, 8, 40, 120])
  with MetricsWriter(str(tmp_path)) as w:
    for step in (1, 2, 3):
      w.scalars(step, {"reward/mean": 0.1 * step, "kl": np.float32(0.5), "acc": np.array(step / 4)})
    w.histogram(3, "response_length", lengths)
    w.histogram(3, "empty", [])  # Skipped, not an error.
    w.text(3, "sample", "Q: 2+2 A: 4")
    w.flush()
  assert glob.glob(str(tmp_path / "events.out.tfevents.*"))
  acc = _accumulator(str(tmp_path))
  tags = acc.Tags()
  assert {"reward/mean", "kl", "acc"} <= set(tags["scalars"])
  rewards = acc.Scalars("reward/mean")
  assert [e.step for e in rewards] == [1, 2, 3]
  np.testing.assert_allclose([e.value for e in rewards], [0.1, 0.2, 0.3], rtol=1e-6)
  assert [e.value for e in acc.Scalars("acc")] == [0.25, 0.5, 0.75]
  assert tags["histograms"] == ["response_length"]
  (hist,) = acc.Histograms("response_length")
  assert hist.step == 3
  assert hist.histogram_value.num == 6
  assert hist.histogram_value.min == 3 and hist.histogram_value.max == 120
  assert hist.histogram_value.sum == pytest.approx(lengths.sum())
  assert any(t.startswith("sample") for t in tags["tensors"])


def test_jsonl_mirrors_scalars_and_purge_on_resume(tmp_path):
  with MetricsWriter(str(tmp_path)) as w:
    for step in range(5):
      w.scalars(step, {"loss": float(step), "bad": float("nan")})
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
  assert [r["loss"] for r in rows] == [0.0, 1.0, 2.0, 3.0, 4.0]
  assert all(r["bad"] is None and r["wall_time"] > 0 for r in rows)
  # A run that crashed after logging step 4 resumes from a checkpoint at step 2:
  # steps >= 3 are logged again and the old ones disappear from both outputs.
  with MetricsWriter(str(tmp_path), purge_step=3) as w:
    for step in (3, 4):
      w.scalars(step, {"loss": 10.0 + step})
  rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [(r["step"], r["loss"]) for r in rows] == [
      (0, 0.0),
      (1, 1.0),
      (2, 2.0),
      (3, 13.0),
      (4, 14.0),
  ]
  acc = _accumulator(str(tmp_path))
  assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
      (0, 0.0),
      (1, 1.0),
      (2, 2.0),
      (3, 13.0),
      (4, 14.0),
  ]


def test_scalars_reject_arrays_and_disabled_writer_writes_nothing(tmp_path):
  with MetricsWriter(str(tmp_path / "a")) as w:
    with pytest.raises(ValueError, match="has shape \\(2,\\); log a scalar"):
      w.scalars(0, {"v": np.zeros(2)})
  w = MetricsWriter(str(tmp_path / "b"), enabled=False)
  w.scalars(0, {"x": 1.0})
  w.histogram(0, "h", [1, 2])
  w.close()
  assert not (tmp_path / "b").exists()


def _wandb_records(path):
  """The records of a W&B run file (`run-<id>.wandb`): a LevelDB-style log of
  32 KiB blocks after a 7-byte header, each record a protobuf in one or more
  chunks (type 1 whole, 2 first, 3 middle, 4 last)."""
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top

  data = path.read_bytes()
  assert data[:4] == b":W&B", data[:8]
  pos, chunk, out = 7, b"", []
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # Too little room for a chunk header: padding.
      pos += 32768 - pos % 32768
      continue
    _, size, kind = struct.unpack("<IHB", data[pos : pos + 7])
    chunk += data[pos + 7 : pos + 7 + size]
    pos += 7 + size
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(chunk)
      out.append(record)
      chunk = b""
  return out


def test_wandb_offline_run_gets_every_scalar_and_the_config(tmp_path, monkeypatch):
  import wandb  # pylint: disable=g-import-not-at-top

  # Nothing may leave the machine: offline, and any server it might try is a closed port.
  for name, value in {
      "WANDB_SILENT": "true",
      "WANDB_MODE": "offline",
      "WANDB_BASE_URL": "http://127.0.0.1:9",
      "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
      "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
      "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
  }.items():
    monkeypatch.setenv(name, value)
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  workdir = tmp_path / "run"
  log = Log(wandb_project="streamrl-test")
  try:
    with MetricsWriter(str(workdir), log=log, run_config={"optimizer": {"lr": 3e-6}}) as w:
      w.scalars(1, {"reward/mean": 0.25, "kl": np.float32(0.5)})
      w.scalars(2, {"reward/mean": 0.5, "kl": float("nan")})
      w.histogram(2, "response_length", [3, 5, 8])
  finally:
    wandb.teardown()
  (run_file,) = (workdir / "wandb").glob("offline-run-*/run-*.wandb")
  records = _wandb_records(run_file)
  history = {}
  for r in records:
    if r.WhichOneof("record_type") == "history":
      items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
      history[r.history.step.num] = items
  assert sorted(history) == [1, 2]
  assert history[1]["reward/mean"] == 0.25 and history[1]["kl"] == 0.5
  assert history[2]["reward/mean"] == 0.5 and math.isnan(history[2]["kl"])
  assert history[2]["response_length/_type"] == "histogram"
  (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
  assert run.project == "streamrl-test" and run.display_name == "run"
  config = {u.key: json.loads(u.value_json) for u in run.config.update}
  assert config["optimizer"] == {"lr": 3e-6}
  # The writer's own files are there as without W&B.
  assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 2


def test_wandb_is_never_imported_without_a_project(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` would raise.
  with MetricsWriter(str(tmp_path), log=Log()) as w:
    w.scalars(1, {"x": 1.0})
    w.histogram(1, "h", [1.0, 2.0])
  assert not (tmp_path / "wandb").exists()
  Log(wandb_mode="online").check()
  with pytest.raises(UserError, match="log.wandb_mode='cloud' is unknown"):
    Log(wandb_mode="cloud").check()
  with pytest.raises(UserError, match="needs the wandb package"):
    Log(wandb_project="p").check()  # find_spec finds no module where sys.modules holds None.


def test_save_config_writes_json_and_text(tmp_path):
  c = ml_collections.ConfigDict({"trainer": {"lr": 3e-6, "mesh": (1, 8)}, "algo": "ppo"})
  c.fn = print  # Not JSON: written best effort instead of failing.
  path = save_config(c, str(tmp_path / "logs"))
  loaded = json.loads(open(path).read())
  assert loaded["trainer"] == {"lr": 3e-6, "mesh": [1, 8]} and loaded["algo"] == "ppo"
  assert "lr: 3.0e-06" in (tmp_path / "logs" / "config.txt").read_text()


def test_percentiles():
  out = percentiles(np.arange(1, 11), prefix="len/")
  assert out == {"len/mean": 5.5, "len/p50": 5.5, "len/p90": pytest.approx(9.1), "len/max": 10.0}
  assert all(math.isnan(v) for v in percentiles([]).values())


def test_progress_plain_lines_with_eta():
  buf = io.StringIO()  # Not a TTY -> plain lines.
  p = Progress(4, "ppo", initial=1, file=buf)
  p.update(reward=0.5, acc=np.float32(0.25))
  p.write("note")
  p.update(2)
  p.close()
  lines = buf.getvalue().splitlines()
  assert lines[0].startswith("ppo 2/4 (50%) elapsed 0:00:00 eta 0:00:0")
  assert lines[0].endswith("| reward=0.5 acc=0.25")
  assert lines[1] == "note"
  assert lines[2].startswith("ppo 4/4 (100%)") and "eta 0:00:00" in lines[2]


def test_progress_uses_tqdm_on_a_tty():
  class Tty(io.StringIO):

    def isatty(self):
      return True

  buf = Tty()
  with Progress(3, "grpo", file=buf) as p:
    p.update(reward=0.25)
  out = buf.getvalue()
  assert "grpo" in out and "1/3" in out and "reward=0.25" in out


# ------------------------------------------------------------- results table


def test_results_table_ranks_by_eval_accuracy_and_keeps_missing_runs_last():
  runs = [
      (
          "lr=1e-06",
          {"eval/accuracy": 0.40, "eval/accuracy_greedy": 0.45, "reward/mean": 0.31, "loss": 1.0},
      ),
      ("lr=3e-06", {"eval/accuracy": 0.55, "eval/accuracy_greedy": 0.60, "reward/mean": 0.42}),
      ("lr=1e-05 (failed)", None),
      ("lr=1e-07", {"eval/accuracy": float("nan"), "reward/mean": 0.1}),  # No usable accuracy.
      ("lr=2e-06", {"eval/accuracy": 0.40, "reward/mean": None}),  # Tie with lr=1e-06: given order.
  ]
  lines = results_table(runs).splitlines()
  assert lines[0].split() == ["rank", "run", "eval/accuracy", "eval/accuracy_greedy", "reward/mean"]
  rows = [l.split() for l in lines[1:]]
  assert rows == [
      ["1", "lr=3e-06", "0.5500", "0.6000", "0.4200"],
      ["2", "lr=1e-06", "0.4000", "0.4500", "0.3100"],
      ["3", "lr=2e-06", "0.4000", "-", "-"],
      ["-", "lr=1e-05", "(failed)", "-", "-", "-"],
      ["-", "lr=1e-07", "-", "-", "0.1000"],
  ]
  # Columns line up: every value ends where its header does.
  end = lines[0].index("reward/mean") + len("reward/mean")
  assert all(len(l) == end for l in lines)


def test_results_table_other_columns_and_sort_key():
  runs = [("a", {"x": 1.0, "y": 3.0}), ("b", {"x": 2.0, "y": 1.0})]
  assert [l.split()[1] for l in results_table(runs, columns=("x", "y")).splitlines()[1:]] == [
      "b",
      "a",
  ]
  assert [
      l.split()[1] for l in results_table(runs, columns=("x", "y"), sort_by="y").splitlines()[1:]
  ] == ["a", "b"]


def test_read_final_metrics(tmp_path):
  assert read_final_metrics(str(tmp_path)) is None
  (tmp_path / "final_metrics.json").write_text("{not json")
  assert read_final_metrics(str(tmp_path)) is None
  (tmp_path / "final_metrics.json").write_text(json.dumps({"eval/accuracy": 0.5}))
  assert read_final_metrics(str(tmp_path)) == {"eval/accuracy": 0.5}


# ------------------------------------------------------------------- logging

LOGGING_SCRIPT = r"""
import logging, os, sys, warnings
from absl import logging as absl_logging
from streamrl import metrics

absl_logging.use_absl_handler()  # What absl's app.run does before main.
absl_logging.set_verbosity(absl_logging.INFO)  # absl's default once flags are parsed.
early = logging.getLogger("early_lib")  # A library with its own console handler (like Ray, vLLM).
early.addHandler(logging.StreamHandler(sys.stderr))
early.propagate = False
path = metrics.configure_logging(sys.argv[1])
late = logging.getLogger("late_lib")  # One that sets up its handler later (like transformers).
late.addHandler(logging.StreamHandler(sys.stderr))
late.propagate = False

absl_logging.info("orbax-like info")
early.warning("early library warning")
logging.getLogger("vllm.model_executor").warning("RotaryEmbedding: Failed to load weights")
warnings.warn_explicit("library warning", UserWarning, "/x/site-packages/lib/mod.py", 3)
warnings.warn_explicit("our own warning", UserWarning, metrics.__file__, 5)
logging.getLogger("streamrl.train").info("our line")
logging.getLogger("streamrl.train").debug("our debug line")
logging.getLogger("__main__").info("main line")
metrics.Progress(2, "RL", file=sys.stdout).update(1)  # Re-routes late_lib.
late.warning("late library warning")
print("PATH", path, os.environ["VLLM_CONFIGURE_LOGGING"])
"""

_LIBRARY_LINES = (
    "orbax-like info",
    "early library warning",
    "Failed to load weights",
    "library warning",
    "late library warning",
)


def _run_logging_script(workdir):
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop("VLLM_CONFIGURE_LOGGING", None)
  return subprocess.run(
      [sys.executable, "-c", LOGGING_SCRIPT, workdir],
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )


def test_configure_logging_keeps_the_console_to_our_lines(tmp_path):
  workdir = tmp_path / "run"  # Created by configure_logging.
  res = _run_logging_script(str(workdir))
  assert res.returncode == 0, res.stderr
  log_path = workdir / "libraries.log"
  assert f"PATH {log_path} 0" in res.stdout
  console = res.stderr
  for line in ("our line", "main line", "our own warning"):
    assert line in console, console
  for line in _LIBRARY_LINES + ("our debug line",):
    assert line not in console, console
  library_log = log_path.read_text()
  for line in _LIBRARY_LINES + ("our line",):  # Our lines too, for context.
    assert line in library_log, library_log


def test_configure_logging_without_workdir_shows_only_library_warnings(tmp_path):
  res = _run_logging_script("")  # An empty path is a mistake, not "no workdir".
  assert res.returncode != 0 and "UserError: --workdir is empty" in res.stderr
  script = LOGGING_SCRIPT.replace(
      "metrics.configure_logging(sys.argv[1])", "metrics.configure_logging(None)"
  )
  res = subprocess.run(
      [sys.executable, "-c", script],
      env=dict(os.environ, PYTHONPATH=REPO),
      capture_output=True,
      text=True,
      timeout=120,
      cwd=tmp_path,
  )
  assert res.returncode == 0, res.stderr
  assert "PATH None" in res.stdout
  assert "our line" in res.stderr and "early library warning" in res.stderr
  assert "orbax-like info" not in res.stderr  # absl's INFO stays out even at absl verbosity INFO.
  assert not list(tmp_path.iterdir())
