from deadpool.policies import SameNodeFirst
from deadpool.recovery.plan import assign_spares, node_of_slot, plan_resume
from deadpool.store.protocol import RankStatus, Source
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.recovery.helpers import coordinator

WORLD = [0, 1, 2, 3]


def st(rank, live, local, replicas=None):
    return RankStatus(rank, rank, live, local, replicas or {})


def ring(r, n=4):
    return (r + 1) % n


def no_peers(r):
    return [r]  # every rank's state unique (as with tensor/pipeline parallelism or ZeRO)


def dp_peers(r):
    return ParallelDims(dp=4).state_peers(r)


def test_dead_rank_restored_from_buddy_replica_survivors_keep_live_state():
    # rank 1 died at step 12; its buddy (2) holds its replica of 12 and 11
    statuses = {0: st(0, 12, [10, 11, 12], {3: [11, 12]}),
                2: st(2, 12, [10, 11, 12], {1: [11, 12]}),
                3: st(3, 12, [10, 11, 12], {2: [11, 12]})}
    d = plan_resume(statuses, WORLD, no_peers, ring)
    assert d.resume_step == 12
    assert d.sources[1] == Source("replica", 2)
    assert all(d.sources[r].kind == "live" for r in (0, 2, 3))
    assert d.steps_recomputed == 0


def test_incomplete_replica_forces_rollback_to_previous_step():
    # killed during replication of step 12: the buddy only has 11; survivors roll back
    statuses = {0: st(0, 13, [11, 12, 13]), 2: st(2, 13, [11, 12, 13], {1: [10, 11]}),
                3: st(3, 12, [10, 11, 12])}
    d = plan_resume(statuses, WORLD, no_peers, ring)
    assert d.resume_step == 11
    assert d.sources[0].kind == "local" and d.sources[3].kind == "local"
    assert d.steps_recomputed == 2


def test_rank_and_its_buddy_lost_together_is_unrecoverable_from_memory():
    statuses = {0: st(0, 12, [10, 11, 12], {3: [11, 12]}), 3: st(3, 12, [10, 11, 12], {2: [11, 12]})}
    d = plan_resume(statuses, WORLD, no_peers, ring)  # 2 held 1's replica
    assert d.resume_step is None
    assert d.lost == [1] and "[1]" in d.reason


def test_replica_held_by_non_buddy_is_used_when_buddy_lacks_it():
    statuses = {0: st(0, 5, [3, 4, 5], {1: [5]}), 2: st(2, 5, [3, 4, 5], {}), 3: st(3, 5, [3, 4, 5])}
    d = plan_resume(statuses, WORLD, no_peers, ring)
    assert d.resume_step == 5 and d.sources[1].holder == 0


def test_data_parallel_peer_covers_a_failure_before_the_first_replica():
    # rank 1 killed at step 0: nobody holds a replica yet, but its data-parallel peers hold step 0
    statuses = {0: st(0, 0, [0]), 2: st(2, 0, [0]), 3: st(3, 0, [0])}
    d = plan_resume(statuses, WORLD, no_peers, ring)  # no copy: step 0 is drawn from the seed
    assert d.resume_step == 0 and d.sources[1] == Source("init", 1)
    d = plan_resume(statuses, WORLD, dp_peers, ring)
    assert d.resume_step == 0 and d.sources[1].kind == "peer"
    assert d.sources[1].holder in (0, 2, 3)


def test_source_order_is_configurable_and_peer_sends_are_spread():
    statuses = {0: st(0, 7, [6, 7]), 3: st(3, 7, [6, 7], {2: [7]}), 1: st(1, 7, [6, 7], {0: [7]})}
    d = plan_resume(statuses, WORLD, dp_peers, ring, order=("replica", "peer"))
    assert d.sources[2] == Source("replica", 3)
    d = plan_resume(statuses, WORLD, dp_peers, ring, order=("peer", "replica"))
    assert d.sources[2].kind == "peer"
    # two ranks without a process: their peer sources are different survivors
    statuses = {0: st(0, 7, [7]), 1: st(1, 7, [7])}
    d = plan_resume(statuses, WORLD, dp_peers, ring)
    assert {d.sources[2].holder, d.sources[3].holder} == {0, 1}


