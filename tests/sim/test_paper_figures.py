"""paper_figures: every script runs on result files alone (committed sweeps, a runtime fixture)."""

import json
import subprocess
import sys

import pytest

import sim.config

FIGS = sim.config.REPO_ROOT / "paper_figures"


@pytest.mark.slow
def test_make_all_on_committed_results(tmp_path):
    p = subprocess.run([sys.executable, str(FIGS / "make_all.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("fig01_goodput_vs_scale", "fig02_badput_breakdown", "fig03_goodput_vs_mtbf",
                 "fig04_goodput_vs_spares", "fig06_tornado", "fig07_correlated", "fig08_spare_sizing"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000


def test_runtime_figure_skips_without_results_and_draws_with_them(tmp_path):
    script = str(FIGS / "fig05_runtime_recovery.py")
    p = subprocess.run([sys.executable, script, "--input", str(tmp_path / "none"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "skip" in p.stdout
    run = tmp_path / "runtime" / "r1"
    run.mkdir(parents=True)
    rec = dict(failed_rank=1, spare_rank=4, fault="kill", detected_by="heartbeat", resume_step=5, steps_recomputed=1,
               detect_s=1.0, plan_s=0.1, rebuild_s=2.0, transfer_s=0.5, rollback_s=0.1, first_step_s=0.4,
               kill_to_training_s=3.8, kill_to_first_step_s=4.2, bytes_transferred=1e8)
    run.joinpath("summary.json").write_text(json.dumps(dict(world_size=4, recoveries=[rec])))
    p = subprocess.run([sys.executable, script, "--input", str(tmp_path / "runtime"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "fig05_runtime_recovery.png").exists()
