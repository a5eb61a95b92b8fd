"""Placement policies: who replicates whom, and which spare replaces a dead rank.

Each policy is a small callable with its before -> after picture, so a reader can see what it does
without running it. Add a policy by adding a class and a name in ``BUDDY_POLICIES`` /
``SPARE_POLICIES``; ``conf/ft`` selects one by name.
"""

from __future__ import annotations


class RingOverNodes:
    """Each rank's buddy is the rank with the same local index on the next node (wrapping).

    ranks_per_node=2, 3 nodes::

        node0: [0 1]   node1: [2 3]   node2: [4 5]
        0 -> 2   1 -> 3   2 -> 4   3 -> 5   4 -> 0   5 -> 1

    Losing a whole node loses no replica of its ranks (their buddies are elsewhere); losing a node
    and the next one within one replication window loses the first node's state.
    With a single node there is no other failure domain; the ring then runs over ranks.
    """

    def __call__(self, rank: int, world_size: int, ranks_per_node: int) -> int:
        num_nodes = max(1, world_size // ranks_per_node)
        if num_nodes == 1:
            return (rank + 1) % world_size
        node, local = divmod(rank, ranks_per_node)
        return ((node + 1) % num_nodes) * ranks_per_node + local


class FirstFree:
    """Take the spare that registered first (lowest launch slot).

    spares [s5 s6 s7], rank 2 dies::

        before: ranks 0 1 2 3 -> p0 p1 p2 p3    spares: p5 p6 p7
        after:  ranks 0 1 2 3 -> p0 p1 p5 p3    spares: p6 p7
    """

    def __call__(self, dead_rank: int, spares: list[dict], ranks_per_node: int) -> dict:
        return min(spares, key=lambda s: s["slot"])


class SameNodeFirst:
    """Prefer a spare on the dead rank's node (keeps intra-node links for TP), else the first free.

    node1 hosts ranks 2,3 and spare p9; rank 3 dies::

        before: node1 [p2 p3 | p9]      after: node1 [p2 p9 | -]
    """

    def __call__(self, dead_rank: int, spares: list[dict], ranks_per_node: int) -> dict:
        node = dead_rank // ranks_per_node
        local = [s for s in spares if s.get("node") == node]
        return min(local or spares, key=lambda s: s["slot"])


BUDDY_POLICIES = {"ring_over_nodes": RingOverNodes}
SPARE_POLICIES = {"first_free": FirstFree, "same_node_first": SameNodeFirst}


def make_policy(table: dict, name: str):
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(table)}")
    return table[name]()
