"""The strongest baselines on handmade traces, with answers worked out by hand.

Layout and calibration (conftest): 8 active nodes in 4 DP groups of 2, 2 spares, 10 s steps;
detection 5 s; plan 0, rebuild 20 s, transfer 5 s, warm-up 0; requeue 100 s, launch 0; storage:
10 s latency, no bandwidth limit; no snapshot overhead. ``rebuild_delta_s`` (only the changed
members set up) is 8 s here. Window: 10,000 s.
"""

import pytest

from sim import costs
from sim.simulate import run_one

T = 10_000.0


@pytest.fixture
def cal(calib):
    return calib | {"rebuild_delta_s": 8.0}


def run(name, scfg, calib, layout, trace, mtbf=1e9):
    return run_one(name, scfg, calib, layout, trace, T, mtbf)


def lost_s(row):
    return row["badput_lost_h"] * 3600.0


def test_checkpoint_restart_with_spares_restarts_inside_the_allocation(layout, cal, strategy_cfgs, handmade):
    """Checkpoints every 500 s; a crash at 1203 rolls back to 1000 (durable at 1010): lost 203,
    detection 5, restart = load 10 (no requeue: it holds spares); with a requeue 110."""
    tr = handmade([(1203.0, 3, "fail", False, 5000.0)], 10, T)
    s = strategy_cfgs("checkpoint_restart", in_allocation=True) | {"ckpt_interval_s": 500.0}
    r = run("checkpoint_restart", s, cal, layout(), tr)
    assert lost_s(r) == pytest.approx(203.0)
    assert r["goodput"] == pytest.approx((T - 203 - 5 - 10) / T, abs=1e-6)
    r = run("checkpoint_restart", s | {"restart_in_allocation": False}, cal, layout(), tr)
    assert r["goodput"] == pytest.approx((T - 203 - 5 - 110) / T, abs=1e-6)
    # without spares there is no allocation to restart in: the requeue is paid
    assert costs.requeues({"uses_spares": False, "restart_in_allocation": True})


def test_inmem_restart_with_spares_restarts_inside_the_allocation(layout, cal, strategy_cfgs, handmade):
    """Lost 3 s since the snapshot at 1000, detection 5, restart = transfer 5 (no requeue)."""
    tr = handmade([(1003.0, 3, "fail", False, 5000.0)], 10, T)
    r = run("inmem_restart", strategy_cfgs("inmem_restart", in_allocation=True), cal, layout(), tr)
    assert r["goodput"] == pytest.approx((T - 3 - 5 - 5) / T, abs=1e-6)
    assert r["restarts"] == 1


def test_deadpool_disk_fallback_restarts_inside_the_allocation(layout, cal, strategy_cfgs, handmade):
    """Node 2 and its buddy (3) lost within the window: back to the checkpoint at 500 (the one at
    1000 still persisting), resume at 1010 + 5 + 10 (load, no requeue)."""
    s = strategy_cfgs("deadpool", in_allocation=True) | {"disk_ckpt_interval_s": 500.0}
    tr = handmade([(1000.0, 2, "fail", False, 5000.0), (1010.0, 3, "fail", False, 5000.0)], 10, T)
    r = run("deadpool", s, cal, layout(), tr)
    assert (r["fallbacks"], r["restarts"]) == (1, 1)
    assert r["goodput"] == pytest.approx((500 + T - 1025) / T, abs=1e-3)


@pytest.mark.parametrize("t_fail, lost", [(1203.0, 203.0), (1003.0, 503.0)])
def test_injob_restart_from_local_checkpoints(layout, cal, strategy_cfgs, handmade, t_fail, lost):
    """Local saves every 500 s, replicated to a peer in one transfer (5 s): a crash at 1203 goes
    back to 1000; at 1003 the save at 1000 is not on its peer yet: back to 500. Detection 5,
    in-job restart = relaunch without requeue (0) + transfer 5 + warm-up 0."""
    tr = handmade([(t_fail, 3, "fail", False, 5000.0)], 10, T)
    s = strategy_cfgs("injob_restart", in_allocation=True) | {"ckpt_interval_s": 500.0}
    r = run("injob_restart", s, cal, layout(), tr)
    assert lost_s(r) == pytest.approx(lost)
    assert r["goodput"] == pytest.approx((T - lost - 5 - 5) / T, abs=1e-6)
    assert (r["restarts"], r["fleet_goodput"]) == (1, pytest.approx(r["goodput"] * 8 / 10))


def test_trainmover_joins_a_standby_with_a_delta_setup(layout, cal, strategy_cfgs, handmade):
    """Replicated optimizer: lost the step in flight (3 s), detection 5, join = plan 0 + delta 8 +
    transfer 5 + warm-up 0, no snapshot overhead; planned maintenance: the delta set-up alone."""
    tr = handmade([(1003.0, 3, "fail", False, 5000.0), (5003.0, 5, "maintenance", False, 3600.0)], 10, T)
    r = run("trainmover", strategy_cfgs("trainmover", in_allocation=True), cal, layout(), tr)
    assert lost_s(r) == pytest.approx(3.0)
    assert r["goodput"] == pytest.approx((T - 3 - 5 - 13 - 8) / T, abs=1e-6)
    assert (r["failures"], r["planned_maintenance"], r["swaps"], r["restarts"]) == (1, 1, 2, 0)


def test_trainmover_zero1_shard_lost_reloads_in_place(layout, cal, strategy_cfgs, handmade):
    """ZeRO-1 over DP: the failed node held the only copy of its optimizer shard. Back to the
    disk checkpoint at 1000 (lost 203), detection 5, reload in place = delta 8 + load 10."""
    lay = layout(optimizer_sharded_over_dp=True)
    tr = handmade([(1203.0, 3, "fail", False, 5000.0)], 10, T)
    s = strategy_cfgs("trainmover", in_allocation=True) | {"disk_ckpt_interval_s": 500.0}
    r = run("trainmover", s, cal, lay, tr)
    assert lost_s(r) == pytest.approx(203.0)
    assert r["goodput"] == pytest.approx((T - 203 - 5 - 18) / T, abs=1e-6)
    assert r["reloads"] == 1


def test_elastic_with_spares_regrows_at_once_with_a_delta_rebuild(layout, cal, strategy_cfgs, handmade):
    """Node 3 (group 1) fails at 1003: lost 3, detection 5, shrink = delta 8; a spare and the
    group's survivor re-form it at once: its state arrives in 5 s while 3 of 4 groups train
    (1.25 s degraded), then the join = delta 8 + transfer 5 - 5 in the background. With a full
    rebuild each of the two pauses is 20 s; without spares it runs narrower until the repair."""
    tr = handmade([(1003.0, 3, "fail", False, 5000.0)], 10, T)
    r = run("elastic_spares", strategy_cfgs("elastic_spares", in_allocation=True), cal, layout(), tr)
    assert r["goodput"] == pytest.approx((T - 3 - 5 - 8 - 1.25 - 8) / T, abs=1e-6)
    assert (r["shrinks"], r["regrows"]) == (1, 1)
    full = strategy_cfgs("elastic_spares", in_allocation=True) | {"rebuild": "full"}
    r = run("elastic_spares", full, cal, layout(), tr)
    assert r["goodput"] == pytest.approx((T - 3 - 5 - 20 - 1.25 - 20) / T, abs=1e-6)
    r = run("elastic_hsdp", strategy_cfgs("elastic_hsdp"), cal, layout(), tr)
    assert r["goodput"] < (T - 3 - 5 - 20 - 5000 / 4) / T + 1e-3  # narrower until the repair at 6003
