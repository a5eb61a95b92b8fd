"""Figure 2: where the time goes: badput by bucket per strategy, at each cluster size.

Reads experiments/results/sim/scale/aggregate.csv. Stacked bars of mean badput as a percentage of wall
time (checkpoint stalls, lost work, detection, reconfiguration, restart, waiting for a spare,
degraded throughput, redundant compute, snapshot overhead).
    python paper_figures/fig02_badput_breakdown.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt
import numpy as np

import style


def main():
    a = style.args("sim/scale", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    scales = sorted(df.num_gpus.unique())
    strategies = style.ordered(df.strategy.unique())
    wall_h = df.duration_days.iloc[0] * 24.0
    fig, axes = plt.subplots(1, len(scales), figsize=(2.3 * len(scales) + 1.5, 4.0), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, n in zip(axes, scales):
        d = df[df.num_gpus == n].set_index("strategy")
        bottom = np.zeros(len(strategies))
        for b, c in style.BUCKET_COLOURS.items():
            col = f"badput_{b}_h_mean"
            vals = np.array([100.0 * d.loc[s, col] / wall_h if s in d.index else 0.0 for s in strategies])
            ax.bar(range(len(strategies)), vals, bottom=bottom, color=c,
                   label=b.replace("_", " ") if n == scales[0] else None, width=0.75)
            bottom += vals
        ax.set_xticks(range(len(strategies)),
                      [style.label(s).split(" (")[0].replace("Checkpoint/restart", "Ckpt/restart") for s in strategies],
                      rotation=45, ha="right")
        ax.set_title(f"{n // 1024}k GPUs")
        ax.grid(axis="x", visible=False)
    axes[0].set_ylabel("badput, % of wall time")
    fig.suptitle("Simulated badput by bucket (Llama-3-405B-like job on H100 nodes, llama3 failure rates, mean over "
                 "seeds)", fontsize=10)
    fig.tight_layout()
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(style.BUCKET_COLOURS), frameon=False)
    style.save(fig, a.out, "fig02_badput_breakdown")


if __name__ == "__main__":
    main()
