"""Buddy placement by coordinate: permutations, off-node replicas, the docstrings' pictures; spare
placement by node: a lost node's ranks together, a lone rank on its own node."""

import pytest

from deadpool.policies import (BUDDY_POLICIES, SPARE_POLICIES, BuddyPolicy, FirstFree,
                               NextDpReplica, NextStage, RingOverNodes, SameNodeFirst, buddies_table,
                               buddy_table, check_placement, wards_table)
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
    dp, tp, pp, per_node, per_rack = layout
    dims = ParallelDims(dp, tp, pp, per_node, nodes_per_rack=per_rack)
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


# -- spare placement -------------------------------------------------------------------------------
# SameNodeFirst's picture: tp=4, 4 ranks per node (node0: ranks 0-3, node1: ranks 4-7), a free
# spare on node0 (slot 8), a spare node (node2: slots 9-12) and a free spare on node1 (slot 13)
SLOT_NODE = {**{s: s // 4 for s in range(8)}, 8: 0, 9: 2, 10: 2, 11: 2, 12: 2, 13: 1}
SPARES = {s: SLOT_NODE[s] for s in range(8, 14)}


def test_first_free_takes_the_lowest_slots_in_rank_order():
    assert FirstFree()({3: 0, 1: 0}, {9: 2, 7: 1, 8: 0}, {0, 1, 2}) == {1: 7, 3: 8}


def test_a_lost_node_goes_whole_to_one_spare_node_not_to_the_first_free_slots():
    dead = {r: 1 for r in range(4, 8)}
    spares = {s: n for s, n in SPARES.items() if n != 1}  # node1's spare went with it
    assert SameNodeFirst()(dead, spares, {0}) == {4: 9, 5: 10, 6: 11, 7: 12}
    assert FirstFree()(dead, spares, {0}) == {4: 8, 5: 9, 6: 10, 7: 11}  # what it replaces


def test_a_lone_dead_rank_takes_a_free_spare_on_its_own_node():
    policy = SameNodeFirst()
    assert policy({2: 0}, SPARES, {0, 1}) == {2: 8}
    assert policy({5: 1}, SPARES, {0, 1}) == {5: 13}
    # its node gone (no rank of it left): not its spare, which may be gone too
    assert policy({5: 1}, SPARES, {0}) == {5: 8}
    # rank 3 of node0 and rank 5 of node1 at once: each stays home
    assert policy({3: 0, 5: 1}, SPARES, {0, 1}) == {3: 8, 5: 13}


def test_a_lone_rank_off_its_node_fills_a_gap_and_leaves_whole_nodes_for_whole_losses():
    spares = {8: 2, 9: 2, 10: 2, 11: 2, 12: 3, 13: 3}  # node2 whole, node3 half
    assert SameNodeFirst()({5: 1}, spares, {0, 1}) == {5: 12}
    # (a node's ranks all dead in this failure, its spare not yet seen dead: used last)
    assert SameNodeFirst()({6: 3}, {12: 3, 8: 2, 9: 2}, {0, 1}) == {6: 8}


def test_a_group_no_node_can_take_is_split_over_the_fewest_nodes():
    dead = {r: 1 for r in range(4, 8)}
    # node2 [9 10 11], node3 [13 14], node4 [16]: node2 and one more; the rest fills node4's gap
    spares = {9: 2, 10: 2, 11: 2, 13: 3, 14: 3, 16: 4}
    got = SameNodeFirst()(dead, spares, {0})
    assert got == {4: 9, 5: 10, 6: 11, 7: 16}
    # node3 [13 14], node4 [16 17]: two nodes, not three
    got = SameNodeFirst()(dead, {13: 3, 14: 3, 16: 4, 17: 4, 20: 5}, {0})
    assert got == {4: 13, 5: 14, 6: 16, 7: 17}


def test_too_few_spares_go_to_the_lowest_ranks_of_the_largest_group_first():
    got = SameNodeFirst()({1: 0, 4: 1, 5: 1}, {9: 2, 10: 2}, {0, 1})
    assert got == {4: 9, 5: 10}  # node1's pair whole; rank 1 waits for ft.on_no_spare


def test_spare_placement_is_deterministic():
    dead = {7: 1, 4: 1, 6: 1, 5: 1, 2: 0}  # node1 lost and rank 2 of node0, in any order
    spares = {s: n for s, n in SPARES.items() if n != 1}
    a = SameNodeFirst()(dead, dict(reversed(list(spares.items()))), {0})
    b = SameNodeFirst()(dict(sorted(dead.items())), spares, {0})
    assert a == b == {2: 8, 4: 9, 5: 10, 6: 11, 7: 12}


def _swap(policy, slots: dict[int, int], spares: dict[int, int], dead_slots: set[int], rpn: int):
    """One recovery: the ranks on ``dead_slots`` get spares (``slots``, ``spares`` updated)."""
    dead = {r: s // rpn for r, s in slots.items() if s in dead_slots}
    alive = {s // rpn for s in slots.values() if s not in dead_slots}
    got = policy(dead, spares, alive)
    for r, s in got.items():
        slots[r] = s
        del spares[s]


@pytest.mark.parametrize("layout", [(2, 4, 2, 4), (4, 2, 1, 4), (2, 8, 1, 8), (4, 2, 2, 2)], ids=str)
def test_tensor_parallel_groups_stay_inside_a_node_when_a_node_is_lost_after_a_lone_rank(layout):
    """The layout of ``topology.node_slots`` (slot // ranks_per_node, two spare nodes after the
    ranks'): rank 0 dies alone (its node keeps no spare: its TP group must span two nodes), then
    each other node in turn is lost with every process on it; every other TP group must stay
    inside one node. ``first_free`` scatters the lost node's ranks over both spare nodes."""
    dims = ParallelDims(*layout)
    rpn, world = dims.ranks_per_node, dims.world_size
    scattered = 0
    for name, policy in (("same_node_first", SameNodeFirst()), ("first_free", FirstFree())):
        for lost in range(1, dims.num_nodes):
            slots = {r: r for r in range(world)}
            spares = {s: s // rpn for s in range(world, world + 2 * rpn)}
            _swap(policy, slots, spares, {0}, rpn)
            _swap(policy, slots, spares, set(range(lost * rpn, (lost + 1) * rpn)), rpn)
            split = [g for g in dims.axis_groups("tp")
                     if 0 not in g and len({slots[r] // rpn for r in g}) > 1]
            if name == "same_node_first":
                assert not split, (lost, slots)
            scattered += len(split)
    assert scattered  # what the default replaces


def test_the_spare_policies_are_selectable_by_name():
    assert set(SPARE_POLICIES) == {"first_free", "same_node_first"}
