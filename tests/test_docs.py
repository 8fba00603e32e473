"""The relative links of the README and the results page point at files of the repository."""

import os
import re

import pytest

pytestmark = [pytest.mark.unit]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "experiments/RESULTS.md", "docs/DESIGN.md"]

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
