"""Rerun the measurements and sweeps behind every figure, then draw the figures.

    make reproduce [reproduce.scale=small]
    python -m experiments.reproduce reproduce.scale=small [reproduce.only=[strategies,figures]]

Config: conf/reproduce.yaml. Steps, in order (each prints its time):

    strategies   experiments/compare_strategies.py      every runtime strategy, kills, burst (CPU)
    calibrate    python -m sim.calibrate                the simulator's costs from those runs
    replay       python -m sim.replay                   the simulator replays each measured run
    overhead     experiments/bench_overhead.py          DeadPool vs stock torch DDP, side by side
    bench3d      experiments/bench_3d.py                dp2 x tp2 x pp2 overhead and recovery
    sim_scale, sim_mtbf, sim_spares                     Hydra multirun sweeps (sim/conf/experiment/sim_*.yaml)
    sensitivity, correlated, spare_sizing, fair         experiments/sim/*.py
    headline     experiments/sim/headline.py            old vs new defaults at 16k and 131k GPUs
    validate     python -m sim.validate                 the simulator against published fleets
    ranking      experiments/sim/ranking.py             P(each strategy first), Latin hypercube
    figures      python -m paper_figures                every figure, from the files written above

``reproduce.scale=full`` writes where the shipped results live (experiments/results/,
sim/conf/calibration/cpu_strategies.yaml, paper_figures/out/); ``small`` runs every step at a
tiny size under outputs/reproduce_small/ and leaves the shipped files alone. The figures are
drawn from the results root the steps wrote (``DEADPOOL_RESULTS``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("strategies", "calibrate", "replay", "overhead", "bench3d", "sim_scale", "sim_mtbf", "sim_spares",
         "sensitivity", "correlated", "spare_sizing", "fair", "headline", "validate", "ranking",
         "figures")


def paths(r: dict) -> dict:
    if r["scale"] not in ("full", "small"):
        raise ValueError(f"reproduce.scale must be full or small, got {r['scale']!r}")
    out = r.get("out") or (None if r["scale"] == "full" else "outputs/reproduce_small")
    if out is None:
        return {"results": ROOT / "experiments/results", "figures": ROOT / "paper_figures/out",
                "calibration": ROOT / "sim/conf/calibration/cpu_strategies.yaml",
                "sweeps": ROOT / "multirun/reproduce"}
    o = ROOT / out
    return {"results": o / "results", "figures": o / "figures", "calibration": o / "cpu_strategies.yaml",
            "sweeps": o / "multirun"}


def commands(r: dict, p: dict) -> dict[str, list[list[str]]]:
    py, a = sys.executable, r[r["scale"]]
    res = p["results"]
    strat = res / "runtime/strategies"
    sim_common = [f"seeds={a['sim_seeds']}", f"duration_days={a['sim_days']}", "hydra/launcher=sim_joblib",
                  "progress=false"]

    def sweep(name):
        d = p["sweeps"] / name
        return [[py, "-m", "sim.run", f"experiment=sim_{name}", f"hydra.sweep.dir={d}", *sim_common],
                [py, "-m", "sim.collect", str(d), "--out", str(res / "sim" / name)]]

    return {
        "strategies": [[py, "experiments/compare_strategies.py", "--out", str(strat), *a["strategies"]]],
        "calibrate": [[py, "-m", "sim.calibrate", str(strat), "--name", "cpu_strategies", "--out", str(p["calibration"])]],
        "replay": [[py, "-m", "sim.replay", str(strat), "--calibration", str(p["calibration"]),
                    "--out", str(strat / "replay.csv")]],
        "overhead": [[py, "experiments/bench_overhead.py", "--out", str(res / "runtime/overhead"), *a["overhead"]]],
        "bench3d": [[py, "experiments/bench_3d.py", "--out", str(res / "runtime/bench3d"), *a["bench3d"]]],
        "sim_scale": sweep("scale"), "sim_mtbf": sweep("mtbf"), "sim_spares": sweep("spares"),
        "sensitivity": [[py, "experiments/sim/sensitivity.py", "--out", str(res / "sim/sensitivity"), *a["sensitivity"]]],
        "correlated": [[py, "experiments/sim/correlated.py", "--out", str(res / "sim/correlated"), *a["correlated"]]],
        "spare_sizing": [[py, "experiments/sim/spare_sizing.py", "--out", str(res / "sim/spare_sizing")]],
        "fair": [[py, "experiments/sim/fair.py", "--out", str(res / "sim/fair"), *a["fair"]]],
        "headline": [[py, "experiments/sim/headline.py", "--out", str(res / "sim/headline"), *a["headline"]]],
        "validate": [[py, "-m", "sim.validate", "--out", str(res / "sim/validation"), *a["validate"]]],
        "ranking": [[py, "experiments/sim/ranking.py", "--out", str(res / "sim/ranking"), *a["ranking"]]],
        "figures": [[py, "-m", "paper_figures", "--out", str(p["figures"])]],
    }


@hydra.main(version_base="1.3", config_path="../conf", config_name="reproduce")
def main(cfg: DictConfig) -> None:
    r = OmegaConf.to_container(cfg.reproduce, resolve=True)
    p = paths(r)
    only = list(r.get("only") or STEPS)
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        raise SystemExit(f"reproduce.only: unknown step(s) {unknown}; steps: {', '.join(STEPS)}")
    cmds = commands(r, p)
    env = {**os.environ, "DEADPOOL_RESULTS": str(p["results"]), "PYTHONPATH": str(ROOT)}
    t_all = time.time()
    for i, step in enumerate(s for s in STEPS if s in only):
        t0 = time.time()
        print(f"[reproduce] {i + 1}/{len(only)} {step} ...", flush=True)
        for c in cmds[step]:
            rc = subprocess.run(c, cwd=ROOT, env=env).returncode
            if rc:
                raise SystemExit(f"[reproduce] step {step} failed (exit {rc}): {' '.join(c)}")
        print(f"[reproduce] {step} done in {time.time() - t0:.0f} s", flush=True)
    print(f"[reproduce] scale={r['scale']}: {len(only)} steps in {time.time() - t_all:.0f} s; "
          f"results {p['results']}, figures {p['figures']}")


if __name__ == "__main__":
    main()
