"""The README is a page, the guides in docs/ hold the rest, and every link, command and
config they name exists."""

import glob
import os
import re

import pytest

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDES = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
DOCS = ["README.md", "experiments/RESULTS.md", *GUIDES]
# Phrases of working notes: the docs state what is, not who did what when.
NOTES = re.compile(
    r"of mine|this change|this session|see the issue|the issue notes|\bissue \d+|issue-\d+",
    re.I,
)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`+[^`]*`+")
_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)


def relative_links(text: str) -> list[str]:
  """The link targets of markdown `text` that are paths (no URL, no bare
  #anchor), outside code, without their #fragment."""
  text = _CODE.sub("", _FENCE.sub("", text))
  out = []
  for target in _INLINE.findall(text) + _REFERENCE.findall(text):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
      continue  # http:, mailto:, ... or a heading of the same page.
    out.append(target.split("#", 1)[0])
  return out


def test_relative_links_finds_paths_only():
  text = (
      '[a](docs/x.md) ![img](fig.png "title") [web](https://x.org) [top](#tree)\n'
      "`[not](in/code.md)` [b](<dir/y.md>) [c](launch/main.py#L3)\n"
      "```\n[fenced](nope.md)\n```\n[ref]: configs/ppo.py\n"
  )
  want = ["docs/x.md", "fig.png", "dir/y.md", "launch/main.py", "configs/ppo.py"]
  assert relative_links(text) == want


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
  path = os.path.join(REPO, doc)
  if not os.path.exists(path):
    pytest.skip(f"{doc} is not in this checkout")
  with open(path, encoding="utf-8") as f:
    links = relative_links(f.read())
  broken = []
  for link in links:
    target = os.path.normpath(os.path.join(os.path.dirname(path), link))
    inside = os.path.commonpath([REPO, target]) == REPO
    if not inside or not os.path.exists(target):
      broken.append(link)
  assert not broken, f"{doc}: links to missing or outside paths: {broken}"


def _read(doc: str) -> str:
  with open(os.path.join(REPO, doc), encoding="utf-8") as f:
    return f.read()


def test_the_readme_is_a_page_that_links_every_guide():
  text = _read("README.md")
  assert len(text.splitlines()) <= 200
  links = set(relative_links(text))
  assert "docs/DESIGN.md" in links and "experiments/RESULTS.md" in links
  unlinked = [g for g in GUIDES if g not in links]
  assert not unlinked, f"guides the README does not link: {unlinked}"


def test_the_readme_runs_what_ci_runs():
  """The README's two commands: install and run, and the test command of .ci/run."""
  readme = _read("README.md")
  ci = [l.strip() for l in _read(".ci/run").splitlines() if l.strip().startswith(".venv/")]
  assert ci and all(line in readme for line in ci), ci
  assert "bash install.sh && .venv/bin/python launch/main.py --config=configs/ppo.py" in readme


def test_headline_results_link_to_the_results_page():
  """At most 12 rows of numbers in the README, each a link into experiments/RESULTS.md."""
  readme = _read("README.md")
  section = readme.split("## Headline results", 1)[1].split("\n## ", 1)[0]
  rows = [l for l in section.splitlines() if l.startswith("| ") and not l.startswith("| what")]
  rows = [l for l in rows if not l.startswith("| ---")]
  assert 0 < len(rows) <= 12
  for row in rows:
    assert "](experiments/RESULTS.md" in row, row


@pytest.mark.parametrize("doc", DOCS)
def test_named_configs_and_launch_scripts_exist(doc):
  """Every `configs/...py` and `launch/...py` a doc names is a file (a `:name` selector
  after a config file is the config's argument)."""
  path = os.path.join(REPO, doc)
  if not os.path.exists(path):
    pytest.skip(f"{doc} is not in this checkout")
  names = set(re.findall(r"(?<![\w/.])((?:configs|launch)/[\w/]+\.py)", _read(doc)))
  missing = sorted(n for n in names if not os.path.exists(os.path.join(REPO, n)))
  assert not missing, f"{doc} names missing files: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_no_working_notes(doc):
  path = os.path.join(REPO, doc)
  if not os.path.exists(path):
    pytest.skip(f"{doc} is not in this checkout")
  found = [l.strip() for l in _read(doc).splitlines() if NOTES.search(l)]
  assert not found, f"{doc}: working notes, say it plainly: {found}"
