"""Placement policies: who replicates whom, and which spare replaces a dead rank.

Each policy is a small callable with its before -> after picture, so a reader can see what it does
without running it. Add a policy by adding a class and a name in ``BUDDY_POLICIES`` /
``SPARE_POLICIES``; ``conf/ft`` selects one by name.

Spare policies map the dead ranks (rank -> the node its slot was on) and the free warm spares
(slot -> node), knowing which nodes still run a rank, to rank -> spare slot
(``recovery.plan.assign_spares`` supplies the nodes). ``same_node_first``, the default, keeps a
lost node's ranks together on one node, so tensor-parallel groups stay inside a node.

Buddy policies map a rank to the ranks holding its replicas, given the layout (``ParallelDims``:
``coords(rank) -> {pp, dp, tp}``, ``rank_of``, ``node_of``, ``num_nodes``). ``ft.replicas=k``
asks for ``k`` holders per rank (``buddies(rank, dims, k)``, the first being ``buddy``). Three
rules hold for every policy and every ``k``:

* each layer (the j-th buddy of every rank) is a permutation, so every rank holds exactly ``k``
  replicas, one per layer (k-regular: replication memory and traffic are the same on every rank);
* a rank's ``k`` buddies are ``k`` distinct ranks other than itself;
* with more than one node they sit on ``k`` distinct nodes other than the rank's own, so losing
  any ``k`` nodes never takes a rank's state and all its replicas (on one node: ``k`` other ranks).

Why k full replicas and not parity (erasure coding) across a group of buddies: a Reed-Solomon
code over g ranks with 2 parity shards protects against any two losses in the group with 2/g
of a rank's unique bytes per rank instead of k=2's 2x, but (1) the parity of a snapshot needs
every member's snapshot of the same step, a group-wide encode per snapshot on the replication
path (k replicas are point-to-point sends that start as soon as one rank's copy is done);
(2) rebuilding one rank reads g-1 survivors' shards plus parity, g times the bytes a replica
transfer moves, on the recovery's critical path; (3) with ZeRO-1 the unique region is already
1/dp of the optimizer state (``ft.replicate=unique``), so a second full copy costs 1/dp of the
optimizer state in host memory and replication bytes: small next to the local snapshot ring.
k replicas keep recovery a single transfer from any survivor; parity is not built.

``buddies_table`` computes and checks the whole map once per layout and ``k`` (a ``ValueError``
says why a ``k`` is impossible: fewer than ``k + 1`` nodes, or ranks on one node);
``check_placement`` lists what a layout and policy leave exposed.

Rank order is pp-major, then dp, then tp (``deadpool.topology``); the pictures write a rank as
``rank(pp,dp,tp)`` and a node as ``[...]``.
"""

from __future__ import annotations

from functools import lru_cache


