"""experiments/ as one suite: every script starts and lists the common flags,
the flags have one name each, `harness.report` prints the RESULT line and
writes summary.json, no module is over 600 lines, and the quick paths that
need no vLLM engine run."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from experiments import harness

pytestmark = [pytest.mark.unit]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Modules other scripts import: no entry point of their own.
LIBRARIES = {
    "big_model",
    "calibrate_arms",
    "calibrate_costs",
    "elastic_analysis",
    "elastic_costs",
    "elastic_run",
    "elastic_setup",
    "modes_arms",
    "paper_figures",
    "paper_sections",
    "peer_tunix",
    "skew_arms",
}
SCRIPTS = sorted(
    os.path.relpath(p, ROOT)
    for p in glob.glob(os.path.join(ROOT, "experiments", "*", "*.py"))
    if os.path.basename(p)[:-3] not in LIBRARIES | {"__init__"}
)
COMMON = ("--config", "--override", "--model", "--workdir", "--out", "--reps", "--quick")
# Tools that draw or inspect rather than measure: no RESULT line.
TOOLS = {"experiments/diag/plot_timeline.py"}


def _run(args, timeout):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run(
      [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
  )


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_starts_and_lists_the_common_flags(script):
  proc = _run([script, "--help"], timeout=120)
  out = proc.stdout + proc.stderr
  assert "Try --helpfull" in out, out[-3000:]
  if script not in TOOLS:
    for flag in COMMON:
      assert f"  {flag}" in out or f"--[no]{flag[2:]}" in out, (script, flag)
    with open(os.path.join(ROOT, script)) as f:
      assert "harness.report(" in f.read(), script
  # The docstring's usage line names the script where it now lives.
  assert f"python {script}" in out, out[:1000]


def test_the_flags_have_one_name_each():
  banned = {"repeats", "runs", "out_dir", "smoke", "model_dir"}
  common = {f[2:] for f in COMMON}
  for path in glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True):
    with open(path) as f:
      names = re.findall(r"flags\.DEFINE_\w+\(\s*\"(\w+)\"", f.read())
    assert not banned & set(names), (path, banned & set(names))
    if not path.endswith("harness.py"):
      assert not common & set(names), f"{path} defines {common & set(names)} again"


def test_no_module_is_over_600_lines():
  for path in glob.glob(os.path.join(ROOT, "experiments", "**", "*.py"), recursive=True):
    with open(path) as f:
      assert sum(1 for _ in f) <= 600, path


def test_report_prints_the_result_line_and_writes_the_summary(tmp_path, capsys):
  line = harness.report(
      out=str(tmp_path), summary={"arms": {"a": 1}}, ratio=1.23456, ok=True, n=3, tag="x"
  )
  assert line == "RESULT ratio=1.235 ok=1 n=3 tag=x"
  assert capsys.readouterr().out.strip() == line
  with open(tmp_path / "summary.json") as f:
    summary = json.load(f)
  assert summary == {"arms": {"a": 1}, "result": {"ratio": 1.23456, "ok": True, "n": 3, "tag": "x"}}


def test_taskset_prefixes_a_command_only_with_cores():
  assert harness.taskset(["python", "x.py"], ()) == ["python", "x.py"]
  assert harness.taskset(["python"], (3, 1)) == ["taskset", "-c", "1,3", "python"]


def _result(stdout: str) -> dict:
  lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
  assert len(lines) == 1, stdout[-2000:]
  return dict(kv.split("=", 1) for kv in lines[0].split()[1:])


def test_bench_sandbox_quick(tmp_path):
  proc = _run(["experiments/bench/bench_sandbox.py", "--quick", f"--out={tmp_path}"], 300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = _result(proc.stdout)
  assert float(got["isolated_median_ms"]) > 0 and float(got["unsafe_median_ms"]) > 0
  assert (tmp_path / "summary.json").exists()


@pytest.mark.e2e
def test_reproduce_paper_quick(tmp_path):
  proc = _run(["experiments/sim/reproduce_paper.py", "--quick", f"--out={tmp_path}"], 600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = _result(proc.stdout)
  assert set(got) == {
      "fig8_max_rel_err",
      "table3_max_abs_err",
      "fig9_max_abs_err",
      "fig12_max_rel_err",
  }
  assert (tmp_path / "report.md").exists() and (tmp_path / "summary.json").exists()
