"""pyproject.toml declares every third-party package the tree imports, and
constraints.txt pins each declared package once (what install.sh installs)."""

import ast
import importlib.metadata as md
import os
import re
import sys
import tomllib

import pytest

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("streamrl", "launch", "experiments", "tests", "configs")


def _canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(line: str) -> str:
  return _canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line).group(1))


def _project() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)["project"]


def _declared() -> dict[str, str]:
  """Canonical name -> where pyproject.toml declares it ("dependencies" or the extra)."""
  project = _project()
  out = {_requirement_name(r): "dependencies" for r in project["dependencies"]}
  for extra, reqs in project["optional-dependencies"].items():
    for r in reqs:
      out.setdefault(_requirement_name(r), extra)
  return out


def _pins() -> dict[str, str]:
  with open(os.path.join(REPO, "constraints.txt")) as f:
    lines = [l.strip() for l in f if l.strip() and not l.startswith("#")]
  pins = {}
  for line in lines:
    name, sep, version = line.partition("==")
    assert sep and version, f"constraints.txt: {line!r} is not a name==version pin"
    assert _canonical(name) not in pins, f"constraints.txt pins {name} twice"
    pins[_canonical(name)] = version
  return pins


def _imports() -> dict[str, set[str]]:
  """Top-level module name -> files of TREES that import it (absolute imports only)."""
  found: dict[str, set[str]] = {}
  for tree in TREES:
    for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, tree)):
      dirnames[:] = [d for d in dirnames if d != "__pycache__"]
      for name in filenames:
        if not name.endswith(".py"):
          continue
        path = os.path.join(dirpath, name)
        with open(path, encoding="utf-8") as f:
          module = ast.parse(f.read(), path)
        for node in ast.walk(module):
          if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
          elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
          else:
            continue
          for n in names:
            found.setdefault(n.split(".")[0], set()).add(os.path.relpath(path, REPO))
  return found


def test_every_third_party_import_is_declared():
  first_party = {n for n in os.listdir(REPO) if os.path.isdir(os.path.join(REPO, n))}
  first_party.add("conftest")
  dists = md.packages_distributions()
  declared = _declared()
  missing = []
  for top, files in sorted(_imports().items()):
    if top in sys.stdlib_module_names or top in first_party:
      continue
    # A module of an extra CI leaves out (NOT_IN_CI) is not installed there:
    # its distribution is then taken to carry the module's own name.
    names = {_canonical(d) for d in dists.get(top, [])} or {_canonical(top)}
    if not names & set(declared):
      where = ", ".join(sorted(files)[:3])
      missing.append(f"{top} (distribution {sorted(names) or 'not installed'}; {where})")
  assert not missing, "imported but not declared in pyproject.toml: " + "; ".join(missing)


def test_every_declared_package_is_pinned_once():
  pins = _pins()
  unpinned = sorted(set(_declared()) - set(pins))
  assert not unpinned, f"declared in pyproject.toml, not pinned in constraints.txt: {unpinned}"


def test_the_installed_versions_are_the_pinned_ones():
  # A package upgraded by hand without regenerating constraints.txt (.ci/freeze.py).
  drift = []
  for name, version in _pins().items():
    try:
      installed = md.version(name)
    except md.PackageNotFoundError:
      continue  # The other machine's build (cpu or gpu part).
    if name in _declared() and installed != version:
      drift.append(f"{name} {installed} (pinned {version})")
  assert not drift, "installed versions differ from constraints.txt: " + ", ".join(drift)


# Extras no install file takes: experiments/bench/bench_peers.py's peer (TRL).
NOT_IN_CI = {"peers"}


def test_the_requirement_files_install_the_extras():
  extras = set(_project()["optional-dependencies"])
  for path, engine in (("requirements.txt", "cpu"), ("requirements-gpu.txt", "gpu")):
    with open(os.path.join(REPO, path)) as f:
      lines = [l.strip() for l in f if l.strip() and not l.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("-e .["), (path, lines)
    wanted = set(lines[0][len("-e .[") : -1].split(","))
    assert wanted == extras - ({"cpu", "gpu"} - {engine}) - NOT_IN_CI, (path, wanted)


def test_the_cpu_pins_come_last():
  # install.sh drops the line "# ---- cpu: ..." and all below it on GPU machines.
  with open(os.path.join(REPO, "constraints.txt")) as f:
    marks = [l.split(":")[0] for l in f if l.startswith("# ---- ")]
  assert marks == ["# ---- gpu", "# ---- cpu"]
  with open(os.path.join(REPO, "install.sh")) as f:
    assert "'/^# ---- cpu:/,$d' constraints.txt" in f.read()
