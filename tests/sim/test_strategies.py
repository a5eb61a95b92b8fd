"""Each strategy on handmade traces with answers worked out by hand, plus invariants.

Layout (conftest): 8 active nodes in 4 DP groups of 2, 10 s steps; calibration: detection
5 s, swap 25 s, restart 110 s, synchronous write 10 s. Window: 10,000 s.
"""

import pytest

from sim.layout import Layout
from sim.simulate import run_one

T = 10_000.0


def run(name, scfg, calib, layout, trace, mtbf=1e9):
    return run_one(name, scfg, calib, layout, trace, T, mtbf)


def badput_s(row, bucket):
    return row[f"badput_{bucket}_h"] * 3600.0


def test_deadpool_single_failure(layout, calib, strategy_cfgs, handmade):
    lay = layout()
    tr = handmade([(1003.0, 3, "fail", False, 5000.0)], 10, T)
    r = run("deadpool", strategy_cfgs("deadpool"), calib, lay, tr)
    # lost: 3 s since the snapshot at 1000; detection 5; swap 25
    assert r["goodput"] == pytest.approx((T - 3 - 5 - 25) / T, abs=1e-6)
    assert (r["failures"], r["swaps"], r["restarts"], r["stalls"]) == (1, 1, 0, 0)
    assert badput_s(r, "lost") == pytest.approx(3.0)
    assert r["fleet_goodput"] == pytest.approx(r["goodput"] * 8 / 10)


@pytest.mark.parametrize("lag_steps, lost", [(0.5, 3.0 + 10.0), (2.5, 33.0), (4.0, 43.0)])
def test_deadpool_lost_work_when_replication_lag_exceeds_the_interval(layout, calib, strategy_cfgs, handmade,
                                                                       lag_steps, lost):
    """Snapshots every 10 s of progress, on the buddy ``lag`` later. A failure at W = 1003: the
    newest usable snapshot is the newest mark <= 1003 - lag (990, 970, 960), several intervals
    back once the lag exceeds one interval (the old code stepped back one interval only: 13 s)."""
    c = calib | {"replicate_lag_steps": lag_steps}
    tr = handmade([(1003.0, 3, "fail", False, 5000.0)], 10, T)
    r = run("deadpool", strategy_cfgs("deadpool"), c, layout(), tr)
    assert badput_s(r, "lost") == pytest.approx(lost)
    assert r["goodput"] == pytest.approx((T - lost - 5 - 25) / T, abs=1e-6)


def test_deadpool_planned_maintenance_is_a_drained_swap(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1003.0, 3, "maintenance", False, 7200.0)], 10, T)
    r = run("deadpool", strategy_cfgs("deadpool"), calib, layout(), tr)
    assert r["goodput"] == pytest.approx((T - 25) / T, abs=1e-6)
    assert (r["failures"], r["planned_maintenance"], r["swaps"]) == (0, 1, 1)


def test_deadpool_buddy_lost_in_window_falls_back_to_disk(layout, calib, strategy_cfgs, handmade):
    s = strategy_cfgs("deadpool") | {"disk_ckpt_interval_s": 500.0}
    # node 2 fails at 1000; its buddy (slot 3) fails at 1010, before the swap is done at 1030
    tr = handmade([(1000.0, 2, "fail", False, 5000.0), (1010.0, 3, "fail", False, 5000.0)], 10, T)
    r = run("deadpool", s, calib, layout(), tr)
    assert (r["fallbacks"], r["restarts"]) == (1, 1)
    # the checkpoint at 1000 was still persisting (10 s) when node 2 died -> back to 500;
    # resume at 1010 + 5 + 110 = 1125
    assert badput_s(r, "lost") == pytest.approx(500.0, abs=1.0)
    assert r["goodput"] == pytest.approx((500 + T - 1125) / T, abs=1e-3)


