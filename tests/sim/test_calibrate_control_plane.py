"""sim.calibrate_control_plane on synthetic benchmark tables, and the N-dependent costs it feeds."""

import csv

import pytest
import yaml

import sim.config
from sim import calibrate, calibrate_control_plane as cp, costs
from sim.layout import Layout
from sim.simulate import run_one
from sim.trace import LLAMA3_CAUSE_MIX

COLS = ("ranks", "protocol", "store_ops_per_s_per_rank", "exit_detect_s", "node_detect_s", "plan_everywhere_s",
        "coordinator_cpu_frac", "detect_to_plan_s", "dilation", "survived")
# known lines: exit 0.01 + 2e-7 N, node 2.5 + 3e-5 N, plan 0.02 + 1e-4 N
EXIT, NODE, PLAN = (0.01, 2e-7), (2.5, 3e-5), (0.02, 1e-4)


def write_table(d, rows):
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in COLS})
    return d


def synthetic(ns=(512, 2048, 8192, 16384)):
    rows = [dict(ranks=n, protocol="new", exit_detect_s=EXIT[0] + EXIT[1] * n, node_detect_s=NODE[0] + NODE[1] * n,
                 plan_everywhere_s=PLAN[0] + PLAN[1] * n, dilation=1.0, survived=True) for n in ns]
    # rows the fit must ignore: the other protocol, a size that did not survive
    rows.append(dict(ranks=512, protocol="old", exit_detect_s=5.0, node_detect_s=10.0, plan_everywhere_s=9.0,
                     dilation=1.0, survived=True))
    rows.append(dict(ranks=32768, protocol="new", exit_detect_s=99.0, plan_everywhere_s=99.0, dilation=1.0,
                     survived=False))
    return rows


def test_fit_recovers_known_coefficients(tmp_path):
    lines = cp.fit(cp.read_table(write_table(tmp_path / "t", synthetic())), "new")
    for col, (a, b) in (("exit_detect_s", EXIT), ("node_detect_s", NODE), ("plan_s", PLAN)):
        assert lines[col].base == pytest.approx(a, rel=1e-6)
        assert lines[col].per_rank == pytest.approx(b, rel=1e-6)
        assert lines[col].rms_s == pytest.approx(0.0, abs=1e-9)
        assert [n for n, _ in lines[col].rows] == [512, 2048, 8192, 16384]


def test_the_plan_term_counts_status_collection_where_the_table_has_it(tmp_path):
    """Detection -> plan (statuses in, plan written) plus the plan reaching every rank: what the
    runtime records as a recovery's plan time; an older table gives the second part alone."""
    rows = synthetic()
    for r in rows:
        r["detect_to_plan_s"] = 0.05 + 3e-5 * r["ranks"]
    lines = cp.fit(cp.read_table(write_table(tmp_path / "t", rows)), "new")
    assert lines["plan_s"].column == "detect_to_plan_s + plan_everywhere_s"
    assert lines["plan_s"].base == pytest.approx(PLAN[0] + 0.05, rel=1e-6)
    assert lines["plan_s"].per_rank == pytest.approx(PLAN[1] + 3e-5, rel=1e-6)
    older = cp.fit(cp.read_table(write_table(tmp_path / "o", synthetic())), "new")
    assert older["plan_s"].column == "plan_everywhere_s"
    out = tmp_path / "fit.yaml"
    cp.main([str(tmp_path / "t"), "--out", str(out)])
    assert "fitted on detect_to_plan_s + plan_everywhere_s (4 rows" in out.read_text()


def test_slope_and_intercept_are_never_negative(tmp_path):
    """A time that falls with N (noise) gets slope 0; one that would cross zero gets intercept 0."""
    rows = [dict(ranks=512, protocol="new", exit_detect_s=0.012, node_detect_s=3.0, plan_everywhere_s=0.03,
                 survived=True),
            dict(ranks=2048, protocol="new", exit_detect_s=0.008, node_detect_s=3.0, plan_everywhere_s=0.3,
                 survived=True)]
    lines = cp.fit(rows, "new")
    assert lines["exit_detect_s"].per_rank == 0.0 and lines["exit_detect_s"].base == pytest.approx(0.010)
    assert lines["plan_s"].base == 0.0 and lines["plan_s"].per_rank > 0
    one = cp.fit(rows[:1], "new")  # one size: the value, slope 0
    assert (one["node_detect_s"].base, one["node_detect_s"].per_rank) == (3.0, 0.0)


def test_no_surviving_row_of_the_protocol_is_a_clear_error(tmp_path):
    rows = [r for r in synthetic() if r["protocol"] == "old"]
    rows.append(dict(ranks=8192, protocol="new", survived=False))
    d = write_table(tmp_path / "t", rows)
    with pytest.raises(cp.ControlPlaneFitError, match="no row of protocol 'new' survived"):
        cp.fit(cp.read_table(d), "new")
    with pytest.raises(SystemExit, match="no row of protocol 'new' survived"):  # the CLI: one line, no traceback
        cp.cli([str(d), "--out", str(tmp_path / "x.yaml")])
    assert not (tmp_path / "x.yaml").exists()
    with pytest.raises(cp.ControlPlaneFitError, match="no such table"):
        cp.read_table(tmp_path / "missing")


