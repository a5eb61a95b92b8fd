"""Buddy placement by coordinate: permutations, off-node replicas, the docstrings' pictures."""

import pytest

from deadpool.policies import (BUDDY_POLICIES, BuddyPolicy, NextDpReplica, NextStage, RingOverNodes,
                               buddies_table, buddy_table, check_placement, wards_table)
from deadpool.topology import ParallelDims, Topology

# (dp, tp, pp, ranks_per_node): 1-D, 3-D, the CPU test layouts, the A100 layouts (scaled down
# in dp), a world smaller than one node
LAYOUTS = [(4, 1, 1, 1), (6, 1, 1, 2), (4, 1, 1, 2), (2, 2, 2, 4), (2, 2, 2, 2), (4, 2, 2, 4),
           (8, 1, 3, 4), (4, 4, 1, 4), (8, 2, 1, 4), (4, 4, 2, 4), (4, 4, 8, 4), (3, 1, 1, 4),
           (2, 2, 1, 8), (1, 1, 1, 1)]


@pytest.mark.parametrize("name", sorted(BUDDY_POLICIES))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_policy_is_a_permutation_with_buddies_on_other_nodes(name, layout):
    dims = ParallelDims(*layout)
    table = buddy_table(dims, name)
    assert sorted(table) == list(range(dims.world_size))
    if dims.num_nodes > 1:
        assert all(dims.node_of(r) != dims.node_of(b) for r, b in enumerate(table))
        assert not any("own node" in w for w in check_placement(dims, name))
    elif dims.world_size > 1:
        assert all(b != r for r, b in enumerate(table))  # one node: still someone else
    for r in range(dims.world_size):
        topo = Topology(dims, r, 0, name)
        assert Topology(dims, topo.buddy(), 0, name).ward() == r


