"""Any two overlapping failures recover from memory with ``ft.replicas=2``, at every layout: the
planner (``decide``, with the job's facts) is run for every pair of ranks killed together, at
dp4, dp2 x tp2, dp2 x pp2 and dp2 x tp2 x pp2 with ZeRO-1 (``ft.replicate=unique``), in fp32
and bf16, and each plan is checked for what a transfer would need: every named holder alive and
holding what it is asked for. (``tests/integration/test_overlapping_failures.py`` runs some
of these pairs with real processes.)

The pair of a rank with its data-parallel peer (dp2: the two copies of one model shard) is the
case a peer cannot cover: its parameters come from the replicas of the group's ZeRO shards,
each holding its rank's master weights (``Source.params_from``).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from deadpool.recovery.plan import decide
from deadpool.store.protocol import RankStatus, Source
from deadpool.topology import ParallelDims, Topology
from tests.conftest import compose_train

LAYOUTS = {  # name -> parallel overrides (k = 2 needs 3+ nodes, or one node of 4+ ranks)
    "dp4": ["parallel=dp4"],
    "dp2xtp2": ["parallel.dp=2", "parallel.tp=2", "parallel.ranks_per_node=4"],
    "dp2xpp2": ["parallel.dp=2", "parallel.pp=2", "parallel.ranks_per_node=1"],
    "dp2xtp2xpp2": ["parallel=dp2_tp2_pp2"],
}


def job_facts(layout: str, precision: str):
    cfg = compose_train(["model=tiny", *LAYOUTS[layout], "ft.replicas=2",
                         f"precision={precision}"], "unused")
    dims = ParallelDims.from_config(cfg["parallel"])
    return SimpleNamespace(dims=dims, gen=0, ft=cfg["ft"], bad=set(),
                           replica_region=dims.replica_region(cfg["ft"]["replicate"]))


def statuses_after(coord, dead, step: int = 12) -> dict[int, RankStatus]:
    """Every survivor live at ``step`` with its snapshots of step - 1 and step, and the replicas of
    its wards at both (replication had caught up when the failures came)."""
    topo = Topology(coord.dims, 0, 0, coord.ft["buddy_policy"], 2)
    out = {}
    for r in range(coord.dims.world_size):
        if r in dead:
            continue
        wards = Topology(coord.dims, r, 0, coord.ft["buddy_policy"], 2).wards()
        assert all(r in topo.buddies(w) for w in wards)
        out[r] = RankStatus(r, r, step, [step - 1, step], {w: [step - 1, step] for w in wards})
    return out


def check_feasible(coord, statuses, decision, dead) -> None:
    """Each source names live holders of what it must send: a rank's own state, a replica held,
    the parameters of a live data-parallel peer, or every data-parallel member's master shard."""
    S = decision.resume_step
    dims = coord.dims

    def holds_replica(h, owner):
        return h in statuses and S in statuses[h].replicas.get(owner, [])

    for r in range(dims.world_size):
        src = decision.sources[r]
        if r not in dead:
            assert src == Source("live", r)
            continue
        assert src.kind == "replica" and holds_replica(src.holder, r), (r, src)
        group = dims.state_peers(r)
        if src.shared_from is not None:
            q = src.shared_from
            assert q in group and q != r and statuses[q].live_step == S, (r, src)
            assert src.params_from is None
        else:
            assert src.params_from is not None and len(src.params_from) == len(group), (r, src)
            for d, h in zip(group, src.params_from):
                assert holds_replica(h, d) and h not in dead, (r, d, src)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_pair_of_ranks_killed_together_recovers_from_memory(layout, precision):
    coord = job_facts(layout, precision)
    world = coord.dims.world_size
    for dead in itertools.combinations(range(world), 2):
        statuses = statuses_after(coord, set(dead))
        d = decide(coord, statuses)
        assert d.resume_step == 12, (layout, dead, d.reason)
        check_feasible(coord, statuses, d, set(dead))


def test_both_data_parallel_copies_of_a_shard_rebuild_their_parameters_from_the_shard_replicas():
    """The issue's case: dp2 x tp2 x pp2, ranks 1 and 3 (the (pp 0, tp 1) shard's two copies)
    killed together. Each takes its ZeRO shard from its first buddy alive and the parameters from
    the master shards of both: its own replica's and its peer's, as the plan names them."""
    coord = job_facts("dp2xtp2xpp2", "fp32")
    topo = Topology(coord.dims, 0, 0, coord.ft["buddy_policy"], 2)
    d = decide(coord, statuses_after(coord, {1, 3}))
    assert d.resume_step == 12
    # 1's buddies are (3, 5), 3's (5, 7): the first alive serves each
    assert (topo.buddies(1), topo.buddies(3)) == ((3, 5), (5, 7))
    b1, b3 = 5, 5
    assert d.sources[1].holder == b1 and d.sources[3].holder == b3
    assert d.sources[1].params_from == [b1, b3] and d.sources[3].params_from == [b1, b3]
    assert d.sources[1].describe() == (f"replica from rank {b1} + parameters from the master "
                                       f"shards on ranks [{b1}, {b3}]")
    # with one replica each, rank 1's only replica was on rank 3: the same two deaths lose both
    # (3's own shard survives on 5, but no master shard of 1 is left to rebuild either)
    one = job_facts("dp2xtp2xpp2", "fp32")
    one.ft = dict(one.ft, replicas=1)
    assert Topology(one.dims, 1, 0, "ring_over_nodes").buddies() == (3,)
    statuses = {r: RankStatus(r, r, 12, [11, 12], {w: [11, 12] for w in
                                                   Topology(one.dims, r, 0, "ring_over_nodes").wards()})
                for r in range(8) if r not in (1, 3)}
    assert decide(one, statuses).lost == [1, 3]


def test_a_master_shard_without_a_surviving_replica_leaves_the_group_lost():
    """ranks 1 and 3 dead and rank 3's replicas gone too: no copy of 3's master shard, so neither
    rank's parameters can be rebuilt (and 3's shard is lost): nothing in memory covers them."""
    coord = job_facts("dp2xtp2xpp2", "fp32")
    statuses = statuses_after(coord, {1, 3})
    for st in statuses.values():
        st.replicas.pop(3, None)
    d = decide(coord, statuses)
    assert d.resume_step is None and set(d.lost) == {1, 3}
