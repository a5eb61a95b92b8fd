"""Figure 14: the real InfiniteHBD half-trace replayed against every strategy.

Reads experiments/results/sim/replay_infinitehbd/{timeline.csv,servers.csv,aggregate.csv}
(``python -m sim.replay_trace``). (a) the servers of the allocation (368 job slots, 32 spares at
t = 0) and when each was unavailable (the trace's fault start to fault end); (b) the job's lost
time against wall time per strategy (wall time minus kept progress, seed 0's placement); (c) ETTR
per strategy over the placements.
    python paper_figures/fig14_trace_replay.py [--input DIR] [--out DIR]
"""

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import style


def main():
    a = style.args("sim/replay_infinitehbd", __doc__.splitlines()[0])
    d = Path(a.input)
    if not (d / "timeline.csv").exists():
        print(f"skip: no {d / 'timeline.csv'} (run python -m sim.replay_trace first)")
        return
    tl, srv, agg = pd.read_csv(d / "timeline.csv"), pd.read_csv(d / "servers.csv"), pd.read_csv(d / "aggregate.csv")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [1.1, 1.3, 0.9]})
    ax = axes[0]
    for r in srv.itertuples():
        ax.plot([r.start_d, r.end_d], [r.slot, r.slot], lw=1.6, color="#d62728" if r.role == "job" else "#1f77b4")
    ax.axhline(367.5, color="k", lw=0.6, ls="--")
    ax.set_xlabel("day")
    ax.set_ylabel("slot (0-367 job, 368-399 spares at t = 0)")
    ax.set_title("(a) servers unavailable (trace)")
    ax = axes[1]
    for s in reversed(style.ordered(tl.strategy.unique())):  # DeadPool drawn last, on top
        t = tl[tl.strategy == s].sort_values("time_d")
        ax.step(t.time_d, (t.time_d - t.progress_d) * 24, where="post", color=style.colour(s), label=style.label(s),
                lw=2.0 if s == "deadpool" else 1.2, ls="--" if s == "deadpool" else "-")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlabel("day")
    ax.set_ylabel("lost time so far (h)")
    ax.set_title("(b) job timeline: wall time - kept progress")
    ax.legend(fontsize=7)
    ax = axes[2]
    order = style.ordered(agg.strategy.unique())
    g = agg.set_index("strategy").reindex(order)
    y = np.arange(len(order))
    ax.barh(y, g.goodput_mean, xerr=(g.goodput_ci95_hi - g.goodput_mean) if "goodput_ci95_hi" in g else None,
            color=[style.colour(s) for s in order])
    ax.set_yticks(y, [style.label(s) for s in order], fontsize=7)
    ax.set_xlim(max(0.0, float(g.goodput_mean.min()) - 0.02), 1.0)
    ax.set_xlabel("ETTR")
    ax.set_title("(c) ETTR, days 0-174")
    style.save(fig, a.out, "fig14_trace_replay")


if __name__ == "__main__":
    main()
