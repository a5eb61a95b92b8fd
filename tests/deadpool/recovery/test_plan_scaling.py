"""The recovery path is linear in the world size (deadpool/recovery/plan.py, deadpool/rank/groups.py).

The functions the planner used before (kept here as references, O(N^2)) and the linear ones
must give identical answers on randomized inputs; and the linear ones must do O(N) work, counted
in Python function calls (not wall time): eight times the ranks, about eight times the calls."""

from __future__ import annotations

import random
import sys

import pytest

from deadpool.policies import BUDDY_POLICIES, buddy_table
from deadpool.rank.groups import all_groups, rank_groups, reusable_groups
from deadpool.recovery import plan
from deadpool.store.protocol import RankStatus, Source
from deadpool.topology import ParallelDims, Topology


# -- references: the code before (quadratic) ------------------------------------------------------
def ref_plan_resume(statuses: dict[int, RankStatus], world: list[int], equivalents, buddy_of,
                order=plan.SOURCE_KINDS,
                bad: set[tuple[int, int, int]] = frozenset(), sharded: bool = False,
                replica_has_shared: bool = True) -> plan.RecoveryDecision:
    for kind in order:
        if kind not in plan.SOURCE_KINDS:
            raise ValueError(f"ft.state_sources: {kind!r} is not one of {plan.SOURCE_KINDS}")
    steps: set[int] = set()
    for st in statuses.values():
        steps.update(st.local_steps)
        if st.live_step is not None:
            steps.add(st.live_step)
        for held in st.replicas.values():
            steps.update(held)
    live_max = max((st.live_step for st in statuses.values() if st.live_step is not None),
                   default=0)
    covered: set[int] = set()
    for S in sorted(steps, reverse=True):
        load: dict[int, int] = {}  # holder -> transfers it serves (spread peer sends)
        sources: dict[int, Source] = {}
        for r in world:
            src = _ref_source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded,
                          replica_has_shared)
            if src is None:
                break
            sources[r] = src
            covered.add(r)
        else:
            return plan.RecoveryDecision(S, sources, max(0, live_max - S))
    # keep scanning to know which ranks have a copy at *some* step (for the message)
    for r in world:
        if r not in covered and any(_ref_source(r, S, statuses, equivalents, buddy_of, order, bad, {},
                                            sharded, replica_has_shared) for S in steps):
            covered.add(r)
    lost = [r for r in world if r not in covered]
    why = (f"no consistent copy of rank(s) {lost} survives in memory" if lost else
           "the ranks' snapshots and replicas share no step")
    return plan.RecoveryDecision(None, {}, 0, why, lost)


def _ref_source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded=False,
            replica_has_shared=True) -> Source | None:
    src = _ref_held_source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded,
                       replica_has_shared)
    if src is None and S == 0:
        return Source("init", r)
    return src


def _ref_held_source(r, S, statuses, equivalents, buddy_of, order, bad, load, sharded,
                 replica_has_shared) -> Source | None:
    st = statuses.get(r)
    if st is not None and st.live_step == S:
        return Source("live", r)
    if plan._has_own(st, S) and (r, r, S) not in bad:
        return Source("local", r)
    if sharded:  # the optimizer shard exists only in r's replicas
        h = _ref_pick(r, S, "replica", statuses, equivalents, buddy_of, bad, load)
        if h is None:
            return None
        if replica_has_shared:
            return Source("replica", h)
        q = _ref_pick(r, S, "peer", statuses, equivalents, buddy_of, bad, load)
        if q is not None:
            return Source("replica", h, shared_from=q)
        # no peer left: the parameters from the group's shard replicas (their master weights)
        froms = [h if d == r else _ref_pick(d, S, "replica", statuses, equivalents, buddy_of,
                                            bad, load) for d in equivalents(r)]
        return None if None in froms else Source("replica", h, params_from=froms)
    for kind in order:
        h = _ref_pick(r, S, kind, statuses, equivalents, buddy_of, bad, load)
        if h is not None:
            return Source(kind, h)
    return None


def _ref_pick(r, S, kind, statuses, equivalents, buddy_of, bad, load) -> int | None:
    if kind == "peer":
        holders = [q for q in equivalents(r) if q != r and plan._has_own(statuses.get(q), S)
                   and (q, q, S) not in bad]
        # prefer a peer already at S (no rollback needed to serve), then the least loaded
        holders.sort(key=lambda q: (load.get(q, 0), statuses[q].live_step != S, q))
    else:
        holders = [q for q, st_q in statuses.items() if q != r
                   and S in st_q.replicas.get(r, []) and (q, r, S) not in bad]
        pref = buddy_of(r)
        holders.sort(key=lambda q: (q != pref, load.get(q, 0), q))
    if not holders:
        return None
    load[holders[0]] = load.get(holders[0], 0) + 1
    return holders[0]


