"""Who sends a version to whom: a pure function of the receivers' labels.

Plan (``plan_topology``), rooted at the sender:
- receivers on the sender's own host and in its datacenter (same ``host``
  and ``dc`` labels, shared memory enabled) hang directly off the sender:
  the shared-memory path writes the payload once and every local receiver
  maps it, so fan-out costs nothing;
- with shared memory on, every other host receives once per datacenter: its
  first receiver by name (the host's head) is in the tree, and the host's
  other receivers of that datacenter hang directly off their head and map
  its staging file. Hosts are grouped inside a datacenter only: a host label
  that appears in two datacenters counts as two machines, and bytes between
  them go over TCP (planes.py), which is how one machine emulates a
  cross-datacenter edge;
- the other heads of the sender's datacenter form a ``fanout``-ary tree
  under the sender (breadth-first, so depth is log_fanout(n)); every node
  forwards each verified chunk as soon as it has it, so depth adds one chunk
  of latency, not one payload;
- for every other datacenter exactly one edge crosses the slow link: sender ->
  that datacenter's relay (its first receiver by name), and the rest of that
  datacenter forms a ``fanout``-ary tree under the relay.

``plan_direct`` (every receiver a child of the sender) is the baseline the
benchmark compares against. Plans are recomputed at every publish from the
receivers alive at that moment, so a dead node simply drops out of the next
plan; during a transfer its children fall back to the sender (see receiver.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

Address = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class ReceiverInfo:
  """A receiver as the planner sees it.

  dc: datacenter label (from the config). host: host label; equal labels in
  the same datacenter mean the same machine (shared-memory eligible); in two
  datacenters they do not. address: where its server listens.
  """

  name: str
  dc: str
  host: str = ""
  address: Address = ("", 0)

  def to_json(self) -> dict:
    return {"name": self.name, "dc": self.dc, "host": self.host, "address": list(self.address)}

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "ReceiverInfo":
    host, port = d["address"]
    return cls(str(d["name"]), str(d["dc"]), str(d.get("host", "")), (str(host), int(port)))


@dataclasses.dataclass(frozen=True)
class TreeNode:
  """A node of a plan; ``info`` is None for the sender (the root)."""

  info: Optional[ReceiverInfo]
  children: tuple["TreeNode", ...] = ()

  def to_json(self) -> dict:
    return {
        "info": None if self.info is None else self.info.to_json(),
        "children": [c.to_json() for c in self.children],
    }

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "TreeNode":
    info = None if d.get("info") is None else ReceiverInfo.from_json(d["info"])
    return cls(info, tuple(cls.from_json(c) for c in d.get("children", ())))


def _kary(
    root: Optional[ReceiverInfo],
    nodes: Sequence[ReceiverInfo],
    fanout: int,
    local: Optional[Mapping[str, Sequence[ReceiverInfo]]] = None,
) -> list[TreeNode]:
  """Children of ``root`` when root + nodes are laid out as a breadth-first fanout-ary heap.

  local: receivers that hang off a node by its name, besides its heap children (same host).
  """
  order = [root, *nodes]
  local = local or {}

  def build(j: int) -> TreeNode:
    kids = range(j * fanout + 1, min(j * fanout + fanout, len(order) - 1) + 1)
    node = order[j]
    same_host = tuple(TreeNode(r) for r in local.get(node.name, ())) if node is not None else ()
    return TreeNode(order[j], same_host + tuple(build(k) for k in kids))

  return list(build(0).children)


def _by_host(
    receivers: Sequence[ReceiverInfo],
) -> tuple[list[ReceiverInfo], dict[str, list[ReceiverInfo]]]:
  """(the first receiver of every host, in order; {head name: that host's other receivers})."""
  heads: dict[str, ReceiverInfo] = {}
  local: dict[str, list[ReceiverInfo]] = {}
  for r in receivers:
    head = heads.setdefault(r.host, r)
    if head is not r:
      local.setdefault(head.name, []).append(r)
  return list(heads.values()), local


def _check(receivers: Sequence[ReceiverInfo], fanout: int) -> None:
  if fanout < 1:
    raise ValueError(f"fanout={fanout} must be at least 1.")
  names = [r.name for r in receivers]
  dup = sorted({n for n in names if names.count(n) > 1})
  if dup:
    raise ValueError(f"receiver name {dup[0]!r} appears twice; give every receiver a unique name.")


def plan_topology(
    receivers: Sequence[ReceiverInfo],
    sender_dc: str,
    fanout: int,
    sender_host: Optional[str] = None,
) -> TreeNode:
  """Broadcast plan: trees inside datacenters, one relay edge per far datacenter.

  receivers: everyone to deliver to (any order; the plan sorts by name).
  sender_host: the sender's host label when the shared-memory path is on,
  else None (then receivers are not grouped by host); only receivers of
  sender_dc on that host hang off the sender as same-host ones. Returns the
  root (the sender) of a tree that contains every receiver exactly once.
  """
  _check(receivers, fanout)
  by_dc: dict[str, list[ReceiverInfo]] = {}
  for r in sorted(receivers, key=lambda r: r.name):
    by_dc.setdefault(r.dc, []).append(r)
  shared = sender_host is not None

  def group(rs: list[ReceiverInfo]) -> tuple[list[ReceiverInfo], dict[str, list[ReceiverInfo]]]:
    return _by_host(rs) if shared else (rs, {})

  local = by_dc.pop(sender_dc, [])
  shm = [r for r in local if shared and r.host == sender_host]
  heads, same_host = group([r for r in local if not (shared and r.host == sender_host)])
  children = [TreeNode(r) for r in shm] + _kary(None, heads, fanout, same_host)
  for dc in sorted(by_dc):
    (relay, *others), same_host = group(by_dc[dc])
    children.append(TreeNode(relay, tuple(_kary(relay, others, fanout, same_host))))
  return TreeNode(None, tuple(children))


def plan_direct(receivers: Sequence[ReceiverInfo]) -> TreeNode:
  """Baseline plan: the sender sends to every receiver itself."""
  _check(receivers, 1)
  return TreeNode(None, tuple(TreeNode(r) for r in sorted(receivers, key=lambda r: r.name)))


def iter_edges(node: TreeNode) -> Iterator[tuple[Optional[ReceiverInfo], ReceiverInfo]]:
  """(parent, child) pairs; parent None is the sender."""
  for c in node.children:
    yield node.info, c.info
    yield from iter_edges(c)


def path_to(tree: TreeNode, name: str) -> Optional[list[TreeNode]]:
  """The nodes from ``tree`` down to the receiver called ``name`` (names are unique in a plan);
  None if the plan does not include it."""
  if tree.info is not None and tree.info.name == name:
    return [tree]
  for child in tree.children:
    below = path_to(child, name)
    if below is not None:
      return [tree, *below]
  return None
