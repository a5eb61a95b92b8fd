"""sim.calibrate on fixture run directories in the runtime's output format."""

import json
import math

import numpy as np
import pytest
import yaml

from sim import calibrate


def write_run(d, world_size, rebuild_a=1.5, rebuild_b=0.8, lat=0.2, gbps=4.0, step=0.5, blocked=0.01,
              n_rec=3, bytes_per=(1e9, 2e9, 4e9), metrics=True):
    d.mkdir(parents=True)
    recs = []
    for i in range(n_rec):
        b = bytes_per[i % len(bytes_per)]
        recs.append(dict(failed_rank=i, spare_rank=world_size + i, fault="kill", detected_by="heartbeat",
                         resume_step=10 + i, steps_recomputed=1, detect_s=2.0 + 0.1 * i, plan_s=0.3,
                         rebuild_s=rebuild_a + rebuild_b * math.log2(world_size), transfer_s=lat + b / (gbps * 1e9),
                         rollback_s=0.1, first_step_s=step * 1.5, kill_to_training_s=9.0,
                         kill_to_first_step_s=9.5, bytes_transferred=b))
    summary = dict(world_size=world_size, num_spares=1, dp=world_size, tp=1, pp=1, model_params=10_000_000,
                   state_bytes_per_rank=160_000_000, steps=100, step_time_s=step,
                   snapshot=dict(enabled=True, interval_steps=1, copy_s_median=0.05, replicate_s_median=0.25,
                                 blocked_s_median=blocked),
                   recoveries=recs, final_digest="abc")
    (d / "summary.json").write_text(json.dumps(summary))
    if metrics:
        with open(d / "metrics.jsonl", "w") as f:
            for step_i in range(20):
                for rank in range(world_size):
                    f.write(json.dumps(dict(step=step_i, rank=rank, loss=1.0, step_time_s=step, snapshot_copy_s=0.05,
                                            snapshot_blocked_s=blocked, replicate_s=0.25, generation=0,
                                            t=1e9 + step_i)) + "\n")
    return d


def test_fit_recovers_known_parameters(tmp_path):
    dirs = [write_run(tmp_path / f"ws{w}", w) for w in (4, 8, 16)]
    out = tmp_path / "measured.yaml"
    calibrate.main([str(d) for d in dirs] + ["--name", "measured", "--out", str(out)])
    text = out.read_text()
    vals = yaml.safe_load(text)
    assert vals["rebuild_base_s"] == pytest.approx(1.5, rel=1e-3)
    assert vals["rebuild_per_log2_gpus_s"] == pytest.approx(0.8, rel=1e-3)
    assert vals["transfer_latency_s"] == pytest.approx(0.2, rel=1e-3)
    assert vals["transfer_gbps_per_node"] == pytest.approx(4.0, rel=1e-3)
    assert vals["detect_crash_s"] == pytest.approx(2.1)
    assert vals["warmup_steps"] == pytest.approx(0.5)
    assert vals["snapshot_overhead_frac"] == pytest.approx(0.02)
    assert vals["replicate_lag_steps"] == pytest.approx(0.5)
    # every parameter line states its source; unmeasured ones say they were copied
    for line in text.splitlines():
        if line and not line.startswith("#") and not line.startswith("name:"):
            assert "  # " in line, line
    assert "requeue_s: 120.0  # copied from base calibration" in text


def test_one_world_size_keeps_base_slope(tmp_path):
    d = write_run(tmp_path / "one", 8, bytes_per=(2e9,), metrics=False)
    base = yaml.safe_load((calibrate.sim.config.SIM_CONF_DIR / "calibration" / "default.yaml").read_text())
    vals, src = calibrate.fit([calibrate.load_run(d)], base)
    assert vals["rebuild_per_log2_gpus_s"] == base["rebuild_per_log2_gpus_s"]
    assert vals["rebuild_base_s"] == pytest.approx(max(0.0, 1.5 + 0.8 * 3 - 2.0 * 3))
    # transfer_s = 0.7 s is below the base latency (1 s): nothing to fit, the base value stays
    assert "copied" in src["transfer_gbps_per_node"]
    assert vals["snapshot_overhead_frac"] == pytest.approx(0.02)  # from summary.json


def test_fitted_calibration_runs_in_the_simulator(tmp_path):
    dirs = [write_run(tmp_path / f"ws{w}", w) for w in (4, 8)]
    out = tmp_path / "m.yaml"
    calibrate.main([str(d) for d in dirs] + ["--out", str(out)])
    from sim.layout import Layout
    from sim import costs
    lay = Layout(num_gpus=16384, gpus_per_node=8, tp=8, pp=16, num_spares=21, model_params=405e9,
                 bytes_per_param_state=16, optimizer_sharded_over_dp=True, step_time_s=6.3)
    hot = costs.reconfig(lay, yaml.safe_load(out.read_text()))
    assert hot.rebuild_s == pytest.approx(1.5 + 0.8 * 14, rel=1e-3)