def _lay(n):
    return Layout(num_gpus=n, gpus_per_node=8, tp=8, pp=16, num_spares=0, model_params=405e9,
                  bytes_per_param_state=16, optimizer_sharded_over_dp=True, step_time_s=6.3)


def test_written_calibration_grows_plan_time_with_n_as_fitted(tmp_path):
    out = tmp_path / "fit.yaml"
    cp.main([str(write_table(tmp_path / "t", synthetic())), "--protocol", "new", "--out", str(out)])
    text = out.read_text()
    c = yaml.safe_load(text)
    assert c["name"] == "control_plane_fit" and "plan_s" not in c
    base = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "gpu_h100.yaml").read_text())
    assert all(c[k] == v for k, v in base.items() if k not in ("name", "detect_crash_s", "plan_s"))  # the rest: the base's
    assert "detect_crash_s: 10.0" in text and "plan_s: 0.5" in text  # the replaced values are noted
    for n in (512, 16384, 131072):
        lay = _lay(n)
        assert costs.reconfig(lay, c).plan_s == pytest.approx(PLAN[0] + PLAN[1] * n, rel=1e-3)
        det = costs.detection(c, lay)
        assert det.crash_s == pytest.approx(EXIT[0] + EXIT[1] * n, rel=1e-3)
        assert det.seconds(costs.CRASH, "psu") == pytest.approx(NODE[0] + NODE[1] * n, rel=1e-3)
        assert det.seconds(costs.CRASH, "faulty_gpu") == det.crash_s
        assert det.seconds(costs.HANG, "psu") == det.hang_s  # a hang cause stays a hang
    assert costs.reconfig(_lay(131072), c).plan_s > costs.reconfig(_lay(512), c).plan_s
    # fitting again on the written file as the base replaces the block instead of adding one
    again = tmp_path / "again.yaml"
    cp.main([str(tmp_path / "t"), "--out", str(again), "--base", str(out), "--name", "x"])
    assert again.read_text().count(cp.MARK_BEGIN) == 1


def test_a_calibration_with_only_plan_s_still_works():
    c = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "default.yaml").read_text())
    assert "plan_s" in c and "plan_base_s" not in c
    for n in (512, 131072):
        assert costs.reconfig(_lay(n), c).plan_s == c["plan_s"]
        assert costs.detection(c, _lay(n)).seconds(costs.CRASH, "psu") == c["detect_crash_s"]  # no node term
    with pytest.raises(ValueError, match="both plan_s and plan_base_s"):
        costs.reconfig(_lay(512), c | {"plan_base_s": 0.1})


def test_shipped_fit_is_the_default_profile_with_n_dependent_control_plane():
    c = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "control_plane_fit.yaml").read_text())
    small, big = _lay(512), _lay(16384)
    assert costs.reconfig(big, c).plan_s >= costs.reconfig(small, c).plan_s
    assert costs.detection(c, big).node_s is not None and c["node_causes"]
    assert set(c["node_causes"]) <= set(LLAMA3_CAUSE_MIX)


def test_node_loss_is_detected_in_the_node_time(layout, calib, strategy_cfgs, handmade):
    """Handmade trace (cause 'permanent' for every non-transient failure): with node_causes =
    [permanent] the failure is noticed in detect_node_s (3 s) instead of detect_crash_s (5 s);
    a transient one (another cause) still in 5 s. Lost work 3 s, swap 25 s each."""
    T = 10_000.0
    c = calib | {"detect_node_s": 3.0, "node_causes": ["permanent"]}
    for transient, detect in ((False, 3.0), (True, 5.0)):
        tr = handmade([(1003.0, 3, "fail", transient, 5000.0)], 10, T)
        r = run_one("deadpool", strategy_cfgs("deadpool"), c, layout(), tr, T, 1e9)
        assert r["badput_detection_h"] * 3600 == pytest.approx(detect)
        assert r["goodput"] == pytest.approx((T - 3 - detect - 25) / T, abs=1e-6)


def test_runtime_fit_on_a_control_plane_base_keeps_one_plan_key(tmp_path):
    """sim.calibrate's single-size plan_s median replaces a base's N-dependent plan terms."""
    base = yaml.safe_load((sim.config.SIM_CONF_DIR / "calibration" / "control_plane_fit.yaml").read_text())
    run = dict(_dir=str(tmp_path / "r"), world_size=4, step_time_s=0.5, recoveries=[dict(detect_s=2.0, plan_s=0.3)],
               snapshot=dict(enabled=True, interval_steps=1, replicate_s_median=0.25, blocked_s_median=0.01))
    vals, src = calibrate.fit([run], base)
    assert vals["plan_s"] == pytest.approx(0.3) and "plan_base_s" not in vals and "plan_per_rank_s" not in vals
    assert "detect_crash_per_rank_s" not in vals and set(vals) == set(src)
    assert costs.plan_s(_lay(512), vals) == pytest.approx(0.3)  # no "both plan_s and plan_base_s" error
