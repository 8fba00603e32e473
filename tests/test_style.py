"""One code style: the tree is formatted with pyink as pyproject.toml configures."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.unit]

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_the_tree_is_formatted():
  pyink = shutil.which("pyink", path=os.path.dirname(sys.executable)) or shutil.which("pyink")
  if pyink is None:
    pytest.fail("pyink is not installed; `pip install -r requirements.txt` brings it.")
  res = subprocess.run(
      [pyink, "--check", "--quiet", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
  )
  assert res.returncode == 0, f"run `pyink .` to format:\n{res.stderr[-3000:]}"