def ref_members(dims: ParallelDims, policy: str) -> dict[str, list[int]]:
    """``groups_to_keep``'s enumeration before: every rank's groups, each found by scanning every
    group of its axis, the ward by searching the buddy table."""
    members = {}
    for r in range(dims.world_size):
        c = dims.coords(r)
        out = []
        for axis in ("dp", "tp"):
            ranks = next(g for g in dims.axis_groups(axis) if r in g)
            if len(ranks) > 1:
                rest = "-".join(f"{a}{c[a]}" for a in ("pp", "dp", "tp") if a != axis)
                out.append((f"{axis}/{rest}", ranks))
        if dims.pp > 1:
            def pair(s):
                a, b = dims.rank_of(s, c["dp"], c["tp"]), dims.rank_of(s + 1, c["dp"], c["tp"])
                return (f"ppf/{a}-{b}", [a, b]), (f"ppb/{b}-{a}", [b, a])
            if c["pp"] < dims.pp - 1:
                out += list(pair(c["pp"]))
            if c["pp"] > 0:
                out += list(pair(c["pp"] - 1))
        table = buddy_table(dims, policy)
        buddy, ward = table[r], table.index(r)
        if buddy != r:
            out += [(f"repl/{r}-{buddy}", [r, buddy]), (f"repl/{ward}-{r}", [ward, r])]
        for key, ranks in out:
            members[key] = ranks
    return members


def ref_state_peers(dims: ParallelDims, rank: int) -> list[int]:
    c = dims.coords(rank)
    return [r for r in range(dims.world_size)
            if dims.coords(r)["pp"] == c["pp"] and dims.coords(r)["tp"] == c["tp"]]


# -- randomized inputs --------------------------------------------------------------------------
def random_dims(rng: random.Random) -> ParallelDims:
    while True:
        dp, tp, pp = rng.randint(1, 6), rng.choice([1, 2]), rng.randint(1, 3)
        per_node = rng.choice([tp, 2 * tp])
        if (dp * tp * pp) % per_node == 0 or dp * tp * pp <= per_node:
            try:
                return ParallelDims(dp, tp, pp, ranks_per_node=per_node,
                                    nodes_per_rack=rng.choice([1, 2]))
            except ValueError:
                continue


def random_statuses(rng: random.Random, dims: ParallelDims, policy: str):
    n = dims.world_size
    table = buddy_table(dims, policy)
    ward = {b: r for r, b in enumerate(table)}
    steps = sorted(rng.sample(range(0, 12), 4))
    statuses = {}
    for r in range(n):
        if rng.random() < 0.25:
            continue  # dead
        live = rng.choice(steps + [None])
        local = sorted(s for s in steps if rng.random() < 0.6)
        replicas = {ward[r]: sorted(s for s in steps if rng.random() < 0.6)}
        if rng.random() < 0.2:  # a stray replica of some other rank
            replicas[rng.randrange(n)] = [rng.choice(steps)]
        statuses[r] = RankStatus(r, r, live, local, replicas)
    bad = {(rng.randrange(n), rng.randrange(n), rng.choice(steps)) for _ in range(rng.randint(0, 3))}
    bad |= {(q, q, rng.choice(steps)) for q in rng.sample(range(n), min(n, 2))}
    return statuses, bad, table


@pytest.mark.parametrize("seed", range(300))
def test_the_linear_planner_decides_exactly_as_the_reference(seed):
    rng = random.Random(seed)
    dims = random_dims(rng)
    policy = rng.choice(sorted(BUDDY_POLICIES))
    try:
        statuses, bad, table = random_statuses(rng, dims, policy)
    except ValueError:  # the policy is not a permutation on this layout
        return
    order = rng.choice([("peer", "replica"), ("replica", "peer"), ("replica",), ("peer",)])
    sharded, full = rng.random() < 0.5, rng.random() < 0.5
    world = list(range(dims.world_size))
    new = plan.plan_resume(statuses, world, dims.state_peers, table.__getitem__, order, bad,
                           sharded=sharded, replica_has_shared=full)
    ref = ref_plan_resume(statuses, world, lambda r: ref_state_peers(dims, r), table.__getitem__,
                          order, bad, sharded=sharded, replica_has_shared=full)
    assert new == ref