def test_deadpool_ring_ward_lost_in_window_also_falls_back(layout, calib, strategy_cfgs, handmade):
    # ring over nodes: slot 1's replica lives on slot 2; 1 fails, then 2 fails before 1 is restored
    s = strategy_cfgs("deadpool") | {"disk_ckpt_interval_s": 500.0}
    tr = handmade([(1000.0, 1, "fail", False, 5000.0), (1010.0, 2, "fail", False, 5000.0)], 10, T)
    assert run("deadpool", s, calib, layout(), tr)["fallbacks"] == 1
    # slots 1 and 5 are not ring neighbours: two independent swaps
    tr = handmade([(1000.0, 1, "fail", False, 5000.0), (1010.0, 5, "fail", False, 5000.0)], 10, T)
    assert run("deadpool", s, calib, layout(), tr)["fallbacks"] == 0


def test_deadpool_with_two_replicas_survives_a_node_and_its_buddy(layout, calib, strategy_cfgs,
                                                                  handmade):
    # ft.replicas=2: slot 2's state is also on slot 4, so losing 2 and its buddy 3 inside the
    # window is two swaps from memory; losing 2, 3 and 4 (every copy of 2) falls back to disk
    s = strategy_cfgs("deadpool") | {"disk_ckpt_interval_s": 500.0}
    two = [(1000.0, 2, "fail", False, 5000.0), (1010.0, 3, "fail", False, 5000.0)]
    assert run("deadpool", s, calib, layout(), handmade(two, 10, T))["fallbacks"] == 1
    r = run("deadpool", s, calib | {"replicas": 2}, layout(), handmade(two, 10, T))
    assert (r["fallbacks"], r["restarts"], r["swaps"]) == (0, 0, 2)
    three = two + [(1015.0, 4, "fail", False, 5000.0)]
    assert run("deadpool", s, calib | {"replicas": 2}, layout(), handmade(three, 10, T))["fallbacks"] == 1


def test_deadpool_no_spare_waits_for_repair(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1000.0, 3, "fail", False, 3000.0)], 8, T)
    r = run("deadpool", strategy_cfgs("deadpool"), calib, layout(num_spares=0), tr)
    assert r["stalls"] == 1
    assert badput_s(r, "wait_spare") == pytest.approx(3000 - 5)
    assert r["goodput"] == pytest.approx((1000 + T - 4025) / T, abs=1e-6)


def test_deadpool_no_spare_shrinks(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1000.0, 3, "fail", False, 3000.0)], 8, T)
    r = run("deadpool", strategy_cfgs("deadpool_shrink"), calib, layout(num_spares=0), tr)
    # 3/4 width from 1030 until the repaired node re-forms the group at 4000 (+25 s)
    assert (r["shrinks"], r["regrows"], r["stalls"]) == (1, 1, 0)
    assert r["goodput"] == pytest.approx((1000 + 0.75 * 2970 + T - 4025) / T, abs=1e-6)


def test_elastic_shrinks_and_regrows(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1000.0, 3, "fail", False, 3000.0)], 10, T)
    r = run("elastic", strategy_cfgs("elastic"), calib, layout(), tr)
    # detect 5 + shrink (plan 0 + rebuild 20) -> 3/4 width from 1025 until the new replica has its
    # state (4000 + transfer 5, in the background), then it joins (rebuild 20)
    assert (r["shrinks"], r["regrows"], r["charged_spare_nodes"], r["restarts"]) == (1, 1, 0, 0)
    assert r["goodput"] == pytest.approx((1000 + 0.75 * 2980 + T - 4025) / T, abs=1e-6)
    assert r["fleet_goodput"] == pytest.approx(r["goodput"])
    r = run("elastic", strategy_cfgs("elastic") | {"regrow": "blocking"}, calib, layout(), tr)
    assert r["goodput"] == pytest.approx((1000 + 0.75 * 2975 + T - 4025) / T, abs=1e-6)  # the whole regrow blocks