def test_a_spare_whose_transfer_was_interrupted_is_planned_like_a_dead_rank():
    # gen 1 gave rank 1 to a spare; the transfer was cut by another failure: it holds nothing
    statuses = {0: st(0, 12, [10, 11, 12]), 1: st(1, None, []), 2: st(2, 12, [10, 11, 12], {1: [11, 12]}),
                3: st(3, 12, [10, 11, 12], {2: [12]})}
    d = plan_resume(statuses, WORLD, no_peers, ring)
    assert d.resume_step == 12 and d.sources[1] == Source("replica", 2)


def test_a_copy_found_corrupt_is_never_chosen_again():
    statuses = {0: st(0, 12, [11, 12], {1: [12]}), 2: st(2, 12, [11, 12], {1: [11, 12]}),
                3: st(3, 12, [11, 12])}
    d = plan_resume(statuses, WORLD, no_peers, ring, bad={(2, 1, 12)})
    assert d.resume_step == 12 and d.sources[1] == Source("replica", 0)
    d = plan_resume(statuses, WORLD, no_peers, ring, bad={(2, 1, 12), (0, 1, 12)})
    assert d.resume_step == 11 and d.sources[1] == Source("replica", 2)
    assert d.sources[0].kind == "local"
    # a corrupt local snapshot: that rank gets its state from a peer instead of rolling back
    statuses = {0: st(0, 11, [10, 11]), 1: st(1, 11, [10, 11]), 2: st(2, 11, [10, 11]),
                3: st(3, 12, [10, 11, 12])}
    d = plan_resume(statuses, WORLD, dp_peers, ring, bad={(3, 3, 11)}, order=("replica",))
    assert d.resume_step == 10 and d.sources[3].kind == "local"
    d = plan_resume(statuses, WORLD, dp_peers, ring, bad={(3, 3, 11), (3, 3, 12)})
    assert d.resume_step == 11 and d.sources[3].kind == "peer"


def test_peers_behind_are_brought_forward_rather_than_the_leader_rolled_back():
    # rank 3 finished step 12 before the abort, the others did not: with data-parallel peers
    # the newest step any rank holds wins (nothing is recomputed)
    statuses = {0: st(0, 11, [10, 11]), 1: st(1, 11, [10, 11]), 2: st(2, 11, [10, 11]),
                3: st(3, 12, [11, 12])}
    d = plan_resume(statuses, WORLD, dp_peers, ring)
    assert d.resume_step == 12 and d.steps_recomputed == 0
    assert all(d.sources[r] == Source("peer", 3) for r in (0, 1, 2))


def test_sharded_rank_takes_its_shard_from_the_replica_and_parameters_from_a_peer():
    # dp=2 x tp=2 (ranks 0,1 | 2,3; peers 0~2, 1~3), ZeRO-1: the optimizer shard is unique.
    # rank 0 dies at step 7; its buddy 1 holds its shard's replica; peer 2 holds its parameters
    peers = ParallelDims(dp=2, tp=2, ranks_per_node=4).state_peers
    statuses = {1: st(1, 7, [6, 7], {0: [6, 7]}), 2: st(2, 7, [6, 7], {1: [6, 7]}),
                3: st(3, 7, [6, 7], {2: [6, 7]})}
    d = plan_resume(statuses, WORLD, peers, ring, sharded=True, replica_has_shared=False)
    assert d.resume_step == 7
    assert d.sources[0] == Source("replica", 1, shared_from=2)
    # replicas of the whole state need no peer
    d = plan_resume(statuses, WORLD, peers, ring, sharded=True, replica_has_shared=True)
    assert d.sources[0] == Source("replica", 1)


