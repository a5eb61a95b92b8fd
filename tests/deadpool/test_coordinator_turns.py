"""The coordinator's waits turn every few milliseconds while a recovery collects N ranks' statuses:
what one turn costs must not grow with the nodes or ranks when nothing changed, and a layout's
groups are enumerated once, not at every recovery.

Work is counted in executed Python lines (``sys.settrace``: a loop's every iteration is a line
event, so an O(N) scan inside one comprehension counts N), never timed."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from deadpool.control.liveness import NodeLiveness
from deadpool.rank import groups
from deadpool.recovery import plan
from deadpool.store.protocol import Keys, RankStatus, Seal
from deadpool.store.reports import NodeReports, Reports, post
from deadpool.topology import ParallelDims


def lines(fn) -> int:
    """Python lines executed (in every frame) while ``fn()`` runs."""
    n = 0

    def trace(frame, event, arg):
        nonlocal n
        if event == "line":
            n += 1
        return trace
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return n


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def liveness(nodes: int, clock: Clock) -> NodeLiveness:
    live = NodeLiveness(soft_s=1.0, hard_s=10.0, node_timeout_s=3.0, node_of=lambda s: s // 8,
                        clock=clock)
    for n in range(nodes):
        live.observe_node(n, "1 0 7 8 0")
    return live


def turn(live):
    live.stale_nodes()
    live.suspects(lambda n: range(8 * n, 8 * n + 8))


def test_a_turn_of_the_liveness_questions_costs_the_same_at_64_and_4096_nodes():
    small, large = liveness(64, Clock()), liveness(4096, Clock())
    turn(small), turn(large)  # (first answers)
    a, b = lines(lambda: turn(small)), lines(lambda: turn(large))
    assert b <= a + 8, (a, b)  # the scan over every node's record (4,096 line events) is gone


def test_stale_nodes_still_ages_and_recovers_every_node():
    clock = Clock()
    live = liveness(5, clock)
    assert live.stale_nodes() == []
    clock.t += 0.5
    live.observe_node(3, "2 0 7 8 0")
    clock.t += 0.6  # 1.1 s since the first records, 0.6 s since node 3's
    assert live.stale_nodes() == [0, 1, 2, 4]
    assert set(live.suspects(lambda n: [8 * n])) == {0, 8, 16, 32}
    live.observe_node(1, "2 0 7 8 0")  # node 1 speaks again: not stale
    assert live.stale_nodes() == [0, 2, 4]
    live.observe_node(1, "2 0 7 8 0")  # (the same record again is no news: still fresh)
    clock.t += 1.2
    assert live.stale_nodes() == [0, 1, 2, 3, 4]


def test_a_slow_slot_is_forgotten_when_its_nodes_next_record_omits_it():
    clock = Clock()
    live = liveness(2, clock)
    live.observe_node(0, '2 0 7 8 0 {"slow":{"3":[0.6,false]},"own":[5]}')
    assert live.suspects(lambda n: []) == {3, 5}
    live.observe_node(1, '2 0 7 8 0 {"slow":{"9":[0.6,false]}}')
    live.observe_node(0, "3 0 7 8 0")
    assert live.suspects(lambda n: []) == {9}


class DictStore:
    """The store calls ``reports`` makes, in memory."""

    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def append(self, k, v):
        self.d[k] = self.d.get(k, b"") + v.encode()

    def compare_set(self, k, expected, desired):
        return self.d.get(k, expected.encode())

    def check(self, keys):
        return all(k in self.d for k in keys)

    def multi_get(self, keys):
        return [self.d[k] for k in keys]


def test_a_poll_that_finds_nothing_new_costs_the_same_at_64_and_16384_ranks():
    """(It walked every missing rank's key at each 2 ms turn of the status wait.)"""
    seal, keys = Seal(None), Keys(3)
    cost = []
    for n in (64, 16384):
        store = DictStore()
        got = Reports(store, seal, keys.status, range(n), posted=True)
        post(store, seal, keys.status(0), "x")
        assert got.poll() == {0: "x"}
        got.poll()
        cost.append(lines(got.poll))  # (nothing new: one peek at the index)
    assert cost[1] <= cost[0] + 4, cost


def test_node_reports_poll_new_answers_each_report_once():
    seal, keys = Seal(None), Keys(1)
    store = DictStore()
    got = NodeReports(store, seal, lambda n: keys.node_report("status", n), range(16),
                      node_of=lambda r: r // 8)
    post(store, seal, keys.node_report("status", 0), '{"0": "a", "1": "b"}')
    assert got.poll_new() == {0: "a", 1: "b"}
    post(store, seal, keys.node_report("status", 0), '{"0": "a", "1": "b", "2": "c"}')
    post(store, seal, keys.node_report("status", 1), '{"8": "d", "3": "not node 1s"}')
    assert got.poll_new() == {2: "c", 8: "d"}
    assert got.poll_new() == {} and len(got.got) == 4 and 3 in got.missing


def test_a_layouts_groups_are_enumerated_once_not_at_every_recovery(monkeypatch):
    dims = ParallelDims(dp=64, tp=2, pp=2, ranks_per_node=4)
    coord = SimpleNamespace(cfg={"device": "cpu"}, dims=dims,
                            ft={"rebuild": "affected", "buddy_policy": "ring_over_nodes"})
    members = {k: g for k, g in groups.all_groups(dims, "ring_over_nodes").items()
               if not k.startswith("repl")}
    statuses = {r: RankStatus(r, r, 5, [5], {}, {k: [2, 2] for k, g in members.items() if r in g})
                for r in range(dims.world_size)}
    first = plan.groups_to_keep(coord, statuses, [1], 1)
    enumerated = []
    real = groups.all_groups
    for module in (groups, plan):  # (wherever the planner would call it from)
        monkeypatch.setattr(module, "all_groups",
                            lambda *a, **k: enumerated.append(a) or real(*a, **k), raising=False)
    again = plan.groups_to_keep(coord, statuses, [2], 2)
    assert enumerated == []
    assert first and again and set(first) != set(again)
    assert not any(1 in members[k] for k in first) and not any(2 in members[k] for k in again)


def test_a_recovery_runs_without_cyclic_gc_and_the_collector_comes_back_after(tmp_path,
                                                                              monkeypatch):
    """Decoding 16,384 statuses made the collector scan the coordinator's whole process inside the
    detection -> plan window: the loop recovers with automatic collection off, and turns it back
    on after, also when the recovery raised."""
    import gc

    import pytest

    from deadpool.recovery import detect
    from tests.deadpool.recovery.helpers import coordinator

    coord = coordinator(tmp_path)
    monkeypatch.setattr(coord, "wait_warm", lambda: None)
    monkeypatch.setattr(detect, "failures", lambda c: ({1: "exit"}, 0.0))
    seen = []

    def recover(failed, t):
        seen.append(gc.isenabled())
        coord.outcome = "failed"

    monkeypatch.setattr(coord, "recover", recover)
    assert gc.isenabled()
    coord._run()
    assert seen == [False] and gc.isenabled()

    def broken(failed, t):
        raise RuntimeError("recovery failed")

    monkeypatch.setattr(coord, "recover", broken)
    with pytest.raises(RuntimeError):
        coord._run()
    assert gc.isenabled()
