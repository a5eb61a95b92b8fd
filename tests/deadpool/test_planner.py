from deadpool.planner import plan_resume
from deadpool.protocol import RankStatus


def st(rank, live, local, replicas=None):
    return RankStatus(rank, rank, live, local, replicas or {})


def ring(r, n=4):
    return (r + 1) % n


def test_dead_rank_restored_from_buddy_replica_survivors_keep_live_state():
    # rank 1 died at step 12; its buddy (2) holds its replica of 12 and 11
    statuses = {0: st(0, 12, [10, 11, 12], {3: [11, 12]}),
                2: st(2, 12, [10, 11, 12], {1: [11, 12]}),
                3: st(3, 12, [10, 11, 12], {2: [11, 12]})}
    d = plan_resume(statuses, {1}, ring)
    assert d.resume_step == 12
    assert d.sources[1] == {"kind": "replica", "holder": 2}
    assert all(d.sources[r]["kind"] == "live" for r in (0, 2, 3))
    assert d.steps_recomputed == 0


def test_incomplete_replica_forces_rollback_to_previous_step():
    # killed during replication of step 12: the buddy only has 11 verified; survivors roll back
    statuses = {0: st(0, 13, [11, 12, 13]), 2: st(2, 13, [11, 12, 13], {1: [10, 11]}),
                3: st(3, 12, [10, 11, 12])}
    d = plan_resume(statuses, {1}, ring)
    assert d.resume_step == 11
    assert d.sources[0]["kind"] == "local" and d.sources[3]["kind"] == "local"
    assert d.steps_recomputed == 2


def test_rank_and_its_buddy_lost_together_is_unrecoverable_from_memory():
    statuses = {0: st(0, 12, [10, 11, 12], {3: [11, 12]}), 3: st(3, 12, [10, 11, 12], {2: [11, 12]})}
    d = plan_resume(statuses, {1, 2}, ring)  # 2 held 1's replica
    assert d.resume_step is None
    assert "1" in d.reason


def test_replica_held_by_non_buddy_is_used_when_buddy_lacks_it():
    statuses = {0: st(0, 5, [3, 4, 5], {1: [5]}), 2: st(2, 5, [3, 4, 5], {}), 3: st(3, 5, [3, 4, 5])}
    d = plan_resume(statuses, {1}, ring)
    assert d.resume_step == 5 and d.sources[1]["holder"] == 0