def test_sharded_rank_without_a_replica_is_lost_even_with_live_peers():
    # the shard's only replica was on rank 3, which died with rank 0: peers cannot replace it
    peers = ParallelDims(dp=2, tp=2, ranks_per_node=4).state_peers
    statuses = {1: st(1, 7, [6, 7], {}), 2: st(2, 7, [6, 7], {1: [6, 7]})}
    d = plan_resume(statuses, WORLD, peers, lambda r: 3, sharded=True, replica_has_shared=False)
    assert d.resume_step is None and 0 in d.lost and 3 in d.lost


def test_sharded_rank_whose_peers_are_gone_rebuilds_its_parameters_from_the_group_shards():
    # both data-parallel copies of (tp 0) died: no peer has the parameters, but the replicas of
    # the group's two ZeRO shards (0's on 1, 2's on 3) hold both master shards
    peers = ParallelDims(dp=2, tp=2, ranks_per_node=4).state_peers
    statuses = {1: st(1, 7, [6, 7], {0: [6, 7]}), 3: st(3, 7, [6, 7], {2: [6, 7]})}
    d = plan_resume(statuses, WORLD, peers, ring, sharded=True, replica_has_shared=False)
    assert d.resume_step == 7
    assert d.sources[0] == Source("replica", 1, params_from=[1, 3])
    assert d.sources[2] == Source("replica", 3, params_from=[1, 3])
    d = plan_resume(statuses, WORLD, peers, ring, sharded=True, replica_has_shared=True)
    assert d.resume_step == 7 and d.sources[2] == Source("replica", 3)
    # one of the two shard replicas reached step 6 only: both ranks go back to 6
    statuses[3] = st(3, 7, [6, 7], {2: [6]})
    d = plan_resume(statuses, WORLD, peers, ring, sharded=True, replica_has_shared=False)
    assert d.resume_step == 6 and d.sources[0] == Source("replica", 1, params_from=[1, 3])


def test_corrupt_parameters_of_a_peer_are_not_used_again():
    peers = ParallelDims(dp=3, ranks_per_node=3).state_peers
    statuses = {1: st(1, 5, [5], {0: [5]}), 2: st(2, 5, [5], {1: [5]})}
    d = plan_resume(statuses, [0, 1, 2], peers, lambda r: (r + 1) % 3, sharded=True,
                    replica_has_shared=False, bad={(1, 1, 5)})
    assert d.sources[0] == Source("replica", 1, shared_from=2)


def test_a_shard_lost_at_step_zero_is_drawn_afresh_but_never_later():
    # ZeRO-1, rank 0 dies before its first replica: at step 0 its state is the seed's init
    peers = ParallelDims(dp=2, tp=2, ranks_per_node=4).state_peers
    statuses = {1: st(1, 0, [0]), 2: st(2, 0, [0]), 3: st(3, 0, [0])}
    d = plan_resume(statuses, WORLD, peers, ring, sharded=True, replica_has_shared=False)
    assert d.resume_step == 0 and d.sources[0] == Source("init", 0)
    # later, a lost shard is lost: no silent restart from scratch (the disk fallback decides)
    statuses = {1: st(1, 9, [8, 9]), 2: st(2, 9, [8, 9], {1: [8, 9]}), 3: st(3, 9, [8, 9])}
    d = plan_resume(statuses, WORLD, peers, lambda r: 3, sharded=True, replica_has_shared=False)
    assert d.resume_step is None and 0 in d.lost


