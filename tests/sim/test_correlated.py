"""Correlated failures (racks), lemon nodes, RMA repairs, buddy placement and silent corruption."""

import numpy as np
import pytest

from sim import placement
from sim.simulate import run_one
from sim.trace import DAY_S, FAIL, HOUR_S, TraceSpec, generate

T = 10_000.0
BASE = dict(name="x", unexpected_per_1000_node_days=3.79)


def test_a_rack_failure_takes_every_node_of_the_rack_at_once():
    spec = TraceSpec(**BASE | {"unexpected_per_1000_node_days": 1e-9, "rack_failures_per_1000_rack_days": 5.0})
    tr = generate(spec, 1000, 200 * DAY_S, seed=1, nodes_per_rack=4)
    rack = tr.causes.index("rack_switch")
    rows = tr.cause == rack
    assert rows.sum() > 0 and rows.sum() % 4 == 0
    times, nodes = tr.time_s[rows], tr.node[rows]
    for t in np.unique(times):
        members = np.sort(nodes[times == t])
        assert len(members) == 4 and members[0] % 4 == 0 and np.all(np.diff(members) == 1)
    # 250 racks x 200 days x 5 / 1000 = 250 rack events expected
    assert rows.sum() / 4 == pytest.approx(250, rel=0.2)


def test_lemons_keep_the_fleet_rate_and_concentrate_failures():
    spec = TraceSpec(**BASE | {"lemon_node_frac": 0.02, "lemon_rate_multiplier": 20.0, "tbf_distribution": "exponential"})
    counts = [generate(spec, 4096, 100 * DAY_S, seed=s) for s in range(4)]
    expected = 4096 * 100 * 3.79 / 1000
    assert np.mean([c.count(FAIL) for c in counts]) == pytest.approx(expected, rel=0.05)
    per_node = np.bincount(counts[0].node[counts[0].event == FAIL], minlength=4096)
    top = np.sort(per_node)[::-1][:82]  # the 2% most failing nodes
    # lemons hold 20 * 0.02 / (0.98 + 0.4) = 29% of the failures
    assert top.sum() / per_node.sum() > 0.2


def test_rma_tail_share_of_repairs():
    spec = TraceSpec(**BASE | {"rma_frac": 0.3, "rma_median_h": 24.0, "rma_mean_h": 48.0})
    tr = generate(spec, 20000, 54 * DAY_S, seed=2)
    rep = tr.duration_s[(tr.event == FAIL) & ~tr.transient] / HOUR_S
    assert (rep > 8.0).mean() == pytest.approx(0.3 * 0.9, abs=0.05)  # most RMAs exceed 8 h, few repairs do


def test_placement_policies():
    ring, cross = placement.ring("adjacent", 8, 2), placement.ring("cross_rack", 8, 2)
    assert [ring.buddy(i) for i in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]
    assert [cross.buddy(i) for i in range(8)] == [2, 3, 4, 5, 6, 7, 0, 1]
    assert all(cross.buddy(i) // 2 != i // 2 for i in range(8))
    pairs = placement.pairs("cross_rack", 8, 2)
    assert [pairs.buddy(i) for i in range(8)] == [2, 3, 0, 1, 6, 7, 4, 5]
    assert [placement.pairs("adjacent", 7, 2).buddy(i) for i in range(7)] == [1, 0, 3, 2, 5, 4, 5]


@pytest.mark.parametrize("where, fallbacks", [("adjacent", 1), ("cross_rack", 0)])
def test_rack_failure_takes_a_node_and_its_buddy_unless_placed_across_racks(
        layout, calib, strategy_cfgs, handmade, where, fallbacks):
    lay = layout(nodes_per_rack=2)
    tr = handmade([(1000.0, 2, "fail", False, 5000.0), (1000.0, 3, "fail", False, 5000.0)], 10, T)
    r = run_one("deadpool", strategy_cfgs("deadpool"), calib | {"buddy_placement": where}, lay, tr, T, 1e9)
    assert (r["fallbacks"], r["failures"]) == (fallbacks, 2)
    rep = run_one("replication", strategy_cfgs("replication"), calib | {"buddy_placement": where}, lay, tr, T, 1e9)
    assert rep["fallbacks"] == fallbacks


SDC = {"sdc_causes": ["permanent"]}  # the handmade trace's permanent failures are corruptions


@pytest.mark.parametrize("delay, restores_from", [(5.0, "memory"), (600.0, "disk")])
def test_corruption_poisons_later_copies(layout, calib, strategy_cfgs, handmade, delay, restores_from):
    """Node 3 starts corrupting at t = 1003 (W = 993 after one 10 s checkpoint stall). Noticed 5 s
    later, the buddy still keeps a clean snapshot (990); noticed 600 s later every snapshot and the
    checkpoints at W = 1000 and 1500 are poisoned: back to the one at W = 500."""
    s = strategy_cfgs("deadpool") | {"disk_ckpt_interval_s": 500.0, "disk_ckpt_mode": "sync"}
    tr = handmade([(1003.0, 3, "fail", False, 5000.0)], 10, T)
    r = run_one("deadpool", s, calib | SDC | {"detect_sdc_s": delay}, layout(), tr, T, 1e9)
    assert (r["failures"], r["corruptions"]) == (1, 1)
    if restores_from == "memory":
        assert (r["fallbacks"], r["restarts"]) == (0, 0)
        assert r["badput_lost_h"] * 3600 == pytest.approx(1008 - 10 - 990)
    else:
        assert (r["fallbacks"], r["restarts"]) == (1, 1)
        assert r["badput_lost_h"] * 3600 == pytest.approx(1603 - 30 - 500)
    c = strategy_cfgs("checkpoint_restart") | {"ckpt_interval_s": 500.0, "ckpt_mode": "sync"}
    cr = run_one("checkpoint_restart", c, calib | SDC | {"detect_sdc_s": delay}, layout(), tr, T, 1e9)
    assert cr["badput_lost_h"] * 3600 == pytest.approx((1008 - 10 - 500) if delay == 5.0 else (1603 - 30 - 500))


def test_corruption_of_a_node_that_left_first_is_dropped(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1003.0, 3, "fail", False, 5000.0), (1100.0, 3, "fail", True, 100.0)], 10, T)
    c = calib | {"sdc_causes": ["permanent"], "detect_sdc_s": 600.0}
    r = run_one("deadpool", strategy_cfgs("deadpool"), c, layout(), tr, T, 1e9)
    assert (r["failures"], r["corruptions"], r["masked"]) == (1, 0, 1)
