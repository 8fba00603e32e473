"""experiments/check/gpu_check.py --quick: the GPU check's code path, on CPU, without vLLM.

A `vllm` package that raises on import sits first on the path of the check's
processes, so an import of vLLM anywhere (the script, streamrl, the
measurement subprocesses) fails the run.
"""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e]

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_gpu_check_quick_runs_without_vllm(tmp_path):
  # The GPU machine has JAX, Flax, optax, Orbax and torch only: any other
  # package of ours (vLLM above all) must stay unimported.
  for name in ("vllm", "ml_collections", "ray", "transformers", "tensorboardX", "grain", "xxhash"):
    poison = tmp_path / name
    poison.mkdir()
    (poison / "__init__.py").write_text(f"raise ImportError('gpu_check must not import {name}')\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [
          sys.executable,
          os.path.join(ROOT, "experiments", "check", "gpu_check.py"),
          "--quick",
          f"--out={tmp_path}",
      ],
      capture_output=True,
      text=True,
      timeout=300,
      env=env,
      cwd=ROOT,
  )
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  result = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert len(result) == 1, proc.stdout
  fields = dict(kv.split("=", 1) for kv in result[0].split()[1:])
  assert fields["ok"] == "1" and fields["handoff_ok"] == "1" and fields["vllm_imported"] == "0"
  assert fields["skipped"] == "none"
  for arm in ("base_1_5b", "fused_1_5b", "head_1_5b", "minimal_1_5b", "best_0_5b", "slice_7b"):
    assert float(fields[f"tokens_per_s_{arm}"]) > 0
    assert float(fields[f"peak_gib_{arm}"]) > 0
    assert fields[f"mfu_{arm}"] == "nan"  # no peak FLOP/s for a CPU
  # The fused attention takes the same step: the same loss up to rounding.
  assert float(fields["loss_diff_fused_1_5b"]) < 1e-2
  for key in ("init_s_1_5b", "init_legacy_s_1_5b", "export_s_per_gb", "handoff_s_per_gb"):
    assert float(fields[key]) > 0
  assert float(fields["slice_7b_plan_gib_fsdp4"]) > 0