def test_elastic_with_zero1_pays_for_the_lost_optimizer_shard(layout, calib, strategy_cfgs, handmade):
    """ZeRO-1 over data parallelism: the dropped replica held the only copy of its shard, so the
    job rolls back to the newest durable checkpoint; in place the survivors re-shard and read it
    (rebuild 20 s + load 10 s), with ``shard_loss: restart`` the job restarts (110 s)."""
    lay = layout(optimizer_sharded_over_dp=True)
    s = strategy_cfgs("elastic") | {"disk_ckpt_interval_s": 500.0, "disk_ckpt_mode": "sync"}
    tr = handmade([(1300.0, 3, "fail", False, 3000.0)], 10, T)
    r = run("elastic", s, calib, lay, tr)
    # sync checkpoints of 10 s at W=500 (t=510) and W=1000 (t=1020): at t=1300 W=1280 -> lose 280
    assert (r["restarts"], r["reloads"]) == (0, 1)
    assert badput_s(r, "lost") == pytest.approx(280.0)
    assert badput_s(r, "restart") == pytest.approx(20.0 + 10.0)
    r = run("elastic", s | {"shard_loss": "restart"}, calib, lay, tr)
    assert (r["restarts"], r["reloads"]) == (1, 0)
    assert badput_s(r, "lost") == pytest.approx(280.0)
    assert badput_s(r, "restart") == pytest.approx(110.0)
    hsdp = run("elastic", strategy_cfgs("elastic_hsdp") | {"disk_ckpt_mode": "sync"}, calib, lay, tr)
    assert hsdp["restarts"] == 0 and badput_s(hsdp, "lost") < 10.0


def test_elastic_stalls_below_min_width(layout, calib, strategy_cfgs, handmade):
    # six of eight nodes fail at once: one group left (< min 2), healthy survivors none
    rows = [(1000.0, n, "fail", False, 2000.0) for n in range(6)]
    r = run("elastic", strategy_cfgs("elastic"), calib, layout(), handmade(rows, 10, T))
    assert r["stalls"] == 1
    assert badput_s(r, "wait_spare") == pytest.approx(2000 - 5 - 20)


def test_checkpoint_restart_known_lost_work(layout, calib, strategy_cfgs, handmade):
    s = strategy_cfgs("checkpoint_restart") | {"ckpt_interval_s": 1000.0, "ckpt_mode": "sync"}
    tr = handmade([(2500.0, 3, "fail", True, 0.0)], 10, T)
    r = run("checkpoint_restart", s, calib, layout(), tr)
    # checkpoints durable at W=1000 (t=1010) and W=2000 (t=2020); failure at 2500 loses 480;
    # restart done at 2505 + 110 = 2615, then 7 more cycles of 1010 s and 315 s of compute
    assert badput_s(r, "lost") == pytest.approx(480.0)
    assert badput_s(r, "ckpt_stall") == pytest.approx(90.0)
    assert r["goodput"] == pytest.approx(9315.0 / T, abs=1e-6)
    assert r["restarts"] == 1


def test_checkpoint_restart_planned_drain_loses_nothing(layout, calib, strategy_cfgs, handmade):
    s = strategy_cfgs("checkpoint_restart") | {"ckpt_interval_s": 1000.0, "ckpt_mode": "sync"}
    tr = handmade([(2500.0, 3, "maintenance", False, 3600.0)], 10, T)
    r = run("checkpoint_restart", s, calib, layout(), tr)
    assert badput_s(r, "lost") == 0.0
    assert badput_s(r, "restart") == pytest.approx(110.0)


def test_replication_absorbs_one_loss(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1000.0, 2, "fail", False, 3000.0)], 10, T)
    r = run("replication", strategy_cfgs("replication"), calib, layout(), tr)
    # detect 5 + failover 10, the 5 s transfer at 0.7 throughput, join (rebuild) 20; redundant
    # computation costs 1/1.1 throughout
    assert (r["absorbed"], r["restarts"], r["swaps"]) == (1, 0, 1)
    assert r["goodput"] == pytest.approx((T - 35 - 0.3 * 5) / 1.1 / T, abs=1e-6)
    assert badput_s(r, "degraded") == pytest.approx(0.3 * 5 / 1.1)
    r = run("replication", strategy_cfgs("replication") | {"replace": "blocking"}, calib, layout(), tr)
    assert r["goodput"] == pytest.approx((T - 40) / 1.1 / T, abs=1e-6)  # detect + failover + the whole swap


def test_replication_without_spares_runs_degraded(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1000.0, 2, "fail", False, 3000.0)], 8, T)
    r = run("replication", strategy_cfgs("replication"), calib, layout(num_spares=0), tr)
    # degraded from 1015 s until the repaired node's state is in (4000 + 5 s), then joins (20 s)
    assert r["goodput"] == pytest.approx((1000 + 0.7 * 2990 + T - 4025) / 1.1 / T, abs=1e-6)