def test_a_bf16_master_shard_is_never_rebuilt_from_a_peers_bf16_parameters():
    """precision=bf16 with ZeRO-1 (dp=2 x tp=2): a rank's unique region is its fp32 master shard
    and moments; a data-parallel peer holds only the bf16 parameters, their rounding. The job's
    planner (``decide``, with the job's facts) never names the peer for the unique region: it
    goes back to a step whose shard replica exists, refuses when there is none, and draws the
    master afresh only at step 0 (the seed's exact fp32 values)."""
    from types import SimpleNamespace

    from deadpool.recovery.plan import decide
    from tests.conftest import compose_train

    cfg = compose_train(["precision=bf16", "parallel.dp=2", "parallel.tp=2"], "unused")
    dims = ParallelDims.from_config(cfg["parallel"])
    coord = SimpleNamespace(dims=dims, gen=0, ft=cfg["ft"], bad=set(),
                            replica_region=dims.replica_region(cfg["ft"]["replicate"]))
    buddy = Topology(dims, 0, 0, cfg["ft"]["buddy_policy"]).buddy(0)
    peer = next(q for q in dims.state_peers(0) if q != 0)
    others = [r for r in WORLD if r not in (0, buddy)]
    # rank 0 died at step 7; its peer is live at 7, but the replica of 0's shard reached 6 only
    statuses = {r: st(r, 7, [6, 7]) for r in others}
    statuses[buddy] = st(buddy, 7, [6, 7], {0: [6]})
    d = decide(coord, statuses)
    assert d.resume_step == 6 and d.steps_recomputed == 1
    assert d.sources[0] == Source("replica", buddy, shared_from=peer)
    # no replica of the shard at all: lost from memory (the disk fallback decides), never "peer"
    statuses[buddy] = st(buddy, 7, [6, 7])
    d = decide(coord, statuses)
    assert d.resume_step is None and 0 in d.lost
    # before any step: the master shard is the seed's, drawn afresh
    d = decide(coord, {r: st(r, 0, [0]) for r in WORLD if r != 0})
    assert d.resume_step == 0 and d.sources[0] == Source("init", 0)


# -- ft.replicas=2: any surviving holder serves ----------------------------------------------------
def k2_coord(*overrides):
    """The planner's job facts for dp4 on one node with ``ft.replicas=2`` (ZeRO-1: unique
    replicas): rank r's replicas live on r+1 and r+2."""
    from types import SimpleNamespace

    from tests.conftest import compose_train

    cfg = compose_train(["parallel=dp4", "ft.replicas=2", *overrides], "unused")
    dims = ParallelDims.from_config(cfg["parallel"])
    return SimpleNamespace(dims=dims, gen=0, ft=cfg["ft"], bad=set(),
                           replica_region=dims.replica_region(cfg["ft"]["replicate"]))


def test_a_rank_and_its_first_buddy_dead_the_second_buddy_serves():
    from deadpool.recovery.plan import decide

    coord = k2_coord()
    assert Topology(coord.dims, 1, 0, "ring_over_nodes", 2).buddies() == (2, 3)
    # ranks 1 and 2 died at step 12 (2 was 1's first buddy); 3 holds 1's and 2's replicas
    # (wards 2 and 1), 0 holds 3's and 2's
    statuses = {0: st(0, 12, [11, 12], {3: [11, 12], 2: [11, 12]}),
                3: st(3, 12, [11, 12], {2: [11, 12], 1: [11, 12]})}
    d = decide(coord, statuses)
    assert d.resume_step == 12 and d.steps_recomputed == 0
    assert d.sources[1].kind == "replica" and d.sources[1].holder == 3  # the only holder alive
    assert d.sources[2].kind == "replica" and d.sources[2].holder == 3  # its first buddy
    for r in (1, 2):  # the optimizer shard from the replica, the parameters from a live peer
        assert d.sources[r].shared_from in (0, 3)
    # with one replica per rank the same two deaths lose rank 1 from memory
    one = k2_coord("ft.replicas=1")
    d1 = decide(one, {0: st(0, 12, [11, 12], {3: [11, 12]}), 3: st(3, 12, [11, 12], {2: [11, 12]})})
    assert d1.resume_step is None and d1.lost == [1]


