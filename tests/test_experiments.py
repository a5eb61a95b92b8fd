"""Every conf/experiment/<name>.yaml and sim/conf/experiment/sim_<name>.yaml: deltas only, a "Run as:" line, composes, and runs at a tiny
size (runtime experiments through the runtime with real processes, simulator ones through
sim.simulate) with the overrides its "Run as:" line gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sim.config
from deadpool.launch.config import compose_config
from deadpool.launch.job import run_job
from sim.simulate import run_scenario
from tests.conftest import FORKED

RUNTIME_CONF = Path(__file__).resolve().parents[1] / "conf"  # sim_*: sim/conf/experiment/
EXPERIMENTS = sorted(p.stem for d in (RUNTIME_CONF, sim.config.CONF_DIR)
                     for p in (d / "experiment").glob("*.yaml"))
COMMANDS = {"runtime": "python -m deadpool.train", "sim": "python -m sim.run"}


def kind(name: str) -> str:
    return "sim" if name.startswith("sim_") else "runtime"


def experiment_file(name: str) -> Path:
    return (sim.config.CONF_DIR if kind(name) == "sim" else RUNTIME_CONF) / "experiment" / f"{name}.yaml"


def run_as_overrides(name: str) -> list[str]:
    """The Hydra overrides of the first ``python -m ...`` command on the file's "Run as:" lines."""
    text = experiment_file(name).read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if "Run as:" in ln)
    comment = " ".join(ln.lstrip("# ") for ln in lines[start:start + 3])
    cmd = COMMANDS[kind(name)]
    assert cmd in comment, f"{name}: the Run as: line does not give a `{cmd}` command"
    rest = comment.split(cmd, 1)[1]
    rest = re.split(r"[),]|\s\(", rest)[0]
    overrides = [t for t in rest.split() if "=" in t and not t.startswith("hydra")]
    assert f"experiment={name}" in overrides, f"{name}: Run as: does not select experiment={name}"
    return overrides


def test_there_are_runtime_and_simulator_experiments():
    assert {kind(n) for n in EXPERIMENTS} == {"runtime", "sim"}
    assert "cpu_hotswap" in EXPERIMENTS  # make demo


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_deltas_only_with_a_run_as_line(name):
    text = experiment_file(name).read_text()
    assert text.startswith("# @package _global_\n"), name
    assert "Run as:" in text
    run_as_overrides(name)


def compose_sim(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        return OmegaConf.to_container(compose("sim", overrides=overrides), resolve=True)


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if kind(n) == "sim"])
def test_simulator_experiment_runs_tiny(name):
    c = compose_sim(run_as_overrides(name) + ["seeds=1", "duration_days=1", "progress=false"])
    rows = run_scenario(c, progress=False)
    assert {r["strategy"] for r in rows} == set(c["strategies"])
    assert all(0.0 <= r["goodput"] <= 1.0 for r in rows)


def shrink(cfg: dict, steps: int) -> dict:
    """The same experiment at ``steps`` steps; fault steps scaled into the shorter run."""
    n = int(cfg["num_steps"])
    if n > steps:
        for e in cfg["faults"]["events"]:
            e["step"] = max(2, min(steps - 2, round(e["step"] * steps / n)))
        cfg["num_steps"] = steps
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if kind(n) == "runtime"])
def test_runtime_experiment_runs_tiny(name, tmp_path):
    # forked from the agents (tests/conftest.py FORKED: ~3 s of CPU saved per process)
    cfg = compose_config(FORKED + run_as_overrides(name), tmp_path / name)
    cfg = shrink(cfg, 10)
    s = run_job(cfg, log=lambda *a, **k: None)
    assert s["outcome"] == "completed", s.get("message")
    assert (Path(cfg["run_dir"]) / "metrics.jsonl").exists()
    if cfg["faults"]["events"]:
        assert s["recoveries"], "the experiment's faults fired no recovery"


@pytest.mark.slow
def test_bench_overhead_quick_runs_end_to_end(tmp_path):
    """The overhead benchmark's smoke mode: every arm runs and lands in results.json (not
    timed: the ratios are only checked to exist and be positive)."""
    import json
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "experiments" / "bench_overhead.py"), "--quick",
                    "--out", str(tmp_path)], check=True, cwd=root, timeout=300,
                   env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.DEVNULL)
    res = json.loads((tmp_path / "results.json").read_text())["settings"]["2 fp32"]
    for w in ("early", "steady"):
        assert all(len(v) == 1 and v[0] > 0 for v in res["windows"][w]["ratios"].values())
    assert set(res["ratios"]) == {"on/ddp", "off/ddp", "on/off"}
    (on,) = res["runs"]["on"]
    assert on["bytes_per_snapshot"] > 0 and on["param_gather_s"] > 0
    assert 0 < on["integrity_check_share"] < 1  # the check's time on the thread, per step
    assert (tmp_path / "2" / "fp32" / "on-0" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(1600)
def test_gpu_throughput_check_runs_end_to_end_on_cpu(tmp_path):
    """GPU check 4's machinery on a small CPU job (the GPU runs are rare: the script must work
    the first time there): both DeadPool arms are stopped once their last step is logged, their
    steps and start-up are read from the ranks' files, and the plain arm is timed beside them."""
    import json
    import os
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "experiments" / "gpu" / "check_throughput.py"),
                    str(tmp_path), "--device", "cpu", "--model", "tiny", "--batch-size", "2",
                    "--seq-len", "32", "--steps", "12", "--warmup", "2", "--settled", "4",
                    # one compiled arm (its plumbing; compiled training itself is tested in
                    # test_compile): a CPU inductor compile costs minutes of the suite per arm
                    "--arms", "deadpool_on_compile,plain,deadpool_off,deadpool_on",
                    "--timeout-s", "150", "--compile-timeout-s", "400", "--budget-s", "900"],
                   check=True, cwd=root, timeout=1000,
                   env=dict(os.environ, PYTHONPATH=str(root)), stdout=subprocess.DEVNULL)
    res = json.loads((tmp_path / "check_throughput.json").read_text())
    assert len(res["plain"]["step_s"]) == 12 and res["plain"]["tokens_per_s"] > 0
    for arm, snapshots in (("deadpool_snapshot_off", False), ("deadpool_snapshot_on", True),
                           ("deadpool_snapshot_on_compile", True)):
        r = res[arm]
        assert not r["timed_out"], r["tail"]
        assert len(r["step_s"]) == 12 and r["settled_tokens_per_s"] > 0, r["tail"]
        assert (r["snapshots"] > 0) == snapshots
        assert r["launch_to_first_step_s"] > 0 and "start-up" in r["startup_line"]
        assert r["settled_vs_plain"] > 0


def test_cpu_share_finds_a_busy_process_and_its_threads():
    """cpu_share reads /proc: a child spinning one thread shows up with its cores used."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\n"
                             "while time.time() - t < 20: pass", "cpu-share-probe"])
    try:
        out = subprocess.run([sys.executable, str(root / "experiments" / "cpu_share.py"),
                              "--after", "0.3", "--for", "1", "--match", "cpu-share-probe"],
                             check=True, capture_output=True, text=True, timeout=60).stdout
    finally:
        spin.kill()
        spin.wait()
    row = next(line for line in out.splitlines() if line.split()[0] == str(spin.pid))
    assert float(row.split("cores")[0].split()[-1]) > 0.2, out  # a spinning thread, shared host
    assert out.splitlines()[-1].split()[0] == "all", out
