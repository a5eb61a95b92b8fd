"""recovery/elastic.py's pure parts: the layout of a narrower generation, the renumbering of an
in-place shrink or regrow, and the config a process follows (the process-level behaviour is in
tests/integration/test_elastic.py)."""

from __future__ import annotations

import pytest

from deadpool.recovery.elastic import fill, layout_at, renumber
from deadpool.settings import layout_cfg
from deadpool.topology import ParallelDims

CFG = {"parallel": {"dp": 4, "tp": 1, "pp": 1, "ranks_per_node": 1, "global_dp": None},
       "ft": {"replicas": 2, "buddy_policy": "ring_over_nodes"}}


def test_full_width_has_no_layout_and_a_narrower_one_keeps_the_global_batch():
    assert layout_at(CFG, 4) == {}
    assert layout_at(CFG, 3) == {"dp": 3, "global_dp": 4, "replicas": 2}
    # two nodes left: each rank's replica fits on one other node only
    assert layout_at(CFG, 2)["replicas"] == 1
    cfg = layout_cfg(CFG, layout_at(CFG, 3))
    assert cfg["parallel"]["dp"] == 3 and cfg["parallel"]["global_dp"] == 4
    assert cfg["ft"]["replicas"] == 2 and CFG["parallel"]["dp"] == 4  # the original untouched
    assert layout_cfg(CFG, {}) is CFG


def test_a_dp_shrink_compacts_the_survivors_data_parallel_index():
    old, new = ParallelDims(4), ParallelDims(3)
    ranks = {0: 0, 2: 7, 3: 3}  # rank 1 is dead; a hot swap put rank 2 in slot 7 earlier
    assignments, idle = renumber(old, new, ranks, keep_dp=[0, 2, 3])
    assert assignments == {0: 0, 1: 7, 2: 3} and idle == []


def test_a_3d_shrink_keeps_each_survivors_stage_and_frees_the_dropped_replica():
    old, new = ParallelDims(2, 2, 2, 2), ParallelDims(1, 2, 2, 2)
    ranks = {r: 10 + r for r in range(8) if r != 2}  # rank 2: pp 0, dp 1, tp 0
    assignments, idle = renumber(old, new, ranks, keep_dp=[0])
    for r, slot in assignments.items():
        o, n = old.coords(slot - 10), new.coords(r)
        assert (o["pp"], o["tp"]) == (n["pp"], n["tp"]) and o["dp"] == 0
    assert sorted(assignments) == [0, 1, 2, 3] and sorted(idle) == [13, 16, 17]


def test_a_regrow_fills_the_new_ranks_from_spares_in_order():
    narrow, full = ParallelDims(3), ParallelDims(4)
    assignments, idle = renumber(narrow, full, {0: 0, 1: 7, 2: 3}, keep_dp=[0, 1, 2])
    assert assignments == {0: 0, 1: 7, 2: 3} and idle == []
    out, left = fill(full, assignments, [9, 11])
    assert out == {0: 0, 1: 7, 2: 3, 3: 9} and left == [11]
    with pytest.raises(RuntimeError, match="2 rank"):  # not enough processes
        fill(ParallelDims(5), assignments, [])


class _JoinLauncher:
    """Starts "processes" in new slots (``add_slots``); ``exited`` marks one dead in start-up."""

    def __init__(self):
        self.next, self.started, self.exited, self.fenced = 8, [], {}, []

    def add_slots(self, n, generation):
        new = list(range(self.next, self.next + n))
        self.next += n
        self.started.append(new)
        return new

    def poll(self, slot):
        return self.exited.get(slot)

    def fence(self, slots):
        self.fenced += list(slots)

    def log_tail(self, slot, lines=20):
        return f"(slot {slot}'s log)"


def _narrow_coordinator(tmp_path, dp):
    from deadpool.recovery.elastic import Regrow  # noqa: F401
    from tests.deadpool.recovery.helpers import coordinator

    coord = coordinator(tmp_path, ["ft.num_spares=0"])
    coord.reshape(layout_at(coord.configured, dp))
    coord.members.ranks = {r: r for r in range(dp)}
    coord.launcher = _JoinLauncher()
    return coord


def _join(coord, slot):
    from deadpool.store.protocol import Keys

    key = Keys.spare_ready(slot)
    coord.store.set(key, coord.seal.wrap(key, "1"))


def test_a_joiner_dying_in_warm_up_is_replaced_and_the_regrow_goes_on(tmp_path):
    """Old code: ``ready`` raised, the regrow was given up for good (never retried) and the other
    joiner it had started was left running (issue 36, items 11 and 14)."""
    from deadpool.recovery.elastic import Regrow

    coord = _narrow_coordinator(tmp_path, 2)  # dp2 of a dp4 job: two joiners
    grow = Regrow(coord)
    assert grow.slots == [8, 9] and not grow.ready()
    _join(coord, 9)
    coord.launcher.exited[8] = 1  # dies while it imports torch
    assert not grow.ready()       # replaced, not given up
    assert coord.launcher.started == [[8, 9], [10]] and sorted(grow.slots) == [9, 10]
    assert not grow.ready()
    _join(coord, 10)
    assert grow.ready() and coord.launcher.fenced == []


def test_joiners_that_keep_dying_end_the_regrow_without_leaving_the_others_running(tmp_path):
    from deadpool.recovery.elastic import Regrow

    coord = _narrow_coordinator(tmp_path, 2)
    grow = Regrow(coord)
    dead = 8
    with pytest.raises(RuntimeError, match="exited during start-up"):
        for _ in range(6):  # (more than the starts a joiner gets)
            coord.launcher.exited[dead] = 1
            grow.ready()
            dead = coord.launcher.started[-1][0]
    assert coord.launcher.fenced == [9]  # the joiner still warming up: not left behind