def test_the_first_buddy_is_preferred_and_a_holder_without_the_step_is_skipped():
    from deadpool.recovery.plan import decide

    coord = k2_coord()
    # rank 1 died; both its buddies live: the first (2) serves
    statuses = {0: st(0, 9, [8, 9], {3: [8, 9], 2: [8, 9]}), 2: st(2, 9, [8, 9], {1: [8, 9], 0: [8, 9]}),
                3: st(3, 9, [8, 9], {2: [8, 9], 1: [8, 9]})}
    assert decide(coord, statuses).sources[1].holder == 2
    # the first buddy's replica of 9 is known corrupt: the second buddy serves step 9
    coord.bad = {(2, 1, 9)}
    d = decide(coord, statuses)
    assert d.resume_step == 9 and d.sources[1].holder == 3
    # the first buddy was cut mid-replication (holds only 8), the second has 9: no rollback
    coord.bad = set()
    statuses[2] = st(2, 9, [8, 9], {1: [8], 0: [8, 9]})
    d = decide(coord, statuses)
    assert d.resume_step == 9 and d.sources[1].holder == 3


def test_a_holder_killed_while_serving_fails_over_to_the_other_holder():
    """Rank 1 died and the plan named its first buddy 2; 2 died during that transfer. The next
    plan sees the spare that took rank 1 with nothing (its transfer was cut) and uses rank 1's
    second buddy, 3; rank 2's shard comes from 3 as well (its first buddy)."""
    from deadpool.recovery.plan import decide

    coord = k2_coord()
    first = decide(coord, {0: st(0, 12, [12], {3: [12], 2: [12]}),
                           2: st(2, 12, [12], {1: [12], 0: [12]}),
                           3: st(3, 12, [12], {2: [12], 1: [12]})})
    assert first.sources[1].holder == 2
    spare = RankStatus(1, 4, None, [], {})  # the spare in slot 4: transfer interrupted
    d = decide(coord, {0: st(0, 12, [12], {3: [12], 2: [12]}), 1: spare,
                       3: st(3, 12, [12], {2: [12], 1: [12]})})
    assert d.resume_step == 12
    assert (d.sources[1].kind, d.sources[1].holder) == ("replica", 3)
    assert (d.sources[2].kind, d.sources[2].holder) == ("replica", 3)


def test_bf16_with_two_replicas_never_takes_a_master_shard_from_a_peer():
    from deadpool.recovery.plan import decide

    coord = k2_coord("precision=bf16")
    # ranks 0 and 1 (0's first buddy) died; 0's second buddy (2) reached step 6 only, peers are at 7
    statuses = {2: st(2, 7, [6, 7], {1: [6, 7], 0: [6]}), 3: st(3, 7, [6, 7], {2: [6, 7], 1: [6, 7]})}
    d = decide(coord, statuses)
    assert d.resume_step == 6
    assert (d.sources[0].kind, d.sources[0].holder) == ("replica", 2)
    assert d.sources[0].shared_from in (2, 3)
    # no holder of 0's shard left: lost, never rebuilt from a peer's bf16 parameters
    statuses[2] = st(2, 7, [6, 7], {1: [6, 7]})
    d = decide(coord, statuses)
    assert d.resume_step is None and 0 in d.lost


# -- spares by node (plan.assign_spares with the coordinator's facts) ------------------------------
def tp4_coordinator(tmp_path, num_spares, logs=None):
    """dp2 x tp4 on nodes of 4 ranks: node 0 = ranks 0-3 (one TP group), node 1 = ranks 4-7."""
    return coordinator(tmp_path, ["parallel.dp=2", "parallel.tp=4", "parallel.ranks_per_node=4",
                                  f"ft.num_spares={num_spares}"], logs=logs)


def lose(coord, *ranks):
    """What ``Coordinator.recover`` does before assigning spares: rank -> the slot it held."""
    return {r: coord.members.ranks.pop(r) for r in ranks}


def tp_groups_inside_one_node(coord, assignments, node_of) -> bool:
    return all(len({node_of(assignments[r]) for r in g}) == 1
               for g in coord.dims.axis_groups("tp"))