def test_ring_over_nodes_matches_its_docstring():
    dims = ParallelDims(dp=6, ranks_per_node=2)
    assert list(buddy_table(dims, "ring_over_nodes")) == [2, 3, 4, 5, 0, 1]
    assert [RingOverNodes()(r, dims) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    # a world smaller than one node: the ring runs over ranks
    assert list(buddy_table(ParallelDims(dp=3, ranks_per_node=4), "ring_over_nodes")) == [1, 2, 0]


def test_next_dp_replica_matches_its_docstring():
    # dp=4 on 2-rank nodes: the next replica is on the same node, so the shift is 2
    assert list(buddy_table(ParallelDims(dp=4, ranks_per_node=2), "next_dp_replica")) == [2, 3, 0, 1]
    dims = ParallelDims(dp=2, tp=2, ranks_per_node=2)
    assert [dims.coords(r) for r in range(4)] == [
        {"pp": 0, "dp": 0, "tp": 0}, {"pp": 0, "dp": 0, "tp": 1},
        {"pp": 0, "dp": 1, "tp": 0}, {"pp": 0, "dp": 1, "tp": 1}]
    assert list(buddy_table(dims, "next_dp_replica")) == [2, 3, 0, 1]
    # the buddy is a data-parallel peer: it also holds the parameters
    for r, b in enumerate(buddy_table(dims, "next_dp_replica")):
        assert b in dims.state_peers(r)
    # every dp peer of a shard on one node (a node per stage): falls back to the ring over nodes
    dims = ParallelDims(dp=2, tp=2, pp=2, ranks_per_node=4)
    assert buddy_table(dims, "next_dp_replica") == buddy_table(dims, "ring_over_nodes")


def test_next_stage_matches_its_docstring():
    dims = ParallelDims(dp=2, tp=2, pp=2, ranks_per_node=4)
    assert [dims.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert list(buddy_table(dims, "next_stage")) == [4, 5, 6, 7, 0, 1, 2, 3]
    for r, b in enumerate(buddy_table(dims, "next_stage")):
        c, cb = dims.coords(r), dims.coords(b)
        assert (c["dp"], c["tp"]) == (cb["dp"], cb["tp"]) and cb["pp"] == (c["pp"] + 1) % 2
    # pp == 1: the ring over nodes
    dims = ParallelDims(dp=4, tp=1, ranks_per_node=2)
    assert buddy_table(dims, "next_stage") == buddy_table(dims, "ring_over_nodes")


def test_next_dp_replica_on_an_a100_layout_keeps_pp_and_tp():
    # llama7b_a100_80g scaled down: tp2 on 4-GPU nodes, two data-parallel replicas per node
    dims = ParallelDims(dp=8, tp=2, pp=1, ranks_per_node=4)
    for r, b in enumerate(buddy_table(dims, "next_dp_replica")):
        c, cb = dims.coords(r), dims.coords(b)
        assert (c["pp"], c["tp"]) == (cb["pp"], cb["tp"])
        assert cb["dp"] == (c["dp"] + 2) % 8       # +1 is the same node
        assert dims.node_of(b) != dims.node_of(r)


def test_check_placement_warns_when_all_dp_peers_share_a_node():
    # the CPU 3-D layout: node 0 is stage 0, so every copy of a stage-0 shard is on node 0
    dims = ParallelDims(dp=2, tp=2, pp=2, ranks_per_node=4)
    (w,) = check_placement(dims, "ring_over_nodes")
    assert "4 model shard(s) have every data-parallel copy on one node" in w
    assert "ranks [0, 2] on node 0" in w and "falls back to disk" in w
    assert check_placement(dims, "ring_over_nodes", replicate="full") == []
    # dp spread over nodes (a node per tensor-parallel group): nothing to report
    assert check_placement(ParallelDims(dp=4, tp=4, pp=2, ranks_per_node=4), "next_dp_replica") == []
    assert check_placement(ParallelDims(dp=4, ranks_per_node=4), "ring_over_nodes") == []  # one node


def test_check_placement_warns_about_a_buddy_on_its_own_node():
    class SameNode(BuddyPolicy):
        def buddy(self, rank, dims):
            return rank ^ 1

    dims = ParallelDims(dp=4, ranks_per_node=2)
    warnings = check_placement(dims, SameNode())
    assert any("4 rank(s) have their buddy on their own node (e.g. rank 0 -> 1, node 0)" in w
               for w in warnings)

    class NotAPermutation(BuddyPolicy):
        def buddy(self, rank, dims):
            return (rank // 2 * 2 + 2) % dims.world_size

    assert any("not a permutation" in w for w in check_placement(dims, NotAPermutation()))


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        buddy_table(ParallelDims(dp=2), "nope")


@pytest.mark.parametrize("name,cls", [("next_dp_replica", NextDpReplica), ("next_stage", NextStage)])
def test_coordinate_policies_called_directly_agree_with_the_table(name, cls):
    dims = ParallelDims(dp=4, ranks_per_node=2)
    assert tuple(cls()(r, dims) for r in range(4)) == buddy_table(dims, name)


@pytest.mark.parametrize("name", sorted(BUDDY_POLICIES))
def test_the_a100_layouts_survive_any_node_loss_from_memory(name):
    from pathlib import Path

    import yaml

    files = sorted((Path(__file__).resolve().parents[2] / "conf" / "parallel").glob("llama*_a100_*.yaml"))
    assert len(files) == 8
    for f in files:
        p = yaml.safe_load(f.read_text())
        dims = ParallelDims(p["dp"], p["tp"], p["pp"], p["ranks_per_node"])
        assert check_placement(dims, name) == [], f.name


def test_ring_over_nodes_goes_one_rack_over_when_nodes_share_a_rack():
    dims = ParallelDims(dp=4, ranks_per_node=1, nodes_per_rack=2)
    assert list(buddy_table(dims, "ring_over_nodes")) == [2, 3, 0, 1]  # the docstring's picture
    for layout in [(16, 4, 8, 4, True, 2), (8, 1, 1, 2, True, 2), (6, 1, 1, 1, True, 3)]:
        d = ParallelDims(*layout)
        table = buddy_table(d, "ring_over_nodes")
        assert sorted(table) == list(range(d.world_size))
        assert all(d.rack_of(r) != d.rack_of(b) for r, b in enumerate(table)), layout
        assert check_placement(d, "ring_over_nodes") == []
    # one rack only: the ring runs over its nodes
    assert list(buddy_table(ParallelDims(dp=2, ranks_per_node=1, nodes_per_rack=2),
                            "ring_over_nodes")) == [1, 0]


def test_a_buddy_in_the_same_rack_is_reported():
    dims = ParallelDims(dp=4, ranks_per_node=1, nodes_per_rack=2)
    assert any("own rack" in w for w in check_placement(dims, "next_dp_replica"))


# -- ft.replicas=k ---------------------------------------------------------------------------------
# (dp, tp, pp, ranks_per_node, nodes_per_rack), k: layouts with at least k + 1 nodes (or one node
# with at least k + 1 ranks)
K_LAYOUTS = [((4, 1, 1, 4, 1), 2), ((4, 1, 1, 4, 1), 3), ((4, 1, 1, 1, 1), 3), ((6, 1, 1, 2, 1), 2),
             ((2, 2, 2, 2, 1), 2), ((2, 2, 2, 2, 1), 3), ((8, 1, 3, 4, 1), 2), ((8, 2, 1, 4, 1), 3),
             ((4, 4, 8, 4, 1), 2), ((16, 4, 8, 4, 2), 3), ((4, 1, 1, 1, 2), 2), ((6, 1, 1, 1, 3), 4)]


@pytest.mark.parametrize("name", sorted(BUDDY_POLICIES))
@pytest.mark.parametrize("layout,k", K_LAYOUTS, ids=str)
def test_k_buddies_are_distinct_ranks_on_distinct_other_nodes_and_k_regular(name, layout, k):
    dims = ParallelDims(*layout)
    table = buddies_table(dims, name, k)
    held = [0] * dims.world_size
    for r, bs in enumerate(table):
        assert len(bs) == k and len(set(bs)) == k and r not in bs
        if dims.num_nodes > 1:
            assert len({dims.node_of(b) for b in bs} | {dims.node_of(r)}) == k + 1, (r, bs)
        for b in bs:
            held[b] += 1
    assert held == [k] * dims.world_size  # every rank holds exactly k replicas
    for j in range(k):  # and each layer is a permutation
        assert sorted(bs[j] for bs in table) == list(range(dims.world_size))
    wards = wards_table(dims, name, k)
    for r in range(dims.world_size):
        topo = Topology(dims, r, 0, name, replicas=k)
        assert topo.buddies() == table[r] and topo.buddy() == table[r][0]
        for j, w in enumerate(topo.wards()):
            assert table[w][j] == r and wards[r][j] == w
    assert not any("ft.replicas" in w or "own node" in w for w in check_placement(dims, name, replicas=k))


def test_k_buddies_match_the_docstring_pictures():
    # ring over 4 two-rank nodes, k=2: one node over, then two
    dims = ParallelDims(dp=8, ranks_per_node=2)
    t = buddies_table(dims, "ring_over_nodes", 2)
    assert [t[r] for r in (0, 1, 6, 7)] == [(2, 4), (3, 5), (0, 2), (1, 3)]
    # one 4-rank node (conf/parallel/dp4), k=2: the next two ranks
    assert buddies_table(ParallelDims(dp=4, ranks_per_node=4), "ring_over_nodes", 2) == \
        ((1, 2), (2, 3), (3, 0), (0, 1))
    # next_dp_replica, dp6 on 2-rank nodes: shifts 2 and 4
    t = buddies_table(ParallelDims(dp=6, ranks_per_node=2), "next_dp_replica", 2)
    assert [t[r] for r in (0, 1, 2, 5)] == [(2, 4), (3, 5), (4, 0), (1, 3)]
    # racks: the first buddy is a rack over (as with k=1), the second a node within reach
    dims = ParallelDims(dp=4, ranks_per_node=1, nodes_per_rack=2)
    assert buddies_table(dims, "ring_over_nodes", 2) == ((2, 1), (3, 2), (0, 3), (1, 0))
    # the first buddy does not change with k (a k=1 job's replica stays where it was)
    for layout in [(8, 1, 1, 2), (2, 2, 2, 2), (16, 4, 8, 4, True, 2)]:
        d = ParallelDims(*layout)
        assert [t[0] for t in buddies_table(d, "ring_over_nodes", 2)] == list(buddy_table(d, "ring_over_nodes"))


@pytest.mark.parametrize("layout,k,msg", [
    ((4, 1, 1, 2), 2, "ft.replicas=2 puts each rank's replicas on 2 distinct other nodes: it "
                      "needs at least 3 nodes, but the layout has dp4 x tp1 x pp1, 2 rank(s) per "
                      "node: 2 node(s)"),
    ((2, 2, 2, 4), 2, "needs at least 3 nodes"),
    ((4, 1, 1, 4), 4, "ft.replicas=4 needs 5 ranks"),
    ((1, 1, 1, 1), 2, "ft.replicas=2 needs 3 ranks"),
    ((4, 1, 1, 4), 0, "ft.replicas must be >= 1, got 0"),
])
def test_an_impossible_number_of_replicas_is_refused_with_the_reason(layout, k, msg):
    with pytest.raises(ValueError, match="ft.replicas") as e:
        buddies_table(ParallelDims(*layout), "ring_over_nodes", k)
    assert msg in str(e.value)


def test_a_custom_policy_whose_iterates_share_a_node_is_reported():
    class Swap(BuddyPolicy):  # a permutation of period 2: its 2nd application is the rank itself
        def buddy(self, rank, dims):
            return rank ^ 2

    dims = ParallelDims(dp=8, ranks_per_node=2)  # 4 nodes
    warnings = check_placement(dims, Swap(), replicas=2)
    assert any("repeat or include itself" in w for w in warnings), warnings
