"""Figure 3: goodput vs failure rate at 16,384 GPUs (where spare pools run dry).

Reads experiments/results/sim/mtbf/aggregate.csv (experiments/sim/run_local.sh mtbf).
    python paper_figures/fig03_goodput_vs_mtbf.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt

import style

PRESETS = {2.34: "rsc2", 3.79: "llama3", 6.5: "rsc1", 14.0: "opt175b"}


def main():
    a = style.args("sim/mtbf", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    key = "unexpected_per_1000_node_days"
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.8), sharey=True)
    for ax, metric, title in zip(axes, ("goodput", "fleet_goodput"), ("Job goodput (ETTR)", "Fleet goodput")):
        for s in style.ordered(df.strategy.unique()):
            d = df[df.strategy == s].sort_values(key)
            style.errorbar(ax, d[key], d, metric, s)
        ax.set_xscale("log")
        ax.set_xlabel("unexpected failures per 1,000 node-days")
        ax.set_title(title)
        for rate, name in PRESETS.items():
            ax.axvline(rate, color="#bbbbbb", lw=0.8, ls=":")
            ax.text(rate, 0.02, name, rotation=90, fontsize=7, color="#777777", va="bottom", ha="right",
                    transform=ax.get_xaxis_transform())
    axes[0].set_ylabel("goodput")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(labels), frameon=False)
    n = int(df.num_gpus.iloc[0])
    fig.suptitle(f"Simulated (Llama-3-405B-like job on H100 nodes): {n:,} GPUs, {int(df.num_spares.iloc[0])} spare nodes, {df.duration_days.iloc[0]:g} days",
                 fontsize=9, y=1.0)
    style.save(fig, a.out, "fig03_goodput_vs_mtbf")


if __name__ == "__main__":
    main()
