"""A restored rank checks what it receives against what the holder reported to the coordinator
(its sealed ``RankStatus``, copied into the sealed plan), never against the checksum that
travels with the data, and ``install`` refuses a state of another owner or layout.

Two ranks in threads over gloo pair groups (the same groups ``Communicator.pair_group`` makes):
rank 0 holds its state at step ``S`` and reports it; rank 1 (a spare) receives it. Between the
report and the transfer, the bytes the sender sends change, with a checksum that matches them:
a consistent (data, checksum) pair, as a rewritten pair-group address or a stale holder would
send. The receiver must refuse it.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from deadpool.errors import CorruptState
from deadpool.rank.watchdog import Progress
from deadpool.recovery import restore
from deadpool.recovery.plan import plan_resume
from deadpool.snapshot import SnapshotEngine, checksum, encode_header, masters
from deadpool.store.protocol import Keys, Plan, RankStatus, Seal

S = 6


def worker(rank: int, has_state: bool, fill: float = 1.0):
    tensors = [("param/w", torch.arange(8, dtype=torch.float32) * fill),
               ("exp_avg/w", torch.full((4,), 2.0 * fill))]
    eng = SnapshotEngine(tensors, num_shared=1, replicate="unique", num_local_slots=2)
    tr = SimpleNamespace(step=S if has_state else 0, dirty=False, engine=eng,
                         header=lambda: {"step": S, "rank": rank})
    if has_state:
        eng.snapshot(S, tr.header())
        eng.drain()
    return SimpleNamespace(trainer=tr, has_state=has_state, store=dist.HashStore(), slot=rank,
                           link=None, seal=Seal(None), parked=[], prev_comm=None,
                           progress=Progress(), injector=SimpleNamespace(fire=lambda s, p: None),
                           dims=SimpleNamespace(state_peers=lambda r: [0, 1]))


class PairComm:
    """The part of ``Communicator`` a transfer uses: ``topo.rank`` and 2-rank gloo groups."""

    def __init__(self, rank: int, store):
        self.topo, self.build_store, self.groups = SimpleNamespace(rank=rank), store, {}

    def pair_group(self, store, a: int, b: int):
        if (a, b) not in self.groups:
            self.groups[(a, b)] = dist.ProcessGroupGloo(
                dist.PrefixStore(f"xfer/{a}-{b}", self.build_store), [a, b].index(self.topo.rank),
                2, timedelta(seconds=20))
        return self.groups[(a, b)]


def status_of(w, rank: int) -> RankStatus:
    restore.report_status(w, Plan(0, "train", {}, 0), rank, None)
    return RankStatus.from_json(w.store.get(Keys(0).status(rank)))


def run_pair(workers: dict, plan: Plan) -> dict:
    """Both ranks' part of ``plan``'s transfers at once; rank -> what ``moves`` returned or the
    exception it raised."""
    store, out = dist.HashStore(), {}

    def one(r):
        w = workers[r]
        sends, recvs = restore.transfers(w, plan, r)
        try:
            out[r] = masters.moves(w.trainer.engine, PairComm(r, store), sends, recvs, [], [], S,
                                   r, [0, 1])
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out[r] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in workers]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def peer_plan(statuses) -> Plan:
    d = plan_resume(statuses, [0, 1], lambda r: [0, 1], lambda r: 1 - r)
    assert d.resume_step == S and d.sources[1].kind == "peer" and d.sources[1].holder == 0
    return Plan(1, "train", {0: 0, 1: 1}, S, d.sources)


def test_a_consistent_pair_other_than_the_reported_one_is_refused():
    w0, w1 = worker(0, True), worker(1, False)
    plan = peer_plan({0: status_of(w0, 0), 1: status_of(w1, 1)})
    # after its report the holder's copy of step S changes, checksummed afresh (consistent)
    eng = w0.trainer.engine
    for t in eng.tensors:
        t.mul_(3)
    eng.snapshot(S, w0.trainer.header())
    eng.drain()
    got = run_pair({0: w0, 1: w1}, plan)
    assert isinstance(got[1], CorruptState), f"the receiver accepted it: {got[1]!r}"
    assert (got[1].holder, got[1].owner, got[1].step) == (0, 0, S)


def test_the_reported_copy_passes_and_installs():
    w0, w1 = worker(0, True, fill=2.0), worker(1, False)
    plan = peer_plan({0: status_of(w0, 0), 1: status_of(w1, 1)})
    got = run_pair({0: w0, 1: w1}, plan)
    buf, header, crc = got[1]
    eng = w1.trainer.engine
    eng.install(S, buf, header, crc, **restore.install_checks(plan, 1))
    assert all(torch.equal(a, b) for a, b in zip(eng.tensors, w0.trainer.engine.tensors))


def _received(owner: int, layout_of=None):
    src = worker(owner, True)
    slot = src.trainer.engine.local_slot(S)
    header = slot.header
    if layout_of is not None:  # the header of a state of another layout
        header = encode_header({"step": S, "rank": owner, "layout": layout_of})
    return slot.flat.clone(), header, slot.crc


def test_install_refuses_a_state_of_another_layout():
    eng = worker(1, False).trainer.engine
    other = dict(eng.layout_desc, split=eng.layout_desc["split"] + 64)
    buf, header, crc = _received(1, layout_of=other)
    with pytest.raises(CorruptState):
        eng.install(S, buf, header, crc)


def test_install_refuses_a_state_of_another_owner():
    eng = worker(1, False).trainer.engine
    buf, header, crc = _received(2)  # rank 2's state, same layout, sent to rank 1
    with pytest.raises(CorruptState):
        eng.install(S, buf, header, crc, owner=1)
    eng.install(S, *_received(1), owner=1)  # its own: accepted


def test_a_live_state_without_a_snapshot_is_reported_and_sent_as_reported():
    w0, w1 = worker(0, True, fill=5.0), worker(1, False)
    w0.trainer.engine.truncate_after(S - 1)  # live at S, no snapshot of it
    st0 = status_of(w0, 0)
    assert st0.local_steps == [] and f"own/{S}" in st0.crcs
    plan = peer_plan({0: st0, 1: status_of(w1, 1)})
    buf, header, crc = run_pair({0: w0, 1: w1}, plan)[1]
    w1.trainer.engine.install(S, buf, header, crc, **restore.install_checks(plan, 1))
    assert all(torch.equal(a, b) for a, b in zip(w1.trainer.engine.tensors,
                                                  w0.trainer.engine.tensors))


def test_the_plan_names_every_transfers_reported_checksums_and_they_survive_the_wire():
    from deadpool.store.wire import decode_plan, encode_plan
    from deadpool.topology import ParallelDims
    # dp2 x tp2, ZeRO: ranks 0 and 2 (both copies of tp 0) died; 1 holds 0's shard replica, 3
    # holds 2's: each is restored from its replica plus the group's master shards
    peers = ParallelDims(dp=2, tp=2, ranks_per_node=4).state_peers
    statuses = {1: RankStatus(1, 1, 7, [7], {0: [7]}, crcs={"own/7": [11, 12, 13],
                                                             "0/7": [21, 22, 23]}),
                3: RankStatus(3, 3, 7, [7], {2: [7]}, crcs={"own/7": [31, 32, 33],
                                                             "2/7": [41, 42, 43]})}
    d = plan_resume(statuses, [0, 1, 2, 3], peers, lambda r: r ^ 1, sharded=True,
                    replica_has_shared=False)
    s0 = d.sources[0]
    assert s0.params_from == [1, 3] and s0.crc == [21, 22, 23] and s0.params_crc == [None, 42]
    plan = Plan(1, "train", {r: r for r in range(4)}, 7, d.sources)
    assert decode_plan(encode_plan(plan, None), None).sources == d.sources


def test_a_master_shard_other_than_the_reported_one_is_refused():
    """The second round (parameters rebuilt from the group's shards): the shard a holder sends
    is checked against ``Source.params_crc``, not the checksum sent with it."""
    w0, w1 = worker(0, True, fill=3.0), worker(1, False)
    eng0 = w0.trainer.engine
    slot = eng0.local_slot(S)
    reported = slot.crc[1]
    forged = eng0.region(slot.flat, "unique").clone()
    forged[0] ^= 1
    store, out = dist.HashStore(), {}

    def one(r):
        eng = (w0 if r == 0 else w1).trainer.engine
        msends = [(1, 0, (forged, slot.header, (0, checksum(forged))))] if r == 0 else []
        mrecvs = [(0, 0, reported)] if r == 1 else []
        try:
            out[r] = masters.moves(eng, PairComm(r, store), [], [], msends, mrecvs, S, r, [0, 1])
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out[r] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert isinstance(out[1], CorruptState) and (out[1].holder, out[1].owner) == (0, 0), out[1]
