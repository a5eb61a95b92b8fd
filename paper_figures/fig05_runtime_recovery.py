"""Figure 5: measured recovery time breakdown of the runtime (hot swap), per run.

Reads every ``summary.json`` below experiments/results/runtime/ (the runtime's run directories) and draws
the median detection / plan / rebuild / transfer / rollback / first-step time per run,
labelled by world size and fault. Skips with a message when there are no runtime results.
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
        recs = s.get("recoveries") or []
        if recs:
            runs.append((f.parent.name, s, recs))
    if not runs:
        print(f"skip: no runtime summary.json with recoveries below {a.input}")
        return
    runs.sort(key=lambda r: r[1].get("world_size", 0))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(runs) + 2.5), 3.8))
    bottom = np.zeros(len(runs))
    for phase, c in zip(PHASES, COLOURS):
        vals = np.array([statistics.median(float(x.get(phase) or 0.0) for x in recs) for _, _, recs in runs])
        ax.bar(range(len(runs)), vals, bottom=bottom, color=c, width=0.5,
               label=phase.removesuffix("_s").replace("_", " "))
        bottom += vals
    totals = [statistics.median(float(x.get("kill_to_first_step_s") or 0.0) for x in recs) for _, _, recs in runs]
    ax.plot(range(len(runs)), totals, "k_", ms=24, mew=2, label="kill to first step (measured)")
    ax.set_xticks(range(len(runs)), [f"{s.get('world_size')} ranks\n{recs[0].get('fault', '')}\n{name}"
                                      for name, s, recs in runs], fontsize=7)
    ax.set_ylabel("seconds (median over recoveries)")
    ax.set_title("Hot-swap recovery breakdown (runtime)")
    ax.set_xlim(-0.75, len(runs) - 0.25)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    style.save(fig, a.out, "fig05_runtime_recovery")


if __name__ == "__main__":
    main()
