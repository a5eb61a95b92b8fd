"""Figure 4: goodput vs number of spare nodes under a high failure rate.

Reads experiments/results/sim/spares/aggregate.csv (experiments/sim/run_local.sh spares). Job goodput
rewards spares; fleet goodput charges them, so too few and too many both cost DeadPool.
    python paper_figures/fig04_goodput_vs_spares.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt

import style


def main():
    a = style.args("sim/spares", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.8), sharey=True)
    for ax, metric, title in zip(axes, ("goodput", "fleet_goodput"), ("Job goodput (ETTR)", "Fleet goodput")):
        for s in style.ordered(df.strategy.unique()):
            d = df[df.strategy == s].sort_values("num_spares")
            style.errorbar(ax, d.num_spares + 1, d, metric, s)
        ax.set_xscale("log")
        ticks = sorted(df.num_spares.unique())
        ax.set_xticks([t + 1 for t in ticks], [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("reserved spare nodes")
        ax.set_title(title)
    axes[0].set_ylabel("goodput")
    axes[0].legend(loc="lower right")
    rate = df.unexpected_per_1000_node_days.iloc[0]
    fig.suptitle(f"Simulated (Llama-3-405B-like job on H100 nodes): {int(df.num_gpus.iloc[0]):,} GPUs, {rate:g} unexpected failures per 1,000 node-days, "
                 f"{df.duration_days.iloc[0]:g} days", fontsize=9, y=1.0)
    style.save(fig, a.out, "fig04_goodput_vs_spares")


if __name__ == "__main__":
    main()
