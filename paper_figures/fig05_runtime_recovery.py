"""Figure 5: measured recovery time breakdown of the runtime (hot swap), per run.

Reads every ``summary.json`` below experiments/results/runtime/ (the runtime's run directories) and draws
the median detection / plan / rebuild / transfer / rollback / first-step time of the run's hot-swapped
recoveries (relaunches, shrinks and interrupted recoveries are left out: Fig. 10 and Fig. 12 show
those), labelled by run directory, world size and fault. Skips with a message when there are none.
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
    runs.sort(key=lambda r: (r[1].get("world_size", 0), r[0]))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.62 * len(runs) + 2.5), 4.2))
    bottom = np.zeros(len(runs))
    for phase, c in zip(PHASES, COLOURS):
        vals = np.array([statistics.median(float(x.get(phase) or 0.0) for x in recs) for _, _, recs in runs])
        ax.bar(range(len(runs)), vals, bottom=bottom, color=c, width=0.5,
               label=phase.removesuffix("_s").replace("_", " "))
        bottom += vals
    totals = [statistics.median(float(x.get("kill_to_first_step_s") or 0.0) for x in recs) for _, _, recs in runs]
    ax.plot(range(len(runs)), totals, "k_", ms=24, mew=2, label="kill to first step (measured)")
    ax.set_xticks(range(len(runs)), [f"{name} ({s.get('world_size')} ranks, {recs[0].get('fault', '')})"
                                      for name, s, recs in runs], fontsize=7, rotation=35, ha="right",
                  rotation_mode="anchor")
    ax.set_ylabel("seconds (median over recoveries)")
    ax.set_title("Hot-swap recovery breakdown, measured: every runtime run directory (CPU, ranks sharing 2 cores)")
    ax.set_xlim(-0.75, len(runs) - 0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, markerscale=0.5)
    style.save(fig, a.out, "fig05_runtime_recovery")


if __name__ == "__main__":
    main()