def test_replication_both_copies_lost_restarts(layout, calib, strategy_cfgs, handmade):
    tr = handmade([(1000.0, 2, "fail", False, 5000.0), (2000.0, 3, "fail", False, 5000.0)], 8, T)
    r = run("replication", strategy_cfgs("replication"), calib, layout(num_spares=0), tr)
    assert (r["fallbacks"], r["restarts"]) == (1, 1)


@pytest.mark.parametrize("name", ["deadpool", "deadpool_shrink", "inmem_restart", "checkpoint_restart",
                                  "replication", "elastic", "elastic_hsdp"])
def test_ledger_sums_to_wall_time_on_a_real_trace(name, strategy_cfgs):
    from sim.simulate import make_trace
    from sim.trace import DAY_S
    import yaml
    import sim.config
    calib = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "default.yaml").read_text())
    tcfg = yaml.safe_load((sim.config.SIM_CONF_DIR / "trace" / "llama3.yaml").read_text())
    tcfg["unexpected_per_1000_node_days"] = 60.0  # busy: overlapping failures, empty pools
    lay = Layout(num_gpus=2048, gpus_per_node=8, tp=8, pp=4, num_spares=2, model_params=70e9,
                 bytes_per_param_state=16, optimizer_sharded_over_dp=True, step_time_s=5.0)
    horizon = 20 * DAY_S
    tr = make_trace(tcfg, lay, horizon, seed=1)
    r = run_one(name, strategy_cfgs(name), calib, lay, tr, horizon, 3600.0)
    assert abs(r["accounting_error_s"]) < 1e-3
    assert 0.0 < r["goodput"] <= 1.0
    assert all(r[k] >= -1e-9 for k in r if k.startswith("badput_"))


def test_deadpool_matches_analytic_goodput_with_ample_spares(strategy_cfgs):
    """goodput ~= (T - sum(detect_by_cause) - (failures + planned) * swap) / (1 + overhead)
    - failures * E[recompute], with E[recompute] = step/2 + replication lag (progress units),
    under the default calibration (corruption counted as a crash here: no late detection)."""
    import yaml
    import sim.config
    from sim import costs
    from sim.simulate import make_trace
    from sim.trace import DAY_S
    calib = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "default.yaml").read_text())
    calib["sdc_causes"] = []
    tcfg = yaml.safe_load((sim.config.SIM_CONF_DIR / "trace" / "llama3.yaml").read_text())
    lay = Layout(num_gpus=16384, gpus_per_node=8, tp=8, pp=16, num_spares=64, model_params=405e9,
                 bytes_per_param_state=16, optimizer_sharded_over_dp=True, step_time_s=6.3)
    rc, snap, det = costs.reconfig(lay, calib), costs.snapshots(lay, calib), costs.detection(calib, lay)
    assert snap.overhead_frac > 0 and snap.net.interval_steps == 1
    rate = 1.0 / (1.0 + snap.overhead_frac)
    horizon = 54 * DAY_S
    for seed in range(3):
        r = run_one("deadpool", strategy_cfgs("deadpool"), calib, lay, make_trace(tcfg, lay, horizon, seed),
                    horizon, 3 * 3600.0)
        assert r["hangs"] > 0
        detect = (r["failures"] - r["hangs"]) * det.crash_s + r["hangs"] * det.hang_s
        stopped = detect + (r["failures"] + r["planned_maintenance"]) * rc.swap_s
        recompute = r["failures"] * (lay.step_time_s / 2 + snap.lag_s * rate)
        predicted = ((horizon - stopped) * rate - recompute) / horizon
        assert r["goodput"] == pytest.approx(predicted, abs=2e-4)
        assert r["fallbacks"] == 0 and r["stalls"] == 0


