"""Group membership and the choice of groups a recovery keeps (deadpool/groups.py)."""

from deadpool.groups import reusable_groups


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
