"""The coordinator's side of corruption and spike reports (deadpool/recovery/rollback.py:
poll, restrict, open_record) on an in-process store, without processes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch.distributed as dist

from deadpool.recovery import integrity, rollback
from deadpool.recovery.plan import RecoveryDecision
from deadpool.store import reports
from deadpool.store.protocol import RankStatus, Seal


def coordinator(replicate="unique"):
    logs = []
    return SimpleNamespace(store=dist.HashStore(), seal=Seal(None), gen=3, log=logs.append,
                           members=SimpleNamespace(ranks={0: 0, 1: 1, 2: 2}), bad=set(),
                           ft={"replicate": replicate}), logs


def post(coord, rank, **rec):
    rec = {"rank": rank, "why": "test", "pos": None, "culprits": [], **rec}
    reports.post(coord.store, coord.seal, integrity.report_key(coord.gen, rank), json.dumps(rec))


def statuses():
    return {r: RankStatus(rank=r, slot=r, live_step=9, local_steps=[7, 8, 9],
                          replicas={(r + 1) % 3: [8, 9]}) for r in (0, 2)}


def test_nothing_reported_means_no_failure():
    coord, _ = coordinator()
    assert rollback.poll(coord) is None and not rollback.pending(coord)
    post(coord, 1, kind="corruption", step=8, cap=8)
    coord.gen = 4  # a report of an older generation is never acted on again
    assert rollback.poll(coord) is None


def test_a_named_rank_fails_and_everyone_resumes_at_most_at_the_disputed_step():
    coord, logs = coordinator(replicate="full")
    post(coord, 2, kind="corruption", step=8, cap=8, culprits=[1])
    failed, _ = rollback.poll(coord)
    assert failed == {1: "corruption"} and rollback.pending(coord) and "corruption" in logs[0]
    st = rollback.restrict(coord, statuses())
    assert all(s.live_step is None and max(s.local_steps) == 8 for s in st.values())
    assert (0, 1, 8) in coord.bad and (0, 1, 9) in coord.bad  # its full replicas hold the flip
    decision = RecoveryDecision(8, {}, 1)
    rec = rollback.open_record(coord, failed, {}, decision, 0.0, [])
    assert rec.detected_by == "corruption" and rec.failed_at_step == 8
    assert rec.steps_recomputed == 1 and not rollback.pending(coord)


def test_a_spike_adds_its_batch_to_the_skip_list_every_rank_reads():
    coord, _ = coordinator()
    post(coord, 0, kind="spike", step=6, cap=6, pos=6)
    assert rollback.poll(coord)[0] == {}  # nobody is named
    st = rollback.restrict(coord, statuses())
    assert all(s.local_steps == [] for s in st.values())  # nothing at or before 6 held here
    assert json.loads(coord.seal.open(integrity.SKIPS_KEY, coord.store.get(integrity.SKIPS_KEY))) == [6]
    rec = rollback.open_record(coord, {}, {}, RecoveryDecision(5, {}, 0), 0.0, [])
    assert rec.detected_by == "spike" and rec.steps_recomputed == 4
