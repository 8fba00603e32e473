"""MetricsWriter (read back with TensorBoard's own reader), save_config, Progress, percentiles."""

import glob
import io
import json
import math

import ml_collections
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from streamrl.metrics import MetricsWriter, Progress, percentiles, save_config


def _accumulator(logdir):
  acc = event_accumulator.EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
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
  assert [(r["step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]
  acc = _accumulator(str(tmp_path))
  assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0)]


def test_scalars_reject_arrays_and_disabled_writer_writes_nothing(tmp_path):
  with MetricsWriter(str(tmp_path / "a")) as w:
    with pytest.raises(ValueError, match="has shape \\(2,\\); log a scalar"):
      w.scalars(0, {"v": np.zeros(2)})
  w = MetricsWriter(str(tmp_path / "b"), enabled=False)
  w.scalars(0, {"x": 1.0})
  w.histogram(0, "h", [1, 2])
  w.close()
  assert not (tmp_path / "b").exists()


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
