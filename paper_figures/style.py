"""Shared figure style: strategy colours and labels, sizes, loading result files, saving.

Figures read only result files (``experiments/results/...`` CSV/JSON written by runs and sweeps) and this
module; nothing here runs a simulation.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the result files every figure reads: the shipped ones, or those ``make reproduce`` wrote
RESULTS = Path(os.environ.get("DEADPOOL_RESULTS") or ROOT / "experiments" / "results")
OUT = Path(__file__).resolve().parent / "out"

STRATEGIES = {  # name -> (label, colour, marker)
    "deadpool": ("DeadPool (hot swap)", "#d62728", "o"),
    "deadpool_shrink": ("DeadPool, shrink when no spare", "#ff7f0e", "D"),
    "inmem_restart": ("In-memory ckpt + restart", "#8c564b", "P"),
    "checkpoint_restart": ("Checkpoint/restart", "#1f77b4", "s"),
    "replication": ("Replication", "#2ca02c", "^"),
    "elastic": ("Elastic", "#9467bd", "v"),
    "elastic_hsdp": ("Elastic, replicated optimizer", "#bcbd22", "<"),
    "elastic_spares": ("Elastic + spares, delta rebuild", "#17becf", ">"),
    "injob_restart": ("In-job restart (NVRx)", "#393b79", "*"),
    "trainmover": ("TrainMover-like", "#637939", "p"),
    # runtime-only strategies (experiments/compare_strategies.py)
    "sync_snapshot": ("DeadPool, synchronous snapshots", "#e377c2", "h"),
    "none": ("No fault tolerance", "#7f7f7f", "X"),
}
BUCKET_COLOURS = {
    "ckpt_stall": "#1f77b4", "lost": "#d62728", "detection": "#ff7f0e", "reconfiguration": "#8c564b",
    "restart": "#7f7f7f", "wait_spare": "#e377c2", "degraded": "#9467bd", "redundant": "#2ca02c",
    "snapshot": "#17becf",
}

plt.rcParams.update({
    "figure.dpi": 120, "savefig.dpi": 200, "font.size": 10, "axes.titlesize": 11,
    "axes.labelsize": 10, "legend.fontsize": 8.5, "axes.grid": True, "grid.alpha": 0.3,
    "axes.spines.top": False, "axes.spines.right": False,
})


def label(strategy: str) -> str:
    return STRATEGIES.get(strategy, (strategy,))[0]


def colour(strategy: str) -> str:
    return STRATEGIES.get(strategy, (None, "#333333"))[1]


def marker(strategy: str) -> str:
    return STRATEGIES.get(strategy, (None, None, "x"))[2]


def ordered(strategies) -> list[str]:
    known = [s for s in STRATEGIES if s in set(strategies)]
    return known + sorted(set(strategies) - set(known))


def args(default_input: str, description: str) -> argparse.Namespace:
    """Common CLI: ``--input`` (result directory, default under experiments/results/) and ``--out``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--input", default=str(RESULTS / default_input), help="result directory to read")
    ap.add_argument("--out", default=str(OUT), help="where to write PNG and PDF")
    return ap.parse_args()


def calibration_file(name: str) -> Path:
    """``sim/conf/calibration/<name>.yaml``, or the one ``make reproduce`` wrote next to the results
    root it points ``$DEADPOOL_RESULTS`` at (``<root>/../<name>.yaml``) when there is one."""
    if os.environ.get("DEADPOOL_RESULTS"):
        p = RESULTS.parent / f"{name}.yaml"
        if p.exists():
            return p
    return ROOT / "sim" / "conf" / "calibration" / f"{name}.yaml"


def gpu_summary(results: str | Path = RESULTS) -> Path | None:
    """Newest ``gpu/<date>-<gpu>/summary.json`` under ``results``; when ``results`` is the default root
    (``$DEADPOOL_RESULTS`` of ``make reproduce``, which does not rerun the GPU checks), else the
    shipped one; None when there is none."""
    roots = [Path(results)]
    if Path(results) == RESULTS:
        roots.append(ROOT / "experiments" / "results")
    for root in roots:
        found = sorted(root.glob("gpu/*/summary.json"))
        if found:
            return found[-1]
    return None


def spread_labels(ax, anns, iterations: int = 200, pad: float = 2.0) -> None:
    """Move annotations (``ax.annotate(..., textcoords="offset points")``) vertically apart until
    their boxes no longer overlap each other; labels keep their horizontal place."""
    fig = ax.figure
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    scale = fig.dpi / 72.0  # display pixels per point
    boxes = [a.get_window_extent(r) for a in anns]
    for _ in range(iterations):
        moved = False
        for i in range(len(anns)):
            for j in range(i + 1, len(anns)):
                bi, bj = boxes[i], boxes[j]
                if bi.x1 + pad < bj.x0 or bj.x1 + pad < bi.x0 or bi.y1 + pad < bj.y0 or bj.y1 + pad < bi.y0:
                    continue
                up, down = (i, j) if (bi.y0 + bi.y1) >= (bj.y0 + bj.y1) else (j, i)
                push = (min(bi.y1, bj.y1) - max(bi.y0, bj.y0) + pad) / 2 + 0.5  # display pixels
                for k, sign in ((up, 1), (down, -1)):
                    x, y = anns[k].xyann
                    anns[k].xyann = (x, y + sign * push / scale)
                    boxes[k] = boxes[k].translated(0, sign * push)
                moved = True
        if not moved:
            return


def footnote(fig, text: str, y: float = -0.01) -> None:
    """Small print under the axes (kept in the saved file by ``bbox_inches="tight"``), each line
    wrapped to the figure's width."""
    import textwrap

    width = max(40, int(fig.get_figwidth() * 17.5))  # characters of 7.5 pt per line
    lines = [w for line in text.splitlines() for w in (textwrap.wrap(line, width) or [""])]
    fig.text(0.01, y, "\n".join(lines), ha="left", va="top", fontsize=7.5, color="#444444")


def load_aggregate(directory: str | Path) -> pd.DataFrame | None:
    p = Path(directory) / "aggregate.csv"
    if not p.exists():
        print(f"skip: no {p} (run the sweep first: experiments/sim/run_local.sh <sweep>)")
        return None
    return pd.read_csv(p)


def save(fig, out_dir: str | Path, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(out / f"{name}.{ext}", bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out / name}.png/.pdf")
    return out / f"{name}.png"


def errorbar(ax, x, df, metric, strategy, **kw):
    """Mean with its 95% CI as error bars."""
    y = df[f"{metric}_mean"]
    err = [y - df[f"{metric}_ci95_lo"], df[f"{metric}_ci95_hi"] - y]
    ax.errorbar(x, y, yerr=err, label=label(strategy), color=colour(strategy), marker=marker(strategy),
                capsize=2, lw=1.5, ms=5, **kw)
