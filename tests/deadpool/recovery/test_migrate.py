"""Planned swaps without processes (recovery/migrate.py, deadpool/control/drain.py): the retired slots
travel with the plan, a drain request is sealed and answered, refused when too few spares are
free off the node, and the pause is placed past the steps the records may lag by."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

from deadpool.control import drain
from deadpool.recovery import pause, restore
from deadpool.recovery.migrate import Migrations, from_retiring
from deadpool.recovery.plan import RecoveryDecision
from deadpool.store.protocol import Keys, Plan, RankStatus, Seal, Source
from deadpool.store.wire import decode_plan, encode_plan
from deadpool.topology import ParallelDims


class DictStore:
    def __init__(self):
        self.d: dict[str, bytes | int] = {}

    def add(self, k, n):
        self.d[k] = int(self.d.get(k, 0)) + n
        return self.d[k]

    def set(self, k, v):
        self.d[k] = v

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)


def test_retired_slots_travel_in_full_and_as_a_delta():
    a = Plan(0, "train", {0: 0, 1: 1}, 0, {0: Source("live", 0), 1: Source("live", 1)})
    b = Plan(1, "train", {0: 0, 1: 2}, 7, {0: Source("live", 0), 1: Source("replica", 0)},
             retire=[1])
    assert decode_plan(encode_plan(b, None), None).retire == [1]
    assert decode_plan(encode_plan(b, a), a).retire == [1]
    assert decode_plan(encode_plan(a, None), None).retire == []


def fake_coord(spares: list[int], events=True):
    """dp2 x tp2 x pp2 with two ranks per node: node n holds slots 2n, 2n+1; spares after."""
    cfg = {"parallel": {"dp": 2, "tp": 2, "pp": 2, "ranks_per_node": 2}}
    logs: list[str] = []
    store, seal = DictStore(), Seal("s3cret")
    killed: list[int] = []
    coord = SimpleNamespace(
        ft={"agent_interval_s": 0.25}, gen=0, job_step=12, store=store, seal=seal,
        forgeries=set(), log=logs.append, pending=None,
        members=SimpleNamespace(ranks={r: r for r in range(8)}, spares=list(spares)),
        dims=ParallelDims.from_config(cfg["parallel"]),
        launcher=SimpleNamespace(node_of_slot={}, kill=killed.append),
        events=SimpleNamespace(pushed=[], push=lambda kind, **d: coord.events.pushed.append(
            (kind, d))) if events else None,
        live=SimpleNamespace(compute={}))
    coord.counter = lambda key: int(store.add(key, 0))
    return coord, logs, killed


def answers(coord, ids):
    return {i: json.loads(coord.seal.unwrap(drain.reply_key(i), coord.store.get(drain.reply_key(i))))
            for i in ids if coord.store.check([drain.reply_key(i)])}


def test_a_drain_is_refused_with_the_reason_when_too_few_spares_are_free_off_the_node():
    coord, logs, _ = fake_coord(spares=[8])  # one spare (node 4) for node 1's two ranks
    m = Migrations(coord)
    i = drain.request(coord.store, coord.seal, 1)
    assert m.poll(coord) is False
    got = answers(coord, [i])[i]
    assert not got["ok"] and "2 rank(s) [2, 3]" in got["message"] and "1 warm spare" in got["message"]
    assert not m.wanted and not coord.events.pushed  # nothing paused


def test_an_accepted_drain_pauses_every_rank_past_the_records_lag_and_retires_its_spares():
    coord, logs, killed = fake_coord(spares=[8, 9, 10])  # 8, 9 on node 4; 10 on node 5
    coord.launcher.node_of_slot = {8: 4, 9: 4, 10: 1}  # (a spare of the drained node: released)
    m = Migrations(coord)
    i = drain.request(coord.store, coord.seal, 1)
    m.poll(coord)
    assert m.wanted == {2: "drain", 3: "drain"} and i not in answers(coord, [i])
    assert killed == [10] and coord.members.spares == [8, 9]
    ((kind, ev),) = coord.events.pushed
    assert kind == "pause" and ev["g"] == 0 and ev["step"] >= coord.job_step + 3


def test_a_forged_drain_request_is_ignored():
    coord, logs, _ = fake_coord(spares=[8, 9])
    m = Migrations(coord)
    drain.request(coord.store, Seal("another job"), 1)
    m.poll(coord)
    assert not m.wanted and any("without the job's secret" in x for x in logs)


def test_without_node_agents_a_drain_is_refused():
    coord, logs, _ = fake_coord(spares=[8, 9], events=False)
    m = Migrations(coord)
    i = drain.request(coord.store, coord.seal, 1)
    m.poll(coord)
    got = answers(coord, [i])[i]
    assert not got["ok"] and "node agents" in got["message"]


def test_retired_processes_are_released_only_once_the_new_generation_runs():
    coord, logs, _ = fake_coord(spares=[8])
    m = Migrations(coord)
    coord.members.generation = 1
    coord.gen, coord.pending = 1, object()  # plan 1 out, its record open (no first step yet)
    m.retiring = (1, [3])
    key = pause.running_key(1)
    # the loop asks only with no record open; while one is, nothing is released
    assert not coord.store.check([key])
    coord.pending = None  # the record completed: every rank of generation 1 took a step
    m.poll(coord)
    assert coord.seal.open(key, coord.store.get(key)) == "1" and m.retiring is None
    assert any("retired slot(s) [3] may exit" in x for x in logs)
    # generation 1 aborted before it ran (a recovery planned 2): no word, they left on the abort
    coord2, _, _ = fake_coord(spares=[8])
    m2 = Migrations(coord2)
    m2.retiring, coord2.gen = (1, [3]), 2
    m2.poll(coord2)
    assert not coord2.store.check([pause.running_key(1)]) and m2.retiring is None


def _retiring(coord, g=1):
    worker = SimpleNamespace(store=coord.store, seal=coord.seal, slot=3, lost=threading.Event(),
                             _job_done=lambda: False, _job_stopped=lambda n: False)
    plan = Plan(g, "train", {0: 0, 1: 8}, 12, {}, retire=[3])
    out = []
    t = threading.Thread(target=lambda: out.append(pause.retire(worker, plan)), daemon=True)
    t.start()
    return t, out


def test_a_retired_process_waits_for_the_running_word_or_the_abort():
    coord, _, _ = fake_coord(spares=[8])
    t, out = _retiring(coord)
    time.sleep(0.2)
    assert t.is_alive()  # plan 1 alone does not release it
    key = pause.running_key(1)
    coord.store.set(key, Seal("another job").wrap(key, "1"))  # a forged word is ignored
    time.sleep(0.1)
    assert t.is_alive()
    coord.store.set(key, coord.seal.wrap(key, "1"))
    t.join(5)
    assert not t.is_alive() and out == [0]
    coord, _, _ = fake_coord(spares=[8])
    t, out = _retiring(coord)
    abort = Keys(1).abort
    coord.store.set(abort, coord.seal.wrap(abort, "spare lost"))
    t.join(5)
    assert not t.is_alive() and out == [0]


def test_a_moved_ranks_state_comes_from_its_own_process_with_its_sealed_checksums():
    coord, _, _ = fake_coord(spares=[8])
    lost: set[int] = set()
    coord.lost = lambda slot: slot in lost
    statuses = {1: RankStatus(1, 1, 7, [7], {}, crcs={"own/7": [11, 12, 13], "own/6": [1, 2, 3]}),
                3: RankStatus(3, 3, 7, [7], {}, crcs={})}  # 3 reported no snapshot of 7
    replica = Source("replica", 2, crc=[4, 5, 6])
    d = RecoveryDecision(resume_step=7, steps_recomputed=0,
                 sources={0: Source("live", 0), 1: replica, 3: Source("replica", 0)})
    from_retiring(coord, d, statuses, {1: 1, 3: 3}, [1, 3])
    assert d.sources[1] == Source("retiring", 1, crc=[11, 12, 13])  # the status's, step 7's
    assert d.sources[3] == Source("replica", 0)
    assert d.described_sources()["1"] == "retiring from slot 1"
    # the retiring process stopped beating: its buddy's replica stays
    d.sources[1], lost = replica, {1}
    from_retiring(coord, d, statuses, {1: 1, 3: 3}, [1, 3])
    assert d.sources[1] is replica
    # the plan carries it, in full and as a delta
    a = Plan(0, "train", {r: r for r in range(4)}, 0, {r: Source("live", r) for r in range(4)})
    b = Plan(1, "train", {0: 0, 1: 8, 2: 2, 3: 3}, 7,
             {0: Source("live", 0), 1: Source("retiring", 1, crc=[11, 12, 13]),
              2: Source("live", 2), 3: Source("live", 3)}, retire=[1])
    for got in (decode_plan(encode_plan(b, None), None), decode_plan(encode_plan(b, a), a)):
        assert got.sources == b.sources and got.retire == [1]


def test_the_spare_receives_from_the_retiring_slot_and_the_buddy_sends_nothing():
    plan = Plan(1, "train", {0: 0, 1: 8, 2: 2, 3: 3}, 7,
                {0: Source("live", 0), 1: Source("retiring", 1, crc=[11, 12, 13]),
                 2: Source("live", 2), 3: Source("live", 3)}, retire=[1])

    def worker(has_state):
        eng = SimpleNamespace(repl_region="all")
        return SimpleNamespace(trainer=SimpleNamespace(step=7, dirty=False, engine=eng,
                                                       header=lambda: {}), has_state=has_state)
    sends, recvs = restore.transfers(worker(False), plan, 1)
    assert sends == [] and recvs == [("s1", 1, "all", [11, 12, 13])]  # checked against these
    assert restore.install_checks(plan, 1) == {"owner": 1, "holder": -1, "rank": 1}
    for r in (0, 2, 3):  # (rank 1's buddy too: no replica moves)
        assert restore.transfers(worker(True), plan, r) == ([], [])