def test_a_lost_node_goes_to_one_spare_node_and_a_lone_rank_to_a_spare_on_its_node(tmp_path):
    coord = tp4_coordinator(tmp_path, 6)  # spare slots 8-13
    # node agents' map: a free spare on node 0 (slot 8), a spare node (node 2: slots 9-12) and a
    # free spare on node 1 (slot 13)
    coord.launcher.node_of_slot = {**{s: s // 4 for s in range(8)}, 8: 0, 9: 2, 10: 2, 11: 2,
                                   12: 2, 13: 1}
    node_of = node_of_slot(coord)
    # node 1 lost with every process on it, its spare too (first_free: slots 8-11, split)
    coord.launcher.exited[13] = -9
    assignments, need, used = assign_spares(coord, lose(coord, 4, 5, 6, 7))
    assert need == [4, 5, 6, 7] and used == [9, 10, 11, 12]
    assert {r: assignments[r] for r in need} == {4: 9, 5: 10, 6: 11, 7: 12}
    assert tp_groups_inside_one_node(coord, assignments, node_of)
    assert coord.members.spares == [8] and 13 in coord.launcher.killed


def test_a_lone_dead_rank_takes_the_free_spare_on_its_own_node(tmp_path):
    coord = tp4_coordinator(tmp_path, 6)
    coord.launcher.node_of_slot = {**{s: s // 4 for s in range(8)}, 8: 0, 9: 2, 10: 2, 11: 2,
                                   12: 2, 13: 1}
    assignments, _, used = assign_spares(coord, lose(coord, 5))  # first_free: slot 8 (node 0)
    assert used == [13] and tp_groups_inside_one_node(coord, assignments, node_of_slot(coord))
    coord.members.ranks = assignments
    assignments, _, used = assign_spares(coord, lose(coord, 2))
    assert used == [8] and tp_groups_inside_one_node(coord, assignments, node_of_slot(coord))


def test_without_node_agents_slots_are_on_nodes_of_ranks_per_node_and_whole_nodes_are_kept(
        tmp_path):
    """The local launcher and srun (no ``node_of_slot``): slot // ranks_per_node, two spare nodes
    (slots 8-11, 12-15). A lone rank first, of a node with no free spare, then a whole node:
    the lone rank takes a slot of the first spare node, the lost node the untouched second one
    (first_free: slots 9-12, over both)."""
    coord = tp4_coordinator(tmp_path, 8)
    assert not hasattr(coord.launcher, "node_of_slot") and node_of_slot(coord)(13) == 3
    assignments, _, used = assign_spares(coord, lose(coord, 5))
    assert used == [8]
    coord.members.ranks = assignments
    for s in range(4):  # node 0 lost: its processes and their agent
        coord.launcher.exited[s] = -9
    assignments, need, used = assign_spares(coord, lose(coord, 0, 1, 2, 3))
    assert need == [0, 1, 2, 3] and used == [12, 13, 14, 15]
    node = node_of_slot(coord)
    assert len({node(assignments[r]) for r in range(4)}) == 1


def test_a_group_no_node_can_take_is_split_over_the_fewest_nodes_and_logged(tmp_path):
    logs = []
    coord = tp4_coordinator(tmp_path, 6, logs)  # spare node 2: slots 8-11; node 3: 12, 13
    coord.launcher.exited[8] = -9  # a spare of node 2 died: node 2 has 3 free, node 3 has 2
    assignments, need, used = assign_spares(coord, lose(coord, 4, 5, 6, 7))
    assert {r: assignments[r] for r in need} == {4: 9, 5: 10, 6: 11, 7: 12}
    assert any("rank(s) [4, 5, 6, 7] of node 1" in line and "split over nodes [2, 3]" in line
               for line in logs), logs


def test_first_free_stays_selectable_and_ignores_nodes(tmp_path):
    coord = coordinator(tmp_path, ["parallel.dp=2", "parallel.tp=4", "parallel.ranks_per_node=4",
                                   "ft.num_spares=8", "ft.spare_policy=first_free"])
    coord.members.ranks = assign_spares(coord, lose(coord, 5))[0]
    assignments, _, used = assign_spares(coord, lose(coord, 0, 1, 2, 3))
    assert used == [9, 10, 11, 12]  # over both spare nodes


def test_same_node_first_is_the_default_spare_policy(tmp_path):
    assert isinstance(coordinator(tmp_path).spare_policy, SameNodeFirst)
