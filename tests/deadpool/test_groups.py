"""Group membership and the choice of groups a recovery keeps (deadpool/rank/groups.py)."""

from deadpool.rank.groups import reusable_groups


def test_only_clean_groups_without_a_replaced_member_are_kept():
    members = {"tp/a": [0, 1], "tp/b": [2, 3], "dp/c": [0, 2], "dp/d": [1, 3], "repl/0-1": [0, 1]}
    counts = {0: {"tp/a": [5, 5], "dp/c": [2, 2]},
              1: {"tp/a": [5, 5], "dp/d": [2, 2]},
              2: {"tp/b": [6, 5], "dp/c": [2, 2]},   # left tp/b with an op in flight
              3: {"tp/b": [5, 5], "dp/d": [2, 2]}}
    assert reusable_groups(counts, members, replaced=set()) == ["dp/c", "dp/d", "tp/a"]
    assert reusable_groups(counts, members, replaced={3}) == ["dp/c", "tp/a"]
    counts[1]["tp/a"] = [4, 4]  # both clean but out of step: one never posted the 5th op
    assert "tp/a" not in reusable_groups(counts, members, replaced=set())


def test_two_replicas_give_each_rank_a_group_per_buddy_and_per_ward():
    from deadpool.rank.groups import all_groups, rank_groups
    from deadpool.topology import ParallelDims, Topology

    dims = ParallelDims(dp=2, tp=2, pp=2, ranks_per_node=2)  # 4 nodes: k=2 fits
    members = all_groups(dims, "ring_over_nodes", 2)
    for r in range(dims.world_size):
        topo = Topology(dims, r, 0, "ring_over_nodes", replicas=2)
        repl = {name: ranks for name, key, ranks, is_repl in rank_groups(topo) if is_repl}
        b, w = topo.buddies(), topo.wards()
        assert repl == {"repl_out": [r, b[0]], "repl_out1": [r, b[1]],
                        "repl_in": [w[0], r], "repl_in1": [w[1], r]}
        for name, key, ranks, _ in rank_groups(topo):
            assert members[key] == ranks
    assert sum(k.startswith("repl/") for k in members) == 2 * dims.world_size
