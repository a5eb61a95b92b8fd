"""Placement policies: who replicates whom, and which spare replaces a dead rank.

Each policy is a small callable with its before -> after picture, so a reader can see what it does
without running it. Add a policy by adding a class and a name in ``BUDDY_POLICIES`` /
``SPARE_POLICIES``; ``conf/ft`` selects one by name.

Buddy policies map a rank to the rank holding its replica, given the layout (``ParallelDims``:
``coords(rank) -> {pp, dp, tp}``, ``rank_of``, ``node_of``, ``num_nodes``). Two rules hold for
every one of them: the map is a permutation (each rank holds exactly one ward's replica, so
replication memory and traffic are the same on every rank), and with more than one node a rank's
buddy is on another node, so losing a node never takes a rank's state and its only replica.
``buddy_table`` computes and checks the whole map once per layout; ``check_placement`` lists
what a layout and policy leave exposed.

Rank order is pp-major, then dp, then tp (``deadpool.topology``); the pictures write a rank as
``rank(pp,dp,tp)`` and a node as ``[...]``.
"""

from __future__ import annotations

from functools import lru_cache


class BuddyPolicy:
    """``policy(rank, dims) -> buddy`` (``dims``: a ``topology.ParallelDims``)."""

    def __call__(self, rank: int, dims) -> int:
        return self.buddy(rank, dims)

    def buddy(self, rank: int, dims) -> int:
        raise NotImplementedError


class RingOverNodes(BuddyPolicy):
    """Each rank's buddy is the rank with the same local index one rack further (wrapping), so
    a rack lost whole (its switch, its power) takes no rank together with its replica.

    ranks_per_node=2, 3 nodes, one node per rack (``parallel.nodes_per_rack=1``)::

        node0: [0 1]   node1: [2 3]   node2: [4 5]
        0 -> 2   1 -> 3   2 -> 4   3 -> 5   4 -> 0   5 -> 1

    ranks_per_node=1, 4 nodes, ``nodes_per_rack=2``::

        rack0: [0] [1]   rack1: [2] [3]
        0 -> 2   1 -> 3   2 -> 0   3 -> 1

    Losing a whole node (or rack) loses no replica of its ranks (their buddies are elsewhere);
    losing it and the next one within one replication window loses the first one's state. With
    a single rack the ring runs over nodes; with a single node, over ranks.
    """

    def buddy(self, rank: int, dims) -> int:
        if dims.num_nodes == 1:
            return (rank + 1) % dims.world_size
        stride = dims.nodes_per_rack if dims.num_nodes > dims.nodes_per_rack else 1
        node, local = divmod(rank, dims.ranks_per_node)
        return ((node + stride) % dims.num_nodes) * dims.ranks_per_node + local


class _ShiftAlong(BuddyPolicy):
    """Buddy = the rank ``k`` steps further along one mesh axis, other coordinates equal, with the
    smallest ``k`` that puts *every* rank's buddy on another node (one ``k`` for all ranks keeps
    the map a permutation). On a single node ``k = 1``. When no ``k`` works (the axis has size 1,
    or all of it sits on one node) it falls back to ``RingOverNodes``."""

    axis = ""

    def buddy(self, rank: int, dims) -> int:
        k = _shift(dims, self.axis)
        return RingOverNodes().buddy(rank, dims) if k is None else _moved(dims, rank, self.axis, k)


def _moved(dims, rank: int, axis: str, k: int) -> int:
    c = dims.coords(rank)
    c[axis] = (c[axis] + k) % getattr(dims, axis)
    return dims.rank_of(**c)


@lru_cache(maxsize=64)
def _shift(dims, axis: str) -> int | None:
    for k in range(1, getattr(dims, axis)):
        if dims.num_nodes == 1 or all(dims.node_of(_moved(dims, r, axis, k)) != dims.node_of(r)
                                      for r in range(dims.world_size)):
            return k
    return None


class NextDpReplica(_ShiftAlong):
    """The buddy is the same model shard (same pp, tp) in the next data-parallel replica that sits
    on another node: it is itself a data-parallel peer, so besides the replicated optimizer shard
    it can also supply the dead rank's parameters (one source rebuilds the spare).
    Replication then shares the data-parallel links with the gradient reduce-scatter.

    dp=4, tp=1, pp=1, ranks_per_node=2 (k=1 stays on the node, so k=2)::

        node0: [0(0,0,0) 1(0,1,0)]   node1: [2(0,2,0) 3(0,3,0)]
        0 -> 2   1 -> 3   2 -> 0   3 -> 1

    dp=2, tp=2, pp=1, ranks_per_node=2 (a node is one tensor-parallel group, k=1)::

        node0: [0(0,0,0) 1(0,0,1)]   node1: [2(0,1,0) 3(0,1,1)]
        0 -> 2   1 -> 3   2 -> 0   3 -> 1

    When every data-parallel peer of a shard is on one node (dp2 x tp2 x pp2 on 4-rank nodes:
    a node per stage) no peer is off-node: it falls back to ``ring_over_nodes``.
    """

    axis = "dp"


