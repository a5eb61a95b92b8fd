"""Figure 5: measured recovery time breakdown of the runtime (hot swap), per run.

Reads every ``summary.json`` below experiments/results/runtime/ (the runtime's run directories) and draws
the median detection / plan / rebuild / transfer / rollback / first-step time of the run's hot-swapped
recoveries (relaunches, shrinks and interrupted recoveries are left out: Fig. 10 and Fig. 12 show
those), one horizontal bar per run, labelled by what the run was (benchmark, scenario, strategy),
world size and fault. The axis ends past the ordinary runs: a run far slower than the rest (a hang
detected by its timeout) is cut at the axis end with its total written, instead of squashing every
other bar. Skips with a message when there are none.
    python paper_figures/fig05_runtime_recovery.py [--input DIR] [--out DIR]
"""

import json
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import style

PHASES = ("detect_s", "plan_s", "rebuild_s", "transfer_s", "rollback_s", "first_step_s")
COLOURS = ("#ff7f0e", "#bcbd22", "#8c564b", "#1f77b4", "#d62728", "#7f7f7f")
SOURCES = {"strategies": "strategy runs", "bench3d": "3D bench", "bench": "bench",
           "elastic_in_place": "elastic in place"}
OUTLIER = 4.0  # a run slower than this many times the median run is cut at the axis end


def label(name: str, summary: dict, recs: list) -> str:
    """A run's label from its directory (``strategies/kills/rep1/deadpool`` -> "strategy runs:
    kills, repeat 1, deadpool"), its world size and fault: no raw paths."""
    parts = name.split("/")
    words = [p.replace("rep", "repeat ", 1) if p[:3] == "rep" and p[3:].isdigit() else p.replace("_", " ")
             for p in parts[1:]]
    head = SOURCES.get(parts[0], parts[0].replace("_", " "))
    what = f"{head}: {', '.join(words)}" if words else head
    return f"{what} ({summary.get('world_size')} ranks, {recs[0].get('fault', '')})"


def axis_end(totals) -> float:
    """The x-axis end: past every run within ``OUTLIER`` x the median run."""
    med = statistics.median(totals)
    ordinary = [t for t in totals if t <= OUTLIER * med] or totals
    return 1.15 * max(ordinary)


def main():
    a = style.args("runtime", __doc__.splitlines()[0])
    files = sorted(Path(a.input).rglob("summary.json")) if Path(a.input).exists() else []
    runs = []
    for f in files:
        try:
            s = json.loads(f.read_text())
        except json.JSONDecodeError:
            print(f"skip {f}: not JSON")
            continue
        recs = [r for r in s.get("recoveries") or [] if r.get("outcome", "hot-swapped") == "hot-swapped"]
        if recs:
            name = f.parent.relative_to(a.input).as_posix() if f.parent != Path(a.input) else f.parent.name
            runs.append((name, s, recs))
    if not runs:
        print(f"skip: no runtime summary.json with recoveries below {a.input}")
        return
    runs.sort(key=lambda r: (r[1].get("world_size", 0), r[0]), reverse=True)  # top: smallest
    y = np.arange(len(runs))
    fig, ax = plt.subplots(figsize=(7.5, 1.6 + 0.21 * len(runs)))
    left = np.zeros(len(runs))
    for phase, c in zip(PHASES, COLOURS):
        vals = np.array([statistics.median(float(x.get(phase) or 0.0) for x in recs) for _, _, recs in runs])
        ax.barh(y, vals, left=left, color=c, height=0.6, label=phase.removesuffix("_s").replace("_", " "))
        left += vals
    totals = [statistics.median(float(x.get("kill_to_first_step_s") or 0.0) for x in recs) for _, _, recs in runs]
    ax.plot(totals, y, "k|", ms=9, mew=2, label="kill to first step (measured)")
    end = axis_end([max(t, b) for t, b in zip(totals, left)])
    ax.set_xlim(0, end)
    for yi, t, b in zip(y, totals, left):
        if max(t, b) > end:
            ax.text(end * 0.99, yi, f"{max(t, b):.2f} s, cut \u25b8", ha="right", va="center", fontsize=7,
                    bbox=dict(facecolor="white", edgecolor="none", pad=1.0))
    ax.set_yticks(y, [label(name, s, recs) for name, s, recs in runs], fontsize=7)
    ax.set_ylim(-0.6, len(runs) - 0.4)
    ax.set_xlabel("seconds (median over the run's recoveries)")
    ax.set_title("Hot-swap recovery breakdown, measured per runtime run\n(CPU, ranks sharing 2 cores)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.7 / (1.6 + 0.21 * len(runs)) - 0.01),
              ncol=4, frameon=False)
    style.save(fig, a.out, "fig05_runtime_recovery")


if __name__ == "__main__":
    main()
