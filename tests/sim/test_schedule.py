"""Lazy checkpoint schedule arithmetic and the analytic anchors (Young, Daly)."""

import pytest

from sim.schedule import Checkpoints, daly_expected_wall_s, daly_tau_opt, young_tau_opt

H, MIN = 3600.0, 60.0


@pytest.mark.parametrize("m_s, published_min", [(24 * H, 117), (6 * H, 57), (15 * MIN, 9.1)])
def test_daly_tau_opt_published_points(m_s, published_min):
    assert daly_tau_opt(5 * MIN, m_s) / MIN == pytest.approx(published_min, abs=0.5)


def test_daly_limits():
    assert daly_tau_opt(10.0, 4.0) == 4.0  # delta >= 2M -> M
    assert daly_tau_opt(1.0, 1e6) == pytest.approx(young_tau_opt(1.0, 1e6), rel=1e-3)
    # no failures -> wall time = work * (1 + delta/tau)
    assert daly_expected_wall_s(100.0, 10.0, 1.0, 5.0, 1e12) == pytest.approx(110.0, rel=1e-6)


def test_sync_schedule_by_hand():
    c = Checkpoints(interval_w=100.0, stall_s=10.0)
    w, stall = c.advance(0.0, 0.0, 255.0, 1.0)
    # compute 0-100, write 100-110, compute 110-210, write 210-220, compute 220-255
    assert (w, stall, c.durable, c.next_mark) == (235.0, 20.0, 200.0, 300.0)
    assert c.rollback(255.0) == 200.0 and c.next_mark == 300.0


def test_failure_inside_a_write_loses_it():
    c = Checkpoints(interval_w=100.0, stall_s=10.0)
    w, stall = c.advance(0.0, 0.0, 105.0, 1.0)
    assert (w, stall, c.durable) == (100.0, 5.0, 0.0)
    assert c.rollback(105.0) == 0.0


def test_async_persist_lag_and_cancel():
    c = Checkpoints(interval_w=100.0, stall_s=1.0, persist_lag_s=20.0)
    w, _ = c.advance(0.0, 0.0, 110.0, 1.0)  # taken at 101, durable at 121
    assert w == 109.0 and c.durable == 0.0 and c.inflight == [(100.0, 121.0)]
    c.settle(125.0)
    assert c.durable == 100.0
    c2 = Checkpoints(interval_w=100.0, stall_s=1.0, persist_lag_s=20.0)
    c2.advance(0.0, 0.0, 110.0, 1.0)
    assert c2.rollback(110.0) == 0.0  # the in-flight persist is cancelled


def test_rate_scales_run_time():
    c = Checkpoints(interval_w=100.0, stall_s=0.0)
    w, _ = c.advance(0.0, 0.0, 400.0, 0.5)
    assert w == 200.0 and c.durable == 200.0