class NextStage(_ShiftAlong):
    """The buddy is the rank with the same (dp, tp) in the next pipeline stage on another node.
    Replication rides the pipeline links (point-to-point activations only), not the data-parallel
    ones; the buddy holds a different model shard, so parameters come from a data-parallel peer.

    dp=2, tp=2, pp=2, ranks_per_node=4 (conf/parallel/dp2_tp2_pp2: a node per stage)::

        node0: [0(0,0,0) 1(0,0,1) 2(0,1,0) 3(0,1,1)]   node1: [4(1,0,0) 5(1,0,1) 6(1,1,0) 7(1,1,1)]
        0 -> 4   1 -> 5   2 -> 6   3 -> 7   4 -> 0   5 -> 1   6 -> 2   7 -> 3

    With pp == 1 it falls back to ``ring_over_nodes``.
    """

    axis = "pp"


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


BUDDY_POLICIES = {"ring_over_nodes": RingOverNodes, "next_dp_replica": NextDpReplica,
                  "next_stage": NextStage}
SPARE_POLICIES = {"first_free": FirstFree, "same_node_first": SameNodeFirst}


def make_policy(table: dict, name: str):
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(table)}")
    return table[name]()


@lru_cache(maxsize=64)
def buddy_table(dims, name: str) -> tuple[int, ...]:
    """Every rank's buddy under policy ``name``; raises unless it is a permutation."""
    policy = make_policy(BUDDY_POLICIES, name)
    table = tuple(policy.buddy(r, dims) for r in range(dims.world_size))
    if sorted(table) != list(range(dims.world_size)):
        raise ValueError(f"buddy policy {name!r} is not a permutation on {dims}")
    return table


@lru_cache(maxsize=64)
def ward_table(dims, name: str) -> tuple[int, ...]:
    """The inverse of ``buddy_table``: whose replica each rank holds."""
    ward = [0] * dims.world_size
    for r, b in enumerate(buddy_table(dims, name)):
        ward[b] = r
    return tuple(ward)


def check_placement(dims, policy="ring_over_nodes", replicate: str = "unique") -> list[str]:
    """What one node's loss would cost under this layout and buddy ``policy`` (a name or a
    ``BuddyPolicy``), as warnings (empty:
    every rank survives any single node's loss from memory). On a single node there is no other
    failure domain and nothing is reported.

    * a rank whose buddy is on its own node: that node's loss takes the rank and its replica;
    * with ``replicate="unique"`` (the buddy holds only the optimizer shard), a model shard whose
      data-parallel peers all sit on one node: that node's loss takes every in-memory copy of the
      shard's parameters, and recovery falls back to the disk checkpoint.
    """
    if dims.num_nodes == 1:
        return []
    out = []
    fn = policy if isinstance(policy, BuddyPolicy) else make_policy(BUDDY_POLICIES, policy)
    table = [fn.buddy(r, dims) for r in range(dims.world_size)]
    if sorted(table) != list(range(dims.world_size)):
        out.append(f"buddy policy {policy!r} is not a permutation: some ranks hold two replicas, "
                   f"some none")
    if dims.num_nodes > dims.nodes_per_rack > 1:
        racked = [r for r, b in enumerate(table) if dims.rack_of(r) == dims.rack_of(b)]
        if racked:
            out.append(f"{len(racked)} rank(s) have their buddy in their own rack (e.g. rank "
                       f"{racked[0]} -> {table[racked[0]]}, rack {dims.rack_of(racked[0])}): losing "
                       f"that rack loses the rank's state and its only replica; use buddy_policy "
                       f"ring_over_nodes")
    same = [r for r, b in enumerate(table) if dims.node_of(r) == dims.node_of(b)]
    if same:
        out.append(f"{len(same)} rank(s) have their buddy on their own node (e.g. rank {same[0]} -> "
                   f"{table[same[0]]}, node {dims.node_of(same[0])}): losing that node loses the "
                   f"rank's state and its only replica; use buddy_policy ring_over_nodes")
    if replicate == "unique" and dims.dp > 1:
        stuck = [g for g in dims.axis_groups("dp") if len({dims.node_of(r) for r in g}) == 1]
        if stuck:
            c = dims.coords(stuck[0][0])
            out.append(
                f"{len(stuck)} model shard(s) have every data-parallel copy on one node (e.g. "
                f"pp={c['pp']} tp={c['tp']}: ranks {stuck[0]} on node {dims.node_of(stuck[0][0])}): "
                f"losing that node loses the shard's parameters from memory, and with "
                f"ft.replicate=unique recovery falls back to disk; use ft.replicate=full or a layout "
                f"whose data-parallel peers span nodes")
    return out