def test_events_scale_with_failures_not_steps(layout, calib, strategy_cfgs):
    import yaml
    import sim.config
    from sim.simulate import make_trace
    from sim.trace import DAY_S
    tcfg = yaml.safe_load((sim.config.SIM_CONF_DIR / "trace" / "llama3.yaml").read_text())
    horizon = 54 * DAY_S
    events = {}
    for step in (0.1, 10.0):
        lay = Layout(num_gpus=16384, gpus_per_node=8, tp=8, pp=16, num_spares=21, model_params=405e9,
                     bytes_per_param_state=16, optimizer_sharded_over_dp=True, step_time_s=step)
        tr = make_trace(tcfg, lay, horizon, seed=0)
        r = run_one("deadpool", strategy_cfgs("deadpool"), calib, lay, tr, horizon, 3 * 3600.0)
        events[step] = r["events"]
        assert r["events"] < 10 * len(tr)
    assert events[0.1] == events[10.0]  # 46 million vs 466 thousand steps: same event count


def test_addremove_trace_replays(tmp_path, layout, calib, strategy_cfgs):
    """A spot-style trace: node 3 is removed at 100 s and back at 900 s; node 10 joins at 200 s."""
    from sim.trace_io import load_addremove
    p = tmp_path / "spot.csv"
    p.write_text("time,event,node\n" + "".join(f"0,add,{n}\n" for n in range(10)) +
                 "100,remove,3\n200,add,10\n900,add,3\n")
    tr = load_addremove(p, horizon_s=T)
    assert tr.initially_down.tolist() == [10]
    r = run("deadpool", strategy_cfgs("deadpool"), calib, layout(), tr)
    assert (r["failures"], r["swaps"], r["restarts"]) == (1, 1, 0)
    assert r["goodput"] == pytest.approx((T - 5 - 25) / T, abs=1e-6)
    r = run("elastic", strategy_cfgs("elastic"), calib, layout(), tr)
    assert (r["shrinks"], r["regrows"]) == (1, 1)  # node 10 joins the idle survivor at 200 s


def test_elastic_relaunch_shrink_pays_a_relaunch_at_the_new_width(layout, calib, strategy_cfgs, handmade):
    """shrink=relaunch (the runtime's ft=elastic): write (10 s) + requeue 100 + launch at the
    new width (3 groups = 6 nodes: 2 s/log2 node + 1 s/node) + load 10, then 3/4 width; the
    regrow at 4000 relaunches at 8 nodes."""
    c = calib | {"launch_per_log2_nodes_s": 2.0, "launch_per_node_s": 1.0}
    s = strategy_cfgs("elastic") | {"shrink": "relaunch", "optimizer_state": "replica"}
    tr = handmade([(1000.0, 3, "fail", False, 3000.0)], 10, T)
    r = run("elastic", s, c, layout(), tr)
    import math
    shrink = 10 + 100 + 2 * math.log2(6) + 6 + 10
    regrow = 10 + 100 + 2 * 3 + 8 + 10
    assert (r["shrinks"], r["regrows"], r["restarts"]) == (1, 1, 0)
    assert badput_s(r, "reconfiguration") == pytest.approx(shrink + regrow)
    assert r["goodput"] == pytest.approx((1000 + 0.75 * (3000 - 5 - shrink) + T - 4000 - regrow) / T, abs=1e-6)
    with pytest.raises(ValueError, match="shrink must be"):
        run("elastic", s | {"shrink": "sideways"}, c, layout(), tr)


@pytest.mark.parametrize("exponent, table, speed", [
    (1.0, [], 0.75), (0.0, [], 1.0), (-0.5, [], 0.75 ** -0.5),
    (1.0, [[0.5, 0.8], [0.75, 1.25]], 0.8),  # a measured point: step time x 1.25
    (1.0, [[0.5, 0.8]], 1 / 0.9),  # interpolated between (0.5, 0.8) and (1, 1)
    (2.0, [[0.875, 1.1]], (0.75 / 0.875) ** 2 / 1.1)])  # below the table: the power law from its end
def test_reduced_width_speed_follows_the_calibration(layout, calib, strategy_cfgs, handmade, exponent, table, speed):
    tr = handmade([(1000.0, 3, "fail", False, 3000.0)], 10, T)
    c = calib | {"width_scaling_exponent": exponent, "width_step_time_ratio": table}
    r = run("elastic", strategy_cfgs("elastic"), c, layout(), tr)  # narrower until 4000 + 5 s of background transfer
    assert r["goodput"] == pytest.approx((1000 + speed * 2980 + T - 4025) / T, abs=1e-6)