def test_bad_run_dir_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(calibrate.CalibrationError, match="empty: no summary.json"):
        calibrate.load_run(tmp_path / "empty")
    d = write_run(tmp_path / "broken", 4)
    with open(d / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(calibrate.CalibrationError, match=r"metrics.jsonl:\d+: not JSON"):
        calibrate.load_run(d)


def test_ab_overhead_classifies_each_step_by_the_previous_steps_snapshot():
    from sim.calibrate import _ab_overhead

    rows = []
    for step in range(1, 41):
        took = (step // 4) % 2 == 0
        prev_took = ((step - 1) // 4) % 2 == 0
        rows.append({"rank": 0, "step": step, "snapshot": took,
                     "step_time_s": 1.1 if prev_took else 1.0})
    assert abs(_ab_overhead(rows) - 0.1) < 1e-9
    assert _ab_overhead([{"rank": 0, "step": 1, "snapshot": True, "step_time_s": 1.0}]) is None


def test_measured_protection_lag_and_interval_come_from_the_runtime_record(tmp_path):
    """The runtime records per rank and step how far the newest replicated snapshot lags and the
    interval its schedule chose: the calibration takes the job's lag (largest over ranks) and
    that interval, not the configured one."""
    d = write_run(tmp_path / "r", 2, metrics=False)
    with open(d / "metrics.jsonl", "w") as f:
        for step in range(1, 33):
            for rank in range(2):
                lag = (step - 1) % 4 + 1 + (2 if rank == 1 else 0)  # rank 1 lags 2 steps more
                f.write(json.dumps(dict(step=step, rank=rank, step_time_s=0.5, snapshot_blocked_s=0.0,
                                        snapshot=step % 4 == 0, protection_lag_steps=lag,
                                        snapshot_interval=4)) + "\n")
    out = tmp_path / "m.yaml"
    calibrate.main([str(d), "--name", "m", "--out", str(out)])
    text = out.read_text()
    vals = yaml.safe_load(text)
    assert vals["snapshot_interval_steps"] == 4
    # job lag per step = rank 1's: 3..6, median 4.5; minus half an interval
    assert vals["replicate_lag_steps"] == pytest.approx(2.5)
    assert "protection_lag_steps" in next(l for l in text.splitlines()
                                          if l.startswith("replicate_lag_steps"))


def test_relaunch_costs_are_fitted_from_checkpoint_restart_runs_only(tmp_path):
    # hot-swap runs, plus checkpoint/restart runs whose relaunch costs 3 + 2*log2(world size)
    dirs = [write_run(tmp_path / f"ws{w}", w) for w in (4, 8, 16)]
    for w in (2, 4, 8):
        d = tmp_path / f"cr{w}"
        d.mkdir()
        recs = [dict(failed_rank=1, fault="kill", detected_by="exit", resume_step=10,
                     steps_recomputed=2, detect_s=0.05, fallback="restart", teardown_s=0.4,
                     start_s=2.0 + 2.0 * math.log2(w), rebuild_s=0.5, first_step_s=0.5,
                     load_s=0.03 * w, outcome="relaunched from checkpoint",
                     kill_to_first_step_s=20.0)]
        (d / "summary.json").write_text(json.dumps(dict(
            strategy="checkpoint_restart", world_size=w, num_spares=0, dp=w, tp=1, pp=1, steps=40,
            step_time_s=0.5, snapshot=dict(enabled=False, interval_steps=1), recoveries=recs)))
        dirs.append(d)
    out = tmp_path / "m.yaml"
    calibrate.main([str(d) for d in dirs] + ["--out", str(out)])
    vals = yaml.safe_load(out.read_text())
    assert vals["launch_base_s"] == pytest.approx(3.0, rel=1e-3)
    assert vals["launch_per_log2_nodes_s"] == pytest.approx(2.0, rel=1e-3)
    assert vals["launch_per_node_s"] == pytest.approx(0.0, abs=1e-6)
    assert vals["requeue_s"] == pytest.approx(0.4)
    assert vals["ckpt_latency_s"] == pytest.approx(0.12)
    # the relaunches' detection (0.05 s) and warm-up do not leak into the hot-swap fits
    assert vals["detect_crash_s"] == pytest.approx(2.1)
    assert vals["rebuild_base_s"] == pytest.approx(1.5, rel=1e-3)


def test_launch_per_process_term_and_elastic_relaunches_at_their_width(tmp_path):
    """Relaunch cost 1 + 0.5*log2(w) + 2*w, measured by checkpoint/restart runs at width 2 and 4
    and by an elastic run whose shrink relaunched at width 3 (its record says dp=3): the linear
    term is fitted; the elastic run's reduced-width steps give the width exponent."""
    def cost(w):
        return 1.0 + 0.5 * math.log2(w) + 2.0 * w
    dirs = []
    for name, w, relaunch_w, fallback in (("cr2", 2, 2, "restart"), ("cr4", 4, 4, "restart"),
                                          ("el4", 4, 3, "shrink"), ("cr4b", 4, 4, "restart")):
        d = tmp_path / name
        d.mkdir()
        rec = dict(failed_rank=1, fault="kill", detected_by="exit", resume_step=10, steps_recomputed=0,
                   detect_s=0.05, fallback=fallback, teardown_s=0.1, start_s=cost(relaunch_w) - 1.0,
                   rebuild_s=0.5, first_step_s=0.5, load_s=0.02, kill_to_first_step_s=10.0)
        if fallback == "shrink":
            rec["dp"] = relaunch_w
        (d / "summary.json").write_text(json.dumps(dict(
            strategy="elastic" if fallback == "shrink" else "checkpoint_restart", world_size=w, num_spares=0,
            dp=relaunch_w, tp=1, pp=1, steps=40, step_time_s=0.5,
            snapshot=dict(enabled=False, interval_steps=1), recoveries=[rec])))
        if fallback == "shrink":  # 4 ranks at 0.4 s/step, then 3 ranks at 0.4 * (3/4)**-0.5 s/step
            rows = [dict(step=s, rank=r, generation=0, step_time_s=0.4) for s in range(1, 11) for r in range(4)]
            rows += [dict(step=s, rank=r, generation=2, step_time_s=0.4 / (3 / 4) ** 0.5)
                     for s in range(11, 21) for r in range(3)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
        dirs.append(d)
    out = tmp_path / "m.yaml"
    calibrate.main([str(d) for d in dirs] + ["--out", str(out)])
    vals = yaml.safe_load(out.read_text())
    assert vals["launch_base_s"] == pytest.approx(1.0, abs=1e-3)
    assert vals["launch_per_log2_nodes_s"] == pytest.approx(0.5, abs=1e-3)
    assert vals["launch_per_node_s"] == pytest.approx(2.0, abs=1e-3)
    assert vals["width_scaling_exponent"] == pytest.approx(0.5, abs=1e-6)
    [(frac, ratio)] = vals["width_step_time_ratio"]
    assert frac == 0.75 and ratio == pytest.approx((3 / 4) ** -0.5, abs=1e-6)


def test_shipped_strategy_runs_calibrate_restart_and_swap_over_three_world_sizes(tmp_path):
    # the run directories experiments/compare_strategies.py keeps (CPU, tiny model)
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "experiments/results/runtime/strategies"
    dirs = [root / s / k for k in ("deadpool", "checkpoint_restart")
            for s in ("kills", "burst", "scale/dp2", "scale/dp3")]
    out = tmp_path / "c.yaml"
    calibrate.main([str(d) for d in dirs] + ["--out", str(out)])
    text = out.read_text()
    for key in ("launch_per_log2_nodes_s", "launch_per_node_s", "rebuild_per_log2_gpus_s"):
        line = next(x for x in text.splitlines() if x.startswith(key + ":"))
        assert "world sizes [2, 3, 4]" in line, line  # a slope fitted, not assumed


@pytest.mark.results
def test_on_the_shipped_runs_a_relaunch_costs_over_ten_hot_swap_rebuilds(tmp_path):
    """An outcome of the shipped CPU runs (not an invariant): a relaunch (new processes, imports,
    model build) measured more than ten times a hot swap's group rebuild at 4 ranks."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2] / "experiments/results/runtime/strategies"
    dirs = [root / s / k for k in ("deadpool", "checkpoint_restart")
            for s in ("kills", "burst", "scale/dp2", "scale/dp3")]
    out = tmp_path / "c.yaml"
    calibrate.main([str(d) for d in dirs] + ["--out", str(out)])
    vals = yaml.safe_load(out.read_text())
    assert vals["launch_base_s"] + vals["launch_per_log2_nodes_s"] * 2 + vals["launch_per_node_s"] * 4 > \
        10 * (vals["rebuild_base_s"] + vals["rebuild_per_log2_gpus_s"] * 2)
