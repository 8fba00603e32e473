"""experiments/bench/bench_real_model.py --quick: a tiny Qwen2-shaped checkpoint written by
transformers, the 0.5B recipe's LoRA variant through launch/main.py, its memory
sampled over every process of the run and its export loaded back."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_quick_run_reports_memory_and_time_per_phase(tmp_path):
  cmd = [sys.executable, "experiments/bench/bench_real_model.py", "--quick", "--mode=lora"]
  cmd += ["--iterations=1", f"--workdir={tmp_path}", f"--out={tmp_path}"]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
  assert len(result) == 1, out.stdout[-2000:]
  values = dict(kv.split("=") for kv in result[0].split()[1:])
  assert set(values) == {
      f"lora_{k}"
      for k in (
          "peak_rss_gb",
          "peak_pss_shm_gb",
          "peak_machine_gb",
          "iteration_s",
          "generation_s",
          "training_s",
          "weight_update_s",
      )
  }
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  by_process = summary["details"]["lora"]["peak_gb_by_process"]
  # The trainer and the generator are Ray actors: their memory counts too.
  assert by_process["TrainerActor"] > 0 and by_process["GeneratorActor"] > 0
  assert float(values["lora_peak_rss_gb"]) >= by_process["TrainerActor"]
  assert float(values["lora_peak_pss_shm_gb"]) > 0
  assert "Memory plan of the trainer" in summary["details"]["lora"]["plan"]
