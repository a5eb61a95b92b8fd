"""sim.network: replication traffic against the NIC and the gradient traffic it competes with."""

import pytest

from sim import costs, network
from sim.layout import Layout

BASE = dict(snapshot_interval_steps=1, replicate="unique", on_nic_overflow="backpressure",
            host_copy_gbps_per_gpu=1e6, replicate_lag_steps=0.0, snapshot_overhead_frac=0.0)


def lay(nic, step=10.0, **kw):
    args = dict(num_gpus=64, gpus_per_node=8, tp=8, pp=1, num_spares=0, model_params=8e9,
                bytes_per_param_state=16.0, optimizer_sharded_over_dp=True, step_time_s=step,
                nic_gbps_per_node=nic)
    args.update(kw)
    return Layout(**args)


def test_traffic_volumes():
    lo = lay(100.0)  # dp = 8: per GPU 1e9 params; grads 2 * 2 B * 1e9 * 7/8 = 3.5 GB; x8 GPUs
    assert network.grad_bytes_per_node(lo) == pytest.approx(28e9)
    assert network.replicated_bytes_per_node(lo, "unique") == pytest.approx(8 * 1e9 * 14 / 8)
    assert network.replicated_bytes_per_node(lo, "full") == pytest.approx(8 * lo.state_bytes_per_gpu)
    assert network.replicated_bytes_per_node(lo, "unique", 2) == pytest.approx(2 * 8 * 1e9 * 14 / 8)


def test_fits_only_the_lag_grows():
    # NIC 10 GB/s: grads 2.8 s, replica 14 GB = 1.4 s of NIC, spare 7.2 s per 10 s step
    p = network.plan(lay(10.0), BASE)
    assert (p.interval_steps, p.extra_overhead_frac) == (1, 0.0)
    assert p.lag_s == pytest.approx(1.4 * 10.0 / 7.2)
    assert p.nic_util == pytest.approx((2.8 + 1.4) / 10.0)


def test_overflow_widens_the_interval_or_slows_training():
    # NIC 2 GB/s: grads 14 s > 10 s step? no: use a 20 s step: grads 14 s, spare 6 s, replica 7 s
    lo = lay(2.0, step=20.0)
    widen = network.plan(lo, BASE | {"on_nic_overflow": "widen"})
    assert widen.interval_steps == 2 and widen.extra_overhead_frac == 0.0
    assert widen.lag_s == pytest.approx(7.0 * 20.0 / 6.0)
    slow = network.plan(lo, BASE)
    assert slow.interval_steps == 1
    assert slow.extra_overhead_frac == pytest.approx((14.0 + 7.0) / 20.0 - 1.0)
    # the shared cost model hands both to the strategies
    snap = costs.snapshots(lo, BASE | {"on_nic_overflow": "widen", "snapshot_memory_generations": 2})
    assert snap.interval_w == pytest.approx(40.0) and snap.lag_s == pytest.approx(widen.lag_s)


def test_widened_interval_costs_more_recomputation(layout, calib, strategy_cfgs, handmade):
    """Same failure, a narrow NIC: widening the interval (and the lag) loses more work, and
    backpressure instead slows every step."""
    from sim.simulate import run_one
    T = 10_000.0
    # NIC 2 GB/s: gradients 6 s of a 10 s step, the 14 GB shard replica 7 s -> every 2 steps
    lo = layout(model_params=8e9, optimizer_sharded_over_dp=True, nic_gbps_per_node=2.0)
    tr = handmade([(5003.0, 3, "fail", False, 9000.0)], 10, T)
    c = calib | {"host_copy_gbps_per_gpu": 1e6}
    wide = run_one("deadpool", strategy_cfgs("deadpool"), c | {"on_nic_overflow": "widen"}, lo, tr, T, 1e9)
    ample = run_one("deadpool", strategy_cfgs("deadpool"), c, layout(model_params=8e9, nic_gbps_per_node=1e6),
                    tr, T, 1e9)
    slow = run_one("deadpool", strategy_cfgs("deadpool"), c, lo, tr, T, 1e9)
    assert wide["badput_lost_h"] > ample["badput_lost_h"] + 10 / 3600
    assert wide["badput_snapshot_h"] == 0.0
    assert slow["badput_snapshot_h"] > 0.01
