"""The worker's side of a recovery (deadpool/recovery/restore.py) without processes: what it
reports after an abort, and its part of the plan's transfers (who sends which region to whom)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from deadpool.rank.watchdog import Progress
from deadpool.recovery import restore
from deadpool.snapshot import Replica, SnapshotEngine, encode_header
from deadpool.store.protocol import Keys, Plan, RankStatus, Seal, Source

S = 6


def worker(step=S, dirty=False, has_state=True, replica_of=None):
    """A rank whose state is two tensors: parameters (shared with its data-parallel peers) and
    an optimizer shard (its own), snapshotted at step ``S``; ``replica_of``: the rank whose
    shard it holds."""
    tensors = [("param/w", torch.arange(8, dtype=torch.float32)),
               ("exp_avg/w", torch.full((4,), 2.0))]
    eng = SnapshotEngine(tensors, num_shared=1, replicate="unique", num_local_slots=2)
    eng.snapshot(S, {"step": S})
    eng.drain()
    if replica_of is not None:
        flat = torch.full((16,), 7, dtype=torch.uint8)
        eng.replicas[replica_of] = [Replica(replica_of, S, flat, encode_header(
            {"step": S, "layout": eng.layout_desc}), (0, 0), "unique")]
    tr = SimpleNamespace(step=step, dirty=dirty, engine=eng, header=lambda: {"step": step})
    return SimpleNamespace(trainer=tr, has_state=has_state, store=dist.HashStore(), slot=9, link=None,
                           seal=Seal(None), parked=[], prev_comm=None, progress=Progress(),
                           injector=SimpleNamespace(fire=lambda step, phase: None))


# rank 1 died; a spare takes it: its shard from its buddy's replica (rank 2), its parameters
# from a data-parallel peer (rank 0); ranks 0, 2, 3 are live
PLAN = Plan(1, "train", {0: 0, 1: 4, 2: 2, 3: 3}, S,
            {0: Source("live", 0), 1: Source("replica", 2, shared_from=0), 2: Source("live", 2),
             3: Source("live", 3)})


def test_the_spare_receives_the_shard_from_the_buddy_and_the_parameters_from_a_peer():
    sends, recvs = restore.transfers(worker(has_state=False), PLAN, 1)
    assert sends == [] and recvs == [(2, 1, "unique", None), (0, 0, "shared", [None] * 3)]


def test_the_buddy_sends_the_replica_it_holds_and_the_peer_its_parameters():
    w2 = worker(replica_of=1)
    sends, recvs = restore.transfers(w2, PLAN, 2)
    assert recvs == [] and [(d, r) for d, r, _ in sends] == [(1, "unique")]
    flat, _, _ = sends[0][2]
    assert flat is w2.trainer.engine.replica(1, S).flat
    w0 = worker()
    sends, recvs = restore.transfers(w0, PLAN, 0)
    assert recvs == [] and [(d, r) for d, r, _ in sends] == [(1, "shared")]
    flat, _, _ = sends[0][2]
    eng = w0.trainer.engine
    assert torch.equal(flat, eng.region(eng.local_slot(S).flat, "shared"))
    assert restore.transfers(worker(), PLAN, 3) == ([], [])  # not involved


def test_a_peer_source_sends_the_whole_state():
    p = Plan(1, "train", {0: 0, 1: 4}, S, {0: Source("live", 0), 1: Source("peer", 0)})
    assert restore.transfers(worker(has_state=False), p, 1) == ([], [(0, 0, "all", None)])
    sends, _ = restore.transfers(worker(), p, 0)
    assert [(d, r) for d, r, _ in sends] == [(1, "all")]


def test_the_status_names_the_live_step_unless_the_step_was_cut_mid_update():
    for dirty, live in ((False, S), (True, None)):
        w = worker(step=S, dirty=dirty, replica_of=3)
        restore.report_status(w, Plan(0, "train", {}, 0), 2, None)
        st = RankStatus.from_json(w.store.get(Keys(0).status(2)))
        assert st.live_step == live and st.local_steps == [S] and st.replicas == {3: [S]}
    spare = worker(has_state=False)  # a spare that never got its state: only what it holds
    restore.report_status(spare, Plan(0, "train", {}, 0), 1, None)
    st = RankStatus.from_json(spare.store.get(Keys(0).status(1)))
    assert st.live_step is None and st.local_steps == []
