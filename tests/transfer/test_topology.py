"""Broadcast plans: every receiver exactly once, one cross-datacenter edge per far datacenter."""

import collections

import pytest

from streamrl.transfer.topology import (
    ReceiverInfo,
    TreeNode,
    iter_edges,
    path_to,
    plan_direct,
    plan_topology,
)

pytestmark = [pytest.mark.unit]


def _receivers(counts, host=lambda dc, i: f"{dc}-h{i}"):
  return [
      ReceiverInfo(f"{dc}{i}", dc, host(dc, i), ("127.0.0.1", 1000 + k))
      for k, (dc, i) in enumerate((dc, i) for dc, n in counts.items() for i in range(n))
  ]


def _depth(node, d=0):
  return max([d] + [_depth(c, d + 1) for c in node.children])


@pytest.mark.parametrize("fanout", [1, 2, 3, 8])
def test_every_receiver_once_and_one_crossing_per_far_dc(fanout):
  rs = _receivers({"A": 7, "B": 5, "C": 1})
  tree = plan_topology(rs[::-1], "A", fanout)
  edges = list(iter_edges(tree))
  children = [c.name for _, c in edges]
  assert sorted(children) == sorted(r.name for r in rs)  # exactly once each
  crossing = [(p, c) for p, c in edges if (p.dc if p else "A") != c.dc]
  assert sorted(c.dc for _, c in crossing) == ["B", "C"]
  assert all(p is None for p, _ in crossing)  # only the sender crosses, to one relay per datacenter
  out = collections.Counter(p.name if p else None for p, _ in edges)
  assert all(n <= fanout for name, n in out.items() if name is not None)
  assert out[None] <= fanout + 2  # local subtrees + one relay per far datacenter
  assert plan_topology(rs, "A", fanout) == tree  # deterministic


def test_tree_depth_is_logarithmic():
  tree = plan_topology(_receivers({"A": 15}), "A", 2)
  assert _depth(tree) == 4  # sender + 15 in a binary heap: 16 nodes, depth 4
  assert _depth(plan_topology(_receivers({"A": 15}), "A", 1)) == 15  # fanout 1 is a chain


def test_same_host_receivers_hang_off_the_sender_when_shm_is_on():
  rs = _receivers({"A": 6}, host=lambda dc, i: "trainer" if i < 4 else f"h{i}")
  tree = plan_topology(rs, "A", 1, sender_host="trainer")
  direct = [c.info.name for c in tree.children]
  assert direct[:4] == ["A0", "A1", "A2", "A3"] and all(not c.children for c in tree.children[:4])
  assert len(list(iter_edges(tree))) == 6
  no_shm = plan_topology(rs, "A", 1)
  assert len(no_shm.children) == 1


def test_direct_plan_and_bad_input():
  rs = _receivers({"A": 2, "B": 3})
  tree = plan_direct(rs)
  assert all(not c.children for c in tree.children) and len(tree.children) == 5
  with pytest.raises(ValueError, match="unique"):
    plan_topology(rs + rs[:1], "A", 2)
  with pytest.raises(ValueError, match="fanout"):
    plan_topology(rs, "A", 0)
  assert TreeNode.from_json(plan_topology(rs, "A", 2).to_json()) == plan_topology(rs, "A", 2)
  assert plan_topology([], "A", 2) == TreeNode(None, ())


def test_with_shm_every_other_host_receives_once_and_its_receivers_map_the_head():
  rs = _receivers({"A": 9, "B": 6}, host=lambda dc, i: f"{dc}-h{i // 3}")  # three per host
  tree = plan_topology(rs, "A", 2, sender_host="trainer")
  edges = list(iter_edges(tree))
  assert sorted(c.name for _, c in edges) == sorted(r.name for r in rs)
  into_host = collections.Counter(c.host for p, c in edges if p is None or p.host != c.host)
  assert all(n == 1 for n in into_host.values()) and len(into_host) == 5  # one stream per host
  for p, c in edges:  # within a host, everyone hangs off the host's first receiver
    if p is not None and p.host == c.host:
      assert p.name == min(r.name for r in rs if r.host == c.host)
  assert sum(p is None and c.dc != "A" for p, c in edges) == 1  # still one relay for B
  no_shm = plan_topology(rs, "A", 2)  # without shared memory a host is not special
  assert sum(p is None or p.host != c.host for p, c in iter_edges(no_shm) if c.host == "A-h0") > 1


def test_the_senders_host_label_in_another_datacenter_gets_one_relay_edge():
  # One machine emulating two datacenters: every receiver carries the sender's host label.
  rs = _receivers({"A": 2, "B": 3}, host=lambda dc, i: "trainer")
  tree = plan_topology(rs, "A", 2, sender_host="trainer")
  shape = [(c.info.name, [g.info.name for g in c.children]) for c in tree.children]
  assert shape == [("A0", []), ("A1", []), ("B0", ["B1", "B2"])]  # A: off the sender (shm)
  edges = list(iter_edges(tree))
  assert [c.name for p, c in edges if (p.dc if p else "A") != c.dc] == ["B0"]  # one crossing


def test_path_to_names_every_parent_down_to_the_receiver():
  tree = plan_topology(_receivers({"A": 7}), "A", 2)
  for parent, child in iter_edges(tree):
    path = path_to(tree, child.name)
    assert path[0] is tree and path[-1].info == child
    assert (path[-2].info if len(path) > 1 else None) == parent
    assert all(b in a.children for a, b in zip(path, path[1:]))
  assert path_to(tree, "nobody") is None