class BuddyPolicy:
    """``policy(rank, dims) -> buddy`` (``dims``: a ``topology.ParallelDims``);
    ``buddies(rank, dims, k)``: the ``k`` holders of its replicas, the buddy first."""

    def __call__(self, rank: int, dims) -> int:
        return self.buddy(rank, dims)

    def buddy(self, rank: int, dims) -> int:
        raise NotImplementedError

    def buddies(self, rank: int, dims, k: int) -> tuple[int, ...]:
        """By default the policy applied 1, 2, ..., k times: each application is a permutation,
        so every layer is one (``buddies_table`` checks that the k are distinct and off-node)."""
        out, r = [], rank
        for _ in range(k):
            r = self.buddy(r, dims)
            out.append(r)
        return tuple(out)


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

    ``ft.replicas=k``: the j-th buddy is j racks over (whole racks first, then the nodes between
    them: node offsets ``stride, 2 stride, ..., then the rest``), each offset one permutation.
    ranks_per_node=2, 4 nodes, k=2 (every rank now holds 2 replicas, one per layer)::

        node0: [0 1]   node1: [2 3]   node2: [4 5]   node3: [6 7]
        before (k=1): 0 -> 2        1 -> 3        ... 6 -> 0        7 -> 1
        after  (k=2): 0 -> (2, 4)   1 -> (3, 5)   ... 6 -> (0, 2)   7 -> (1, 3)

    Losing node0 and node1 together (rank 0 and its first buddy, 2) leaves rank 0's replica on
    node2. One node (dp4 on a 4-rank node), k=2: ``0 -> (1, 2)  1 -> (2, 3)  2 -> (3, 0)  3 -> (0, 1)``.
    """

    def buddy(self, rank: int, dims) -> int:
        return self.buddies(rank, dims, 1)[0]

    def buddies(self, rank: int, dims, k: int) -> tuple[int, ...]:
        if dims.num_nodes == 1:
            return tuple((rank + j) % dims.world_size for j in range(1, k + 1))
        node, local = divmod(rank, dims.ranks_per_node)
        return tuple(((node + o) % dims.num_nodes) * dims.ranks_per_node + local
                     for o in _node_offsets(dims)[:k])


@lru_cache(maxsize=64)
def _node_offsets(dims) -> tuple[int, ...]:
    """Node offsets of the 1st, 2nd, ... buddy: whole racks over first, then the nodes between."""
    stride = dims.nodes_per_rack if dims.num_nodes > dims.nodes_per_rack else 1
    return tuple(sorted(range(1, dims.num_nodes), key=lambda o: (o % stride != 0, o)))


class _ShiftAlong(BuddyPolicy):
    """Buddy = the rank ``s`` steps further along one mesh axis, other coordinates equal, with the
    smallest ``s`` that puts *every* rank's buddy on another node (one ``s`` for all ranks keeps
    the map a permutation). On a single node ``s = 1``. With ``ft.replicas=k`` the j-th buddy
    takes the j-th smallest shift that puts every rank's j-th buddy on a node none of its
    earlier holders (nor itself) is on. When no such ``k`` shifts exist (the axis has size 1, or
    all of it sits on fewer than ``k + 1`` nodes) it falls back to ``RingOverNodes``."""

    axis = ""

    def buddy(self, rank: int, dims) -> int:
        return self.buddies(rank, dims, 1)[0]

    def buddies(self, rank: int, dims, k: int) -> tuple[int, ...]:
        shifts = _shifts(dims, self.axis, k)
        if shifts is None:
            return RingOverNodes().buddies(rank, dims, k)
        return tuple(_moved(dims, rank, self.axis, s) for s in shifts)


def _moved(dims, rank: int, axis: str, s: int) -> int:
    c = dims.coords(rank)
    c[axis] = (c[axis] + s) % getattr(dims, axis)
    return dims.rank_of(**c)


@lru_cache(maxsize=64)
def _shifts(dims, axis: str, k: int) -> tuple[int, ...] | None:
    """The ``k`` smallest shifts along ``axis``, taken greedily, that put every rank's holders on
    distinct nodes other than its own (on one node: distinct ranks); None if there are fewer."""
    chosen: list[int] = []
    for s in range(1, getattr(dims, axis)):
        if len(chosen) == k:
            break
        if dims.num_nodes == 1 or all(
                dims.node_of(_moved(dims, r, axis, s)) not in
                {dims.node_of(r)} | {dims.node_of(_moved(dims, r, axis, c)) for c in chosen}
                for r in range(dims.world_size)):
            chosen.append(s)
    return tuple(chosen) if len(chosen) == k else None


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

    dp=6, tp=1, pp=1, ranks_per_node=2, k=2 (shifts 2 and 4: both other nodes, and distinct)::

        node0: [0 1]   node1: [2 3]   node2: [4 5]
        before (k=1): 0 -> 2        1 -> 3        2 -> 4        ... 5 -> 1
        after  (k=2): 0 -> (2, 4)   1 -> (3, 5)   2 -> (4, 0)   ... 5 -> (1, 3)
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
    """The dead ranks, lowest first, take the spares that registered first (lowest launch slot);
    nodes are not looked at.

    spares [s5 s6 s7], rank 2 dies::

        before: ranks 0 1 2 3 -> p0 p1 p2 p3    spares: p5 p6 p7
        after:  ranks 0 1 2 3 -> p0 p1 p5 p3    spares: p6 p7
    """

    def __call__(self, dead: dict[int, int], spares: dict[int, int],
                 alive: set[int]) -> dict[int, int]:
        return dict(zip(sorted(dead), sorted(spares)))


class SameNodeFirst:
    """Keep each node's dead ranks together, on their own node when it lives, so that a
    tensor-parallel group (adjacent ranks, one node) stays inside one node after the swap.

    The dead ranks are grouped by the node their slot was on. A group goes to one node with room
    for all of it: its own node when that node still runs a rank and has enough free spares;
    else the node with the fewest free spares that still fit (a whole lost node fills a wholly
    free spare node, and one lost rank takes a gap before breaking into a whole free node),
    nodes that just lost every rank they ran (perhaps gone, their spares not yet seen dead) last.
    Groups that fit on their own node are placed first, then the largest first. When no node
    has room for a group, it is split over the fewest nodes (the most free spares first) and the
    caller logs it. Ties go to the lowest node, ranks and slots pair in order: deterministic.

    tp=4, 4 ranks per node; node0 also holds spare s8, node2 is a spare node. Node1 is lost
    (its ranks 4-7 with it)::

        before: node0 [0 1 2 3 | s8]   node1 [4 5 6 7]   node2 [s9 s10 s11 s12]
        after:  node0 [0 1 2 3 | s8]   node1  (lost)     node2 [4  5   6   7  ]
        (first_free: 4 -> s8 on node0, 5 6 7 -> node2: the TP group spans two nodes)

    Rank 2 dies alone (node0 lives and has s8 free)::

        before: node0 [0 1 2 3 | s8]        after: node0 [0 1 - 3 | 2]

    Node1 is lost and only node2 [s9 s10 s11] and node3 [s13 s14] are free: fewest nodes::

        after: 4 5 6 -> node2 [s9 s10 s11]   7 -> node3 [s13]   (logged as split)
    """

    def __call__(self, dead: dict[int, int], spares: dict[int, int],
                 alive: set[int]) -> dict[int, int]:
        free: dict[int, list[int]] = {}  # node -> its free spare slots, lowest first
        for slot, node in sorted(spares.items()):
            free.setdefault(node, []).append(slot)
        groups: dict[int, list[int]] = {}  # node -> the dead ranks its slots held
        for rank, node in sorted(dead.items()):
            groups.setdefault(node, []).append(rank)
        emptied = set(groups) - set(alive)

        def at_home(n: int) -> bool:
            return n in alive and len(free.get(n, ())) >= len(groups[n])

        out: dict[int, int] = {}
        for n in sorted(groups, key=lambda n: (not at_home(n), -len(groups[n]), n)):
            ranks = groups[n]
            while ranks and any(free.values()):
                m = _node_for(n if n in alive else None, len(ranks), free, emptied)
                take, free[m] = free[m][:len(ranks)], free[m][len(ranks):]
                out.update(zip(ranks, take))
                ranks = ranks[len(take):]
        return out


def _node_for(home: int | None, need: int, free: dict[int, list[int]], emptied: set[int]) -> int:
    """The node the next part of a group of ``need`` ranks goes to: one with room for all of it
    if any (``home`` first, then a tight fit, ``emptied`` nodes last), else the one with the
    most free spares (so the group spans the fewest nodes)."""
    has = [m for m, slots in free.items() if slots]
    fit = [m for m in has if len(free[m]) >= need]
    if fit:
        return min(fit, key=lambda m: (m != home, m in emptied, len(free[m]) - need, m))
    return min(has, key=lambda m: (-len(free[m]), m != home, m in emptied, m))


BUDDY_POLICIES = {"ring_over_nodes": RingOverNodes, "next_dp_replica": NextDpReplica,
                  "next_stage": NextStage}
SPARE_POLICIES = {"first_free": FirstFree, "same_node_first": SameNodeFirst}


def make_policy(table: dict, name: str):
    if name not in table:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(table)}")
    return table[name]()


def max_replicas(dims) -> int:
    """The most replicas per rank the layout can place (other nodes; on one node, other ranks)."""
    return max(1, (dims.world_size if dims.num_nodes == 1 else dims.num_nodes) - 1)


def check_replicas(dims, k: int) -> None:
    """Raise ``ValueError`` unless ``k`` replicas per rank can go to ``k`` distinct other nodes
    (on a single node: ``k`` other ranks)."""
    if k < 1:
        raise ValueError(f"ft.replicas must be >= 1, got {k}")
    if k == 1:
        return  # a single rank replicates to itself, as it always has
    shape = (f"dp{dims.dp} x tp{dims.tp} x pp{dims.pp}, {dims.ranks_per_node} rank(s) per node: "
             f"{dims.num_nodes} node(s)")
    if dims.num_nodes == 1 and k >= dims.world_size:
        raise ValueError(f"ft.replicas={k} needs {k + 1} ranks (each rank's replicas on {k} "
                         f"other ranks), but the layout has {dims.world_size} ({shape})")
    if dims.num_nodes > 1 and k >= dims.num_nodes:
        raise ValueError(f"ft.replicas={k} puts each rank's replicas on {k} distinct other nodes: "
                         f"it needs at least {k + 1} nodes, but the layout has {shape}; lower "
                         f"ft.replicas or raise the number of nodes")


def _violations(dims, table) -> list[str]:
    """What breaks the rules of the module docstring in a ``rank -> (k buddies)`` table."""
    out = []
    world, k = dims.world_size, len(table[0]) if table else 0
    for j in range(k):
        if sorted(t[j] for t in table) != list(range(world)):
            out.append(f"its buddy number {j + 1} is not a permutation: some ranks hold two "
                       f"replicas, some none")
    bad = [r for r, t in enumerate(table) if len(set(t)) < k or r in t]
    if world > 1 and bad:
        out.append(f"rank {bad[0]}'s holders {table[bad[0]]} repeat or include itself")
    if dims.num_nodes > 1 and k > 1:
        bad = [r for r, t in enumerate(table)
               if len({dims.node_of(b) for b in t} | {dims.node_of(r)}) < k + 1]
        if bad:
            out.append(f"rank {bad[0]}'s holders {table[bad[0]]} share a node (with each other "
                       f"or with rank {bad[0]})")
    return out


@lru_cache(maxsize=64)
def buddies_table(dims, name: str, k: int = 1) -> tuple[tuple[int, ...], ...]:
    """Every rank's ``k`` buddies under policy ``name`` (the first is ``buddy_table``'s); raises
    ``ValueError`` when ``k`` is impossible for the layout or the table breaks the rules."""
    check_replicas(dims, k)
    policy = make_policy(BUDDY_POLICIES, name)
    table = tuple(tuple(policy.buddies(r, dims, k)) for r in range(dims.world_size))
    bad = _violations(dims, table) if dims.world_size > 1 else []
    if bad:
        raise ValueError(f"buddy policy {name!r} with ft.replicas={k} on {dims}: {bad[0]}")
    return table


@lru_cache(maxsize=64)
def wards_table(dims, name: str, k: int = 1) -> tuple[tuple[int, ...], ...]:
    """The inverse of ``buddies_table``, layer by layer: rank ``b``'s j-th ward is the rank whose
    j-th buddy is ``b`` (every rank holds the replicas of its ``k`` wards)."""
    ward = [[0] * k for _ in range(dims.world_size)]
    for r, bs in enumerate(buddies_table(dims, name, k)):
        for j, b in enumerate(bs):
            ward[b][j] = r
    return tuple(tuple(w) for w in ward)


def buddy_table(dims, name: str) -> tuple[int, ...]:
    """Every rank's (first) buddy under policy ``name``; raises unless it is a permutation."""
    return tuple(t[0] for t in buddies_table(dims, name, 1))


