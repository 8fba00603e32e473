"""A verl user's job, unchanged, through launch/main.py: GSM8K rows as verl's
preprocessing writes them and a verl `compute_score` file train with non-zero
rewards; a reward whose signature cannot work stops the run before any
engine starts or any update is made."""

import json
import os
import subprocess
import sys

import pytest

from streamrl import experiment
from streamrl import config as config_lib
from streamrl.errors import UserError

pytestmark = [pytest.mark.engine, pytest.mark.e2e]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# configs/gsm_symbolic.py shrunk: one engine in the trainer's process, short answers.
TINY = {
    "task.kind": "file",
    "task.answer_key": "reward_model.ground_truth",
    "task.system_prompt": "",
    "task.num_eval": 4,
    "trainer.num_iterations": 1,
    "pipeline.mode": "colocated",
    "transfer.enabled": False,
    "scheduler.kind": "fifo",
    "pipeline.partial": "off",
    "log.progress": False,
    "sampling.max_tokens": 16,
    "engine.max_num_seqs": 16,
    "engine.max_model_len": 256,
    "mesh.fsdp": 1,
    "checkpoint.export_hf": False,
}

VERL_REWARD = """
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  # The right number after '####' scores 1; otherwise a little for trying, by length.
  if data_source != "openai/gsm8k" or not isinstance(extra_info, dict):
    raise ValueError(f"unexpected row {data_source!r} {extra_info!r}")
  found = re.search(r"####\\s*(-?[0-9][0-9,]*)", solution_str)
  if found and found.group(1).replace(",", "") == ground_truth:
    return 1.0
  return min(len(solution_str), 100) / 1000
"""


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
  """A verl-format GSM8K Parquet (one prompt too long for the engine) and its
  verl reward file."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  root = tmp_path_factory.mktemp("gsm8k")
  rows = []
  for i in range(24):
    question = f"A shop sells {i + 3} pens a day for 24 days. How many pens does it sell?"
    rows.append(
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + ' Answer after "####".'}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str((i + 3) * 24)},
            "extra_info": {"split": "train", "index": i, "question": question},
        }
    )
  rows.append(dict(rows[-1], prompt=[{"role": "user", "content": "Count the pens. " * 300}]))
  pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
  (root / "gsm8k_reward.py").write_text(VERL_REWARD)
  return root


def test_a_verl_dataset_and_compute_score_train_through_the_cli(gsm8k, tmp_path):
  workdir = tmp_path / "run"
  overrides = {
      **TINY,
      "task.train_path": str(gsm8k / "train.parquet"),
      "task.reward": str(gsm8k / "gsm8k_reward.py"),  # no ':name': its compute_score
  }
  cmd = [sys.executable, "launch/main.py", "--config=configs/gsm_symbolic.py"]
  cmd += [f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in overrides.items()]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "Dropped 1 of 23 training prompts longer than 240 tokens" in out.stderr
  with open(workdir / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  (step,) = [r for r in rows if r["step"] == 1]
  assert step["reward/mean"] > 0 and step["reward/errors_total"] == 0
  assert step["reward_fn/compute_score"] == pytest.approx(step["reward/mean"])
  assert "accuracy/openai/gsm8k" in step


def test_a_reward_with_a_wrong_signature_stops_before_the_first_update(gsm8k, tmp_path):
  """The silent-zero path of before: verl's parameters renamed, so the call
  cannot fill them; the run now stops with one sentence and trains nothing."""
  (tmp_path / "reward.py").write_text(
      "def compute_score(data_source, solution, answer, extra_info=None):\n"
      "  return float(solution.strip().endswith(answer))\n"
  )
  cfg = config_lib.apply_overrides(
      config_lib.load_config(os.path.join(ROOT, "configs", "gsm_symbolic.py")),
      {
          **TINY,
          "task.train_path": str(gsm8k / "train.parquet"),
          "task.reward": f"{tmp_path / 'reward.py'}:compute_score",
      },
  )
  workdir = tmp_path / "run"
  with pytest.raises(UserError, match=r"called as StreamRL's score\(response, answer") as err:
    experiment.run(cfg, str(workdir))
  assert "compute_score(data_source, solution, answer, extra_info=...)" in str(err.value)
  assert not (workdir / "metrics.jsonl").exists()
  assert not os.listdir(workdir / "checkpoints")
