"""paper_figures: every script runs on result files alone (committed sweeps, a runtime fixture)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import sim.config

FIGS = sim.config.REPO_ROOT / "paper_figures"
NEW = ("fig09_overhead", "fig10_recovery_projection", "fig11_pareto", "fig12_timeline", "fig13_ranking",
       "fig14_trace_replay", "fig15_trace_fit")


def _env():  # the shipped results, whatever the caller's environment points at
    return {k: v for k, v in os.environ.items() if k != "DEADPOOL_RESULTS"}


@pytest.mark.slow
def test_make_all_on_committed_results(tmp_path):
    p = subprocess.run([sys.executable, str(FIGS / "make_all.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=240, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    for name in ("fig01_goodput_vs_scale", "fig02_badput_breakdown", "fig03_goodput_vs_mtbf",
                 "fig04_goodput_vs_spares", "fig06_tornado", "fig07_correlated", "fig08_spare_sizing") + NEW:
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000, name
        assert (tmp_path / f"{name}.pdf").exists(), name


@pytest.mark.slow
def test_python_m_paper_figures_draws_every_figure(tmp_path):
    p = subprocess.run([sys.executable, "-m", "paper_figures", "--out", str(tmp_path)], cwd=sim.config.REPO_ROOT,
                       capture_output=True, text=True, timeout=240, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    scripts = sorted(FIGS.glob("fig*.py"))
    assert len(scripts) >= 12
    for script in scripts:
        for ext in ("png", "pdf"):
            assert (tmp_path / f"{script.stem}.{ext}").exists(), script.stem
        assert f"{script.stem}: ok" in p.stdout
    assert f"{len(scripts)}/{len(scripts)} figures in" in p.stdout


@pytest.mark.slow
def test_python_m_paper_figures_reports_failures_and_goes_on(tmp_path):
    """A figure that raises is named in the exit status; the figures after it still run."""
    pkg = tmp_path / "repo" / "paper_figures"
    pkg.mkdir(parents=True)
    for f in ("__init__.py", "__main__.py", "style.py"):
        shutil.copy(FIGS / f, pkg / f)
    (pkg / "fig01_broken.py").write_text("import style\nraise RuntimeError('broken on purpose')\n")
    (pkg / "fig02_ok.py").write_text(
        "import matplotlib.pyplot as plt\nimport style\n\n"
        "if __name__ == '__main__':\n    a = style.args('', 'ok')\n"
        "    fig, ax = plt.subplots()\n    ax.plot([0, 1])\n    style.save(fig, a.out, 'fig02_ok')\n")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "paper_figures", "--out", str(out)], cwd=tmp_path / "repo",
                       capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0
    assert "failed: fig01_broken.py" in p.stderr and "broken on purpose" in p.stderr
    assert "fig02_ok: ok" in p.stdout and (out / "fig02_ok.png").exists()
    p = subprocess.run([sys.executable, "-m", "paper_figures", "--out", str(out), "--only", "fig77"],
                       cwd=tmp_path / "repo", capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode != 0 and "no figure script matches" in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_new_figures_skip_without_results(tmp_path, name):
    p = subprocess.run([sys.executable, str(FIGS / f"{name}.py"), "--input", str(tmp_path / "none"),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    if name == "fig10_recovery_projection":  # its projection reads the calibration under conf/, always there
        assert "skip panel (a)" in p.stdout and (tmp_path / f"{name}.png").exists()
    else:
        assert p.stdout.startswith("skip:") and not (tmp_path / f"{name}.png").exists()


@pytest.mark.slow
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
    for k in range(30):  # as many runs as the shipped results, nested paths, one 20x slower (a hang)
        d = tmp_path / "runtime" / "strategies" / "kills" / f"rep{k % 3}" / f"strategy_{k}"
        d.mkdir(parents=True)
        slow = dict(rec, detect_s=60.0, kill_to_first_step_s=64.0) if k == 7 else rec
        d.joinpath("summary.json").write_text(json.dumps(dict(world_size=8, recoveries=[slow])))
    p = subprocess.run([sys.executable, script, "--input", str(tmp_path / "runtime"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    from PIL import Image
    width, height = Image.open(tmp_path / "fig05_runtime_recovery.png").size
    assert width <= 2000 and height <= 2500, (width, height)  # readable, not 4,039 px wide


def test_runtime_figure_labels_runs_without_paths_and_cuts_an_outlier():
    sys.path.insert(0, str(FIGS))
    try:
        import fig05_runtime_recovery as fig05
    finally:
        sys.path.remove(str(FIGS))
    lab = fig05.label("strategies/kills/rep1/sync_snapshot", {"world_size": 4}, [{"fault": "kill"}])
    assert lab == "strategy runs: kills, repeat 1, sync snapshot (4 ranks, kill)"
    assert "/" not in fig05.label("bench3d/kill1_affected", {"world_size": 8}, [{"fault": "kill"}])
    end = fig05.axis_end([0.2, 0.25, 0.3, 2.2])  # the hang's 2.2 s would squash the rest
    assert 0.3 < end < 0.5


def test_ranking_figure_draws_from_its_csvs(tmp_path):
    """fig13 reads only the ranking study's CSVs (here a handmade pair, 2 samples x 2 scales)."""
    import pandas as pd

    d = tmp_path / "ranking"
    d.mkdir()
    rows = []
    for sample in range(2):
        for gpus in (16384, 131072):
            for s, g in (("deadpool", 0.95 + 0.01 * sample), ("checkpoint_restart", 0.96), ("elastic_hsdp", 0.9)):
                rows.append(dict(sample=sample, num_gpus=gpus, strategy=s, feasible=True, goodput=g,
                                 fleet_goodput=g - 0.01))
    pd.DataFrame(rows).to_csv(d / "samples.csv", index=False)
    pf = [dict(num_gpus=g, metric=m, strategy=s, p_first=p, ci95_lo=0.0, ci95_hi=1.0, n_samples=2)
          for g in (16384, 131072) for m in ("goodput", "fleet_goodput")
          for s, p in (("deadpool", 0.5), ("checkpoint_restart", 0.5), ("elastic_hsdp", 0.0))]
    pd.DataFrame(pf).to_csv(d / "p_first.csv", index=False)
    p = subprocess.run([sys.executable, str(FIGS / "fig13_ranking.py"), "--input", str(d), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "fig13_ranking.png").stat().st_size > 10_000