def ward_table(dims, name: str) -> tuple[int, ...]:
    """The inverse of ``buddy_table``: whose replica each rank holds."""
    return tuple(w[0] for w in wards_table(dims, name, 1))


def check_placement(dims, policy="ring_over_nodes", replicate: str = "unique",
                    replicas: int = 1) -> list[str]:
    """What one node's loss would cost under this layout and buddy ``policy`` (a name or a
    ``BuddyPolicy``) with ``replicas`` holders per rank, as warnings (empty:
    every rank survives any single node's loss from memory). On a single node there is no other
    failure domain and nothing is reported.

    * a rank whose buddy is on its own node: that node's loss takes the rank and its replica;
    * with ``replicas > 1``, holders that repeat or share a node (fewer than ``replicas`` node
      losses then take every copy);
    * with ``replicate="unique"`` (the buddy holds only the optimizer shard), a model shard whose
      data-parallel peers all sit on one node: that node's loss takes every in-memory copy of the
      shard's parameters, and recovery falls back to the disk checkpoint.
    """
    if dims.num_nodes == 1:
        return []
    out = []
    fn = policy if isinstance(policy, BuddyPolicy) else make_policy(BUDDY_POLICIES, policy)
    layers = [fn.buddies(r, dims, replicas) for r in range(dims.world_size)]
    table = [t[0] for t in layers]
    if sorted(table) != list(range(dims.world_size)):
        out.append(f"buddy policy {policy!r} is not a permutation: some ranks hold two replicas, "
                   f"some none")
    if replicas > 1:
        out += [f"buddy policy {policy!r} with ft.replicas={replicas}: {v}"
                for v in _violations(dims, layers)]
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
