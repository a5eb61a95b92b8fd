"""recovery/elastic.py's pure parts: the layout of a narrower generation, the renumbering of an
in-place shrink or regrow, and the config a process follows (the process-level behaviour is in
tests/integration/test_elastic.py)."""

from __future__ import annotations

import pytest

from deadpool.recovery.elastic import fill, layout_at, layout_cfg, renumber
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