@pytest.mark.parametrize("seed", range(100))
def test_every_group_is_enumerated_once_and_the_kept_ones_are_the_references(seed):
    rng = random.Random(seed)
    dims = random_dims(rng)
    policy = rng.choice(sorted(BUDDY_POLICIES))
    try:
        buddy_table(dims, policy)
    except ValueError:
        return
    members = all_groups(dims, policy)
    assert members == ref_members(dims, policy)
    for r in range(dims.world_size):  # and every rank's own list agrees with it
        for _, key, ranks, _ in rank_groups(Topology(dims, r, 0, policy)):
            assert members[key] == ranks
        assert dims.state_peers(r) == ref_state_peers(dims, r)
    counts = {r: {k: rng.choice([[3, 3], [3, 3], [4, 3], [2, 2]]) for k, g in members.items()
                  if r in g} for r in range(dims.world_size) if rng.random() < 0.9}
    replaced = set(rng.sample(range(dims.world_size), rng.randint(0, 2)))
    assert reusable_groups(counts, members, replaced) == \
        reusable_groups(counts, ref_members(dims, policy), replaced)


# -- work counted in Python function calls -------------------------------------------------------
def calls(fn) -> int:
    """Python function calls (comprehensions included) made while ``fn()`` runs."""
    n = 0

    def count(frame, event, arg):
        nonlocal n
        if event == "call":
            n += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def keep_groups(dims, members_of):
    members = members_of(dims, "ring_over_nodes")
    counts = {r: {k: [5, 5] for k, g in members.items() if r in g} for r in range(1)}
    return reusable_groups(counts, members, {1})


def test_group_enumeration_grows_linearly_with_the_ranks():
    small = ParallelDims(dp=16, tp=2, pp=2, ranks_per_node=2)   # 64 ranks
    large = ParallelDims(dp=128, tp=2, pp=2, ranks_per_node=2)  # 512 ranks
    new = calls(lambda: all_groups(large, "ring_over_nodes")) / \
        calls(lambda: all_groups(small, "ring_over_nodes"))
    old = calls(lambda: ref_members(large, "ring_over_nodes")) / \
        calls(lambda: ref_members(small, "ring_over_nodes"))
    assert new < 8 * 1.25, new
    assert old > 8 * 4, old  # the counter does see a quadratic function


def dp_world(n: int):
    """A pure data-parallel job of ``n`` ranks (ZeRO-1: a lost rank's shard comes from its
    buddy's replica, its parameters from a peer) that lost one node of four ranks in every 16
    (the buddies are a rack away, alive): the holder searches run for one rank in 16."""
    dims = ParallelDims(dp=n, ranks_per_node=4, nodes_per_rack=4)
    table = buddy_table(dims, "ring_over_nodes")
    ward = {b: r for r, b in enumerate(table)}
    statuses = {r: RankStatus(r, r, 8, [7, 8], {ward[r]: [7, 8]}) for r in range(n)
                if dims.node_of(r) % 16 != 1}
    return dims, statuses, table


def test_the_planner_grows_linearly_with_the_ranks():
    def run(n, fn, peers):
        dims, statuses, table = dp_world(n)
        return calls(lambda: fn(statuses, list(range(n)), peers(dims), table.__getitem__,
                                sharded=True, replica_has_shared=False))
    new = run(512, plan.plan_resume, lambda d: d.state_peers) / \
        run(64, plan.plan_resume, lambda d: d.state_peers)
    old = run(512, ref_plan_resume, lambda d: (lambda r: ref_state_peers(d, r))) / \
        run(64, ref_plan_resume, lambda d: (lambda r: ref_state_peers(d, r)))
    assert new < 8 * 1.25, new
    assert old > 8 * 4, old
    dims, statuses, table = dp_world(64)
    d = plan.plan_resume(statuses, list(range(64)), dims.state_peers, table.__getitem__,
                         sharded=True, replica_has_shared=False)
    assert d.resume_step == 8 and d.sources[4].kind == "replica" and d.sources[4].holder == table[4]
    assert sum(s.kind == "replica" for s in d.sources.values()) == 4
    assert d == ref_plan_resume(statuses, list(range(64)), lambda r: ref_state_peers(dims, r),
                                table.__getitem__, sharded=True, replica_has_shared=False)
