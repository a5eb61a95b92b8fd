"""Figure 1: job goodput (ETTR) and fleet goodput vs cluster size, per strategy.

Reads experiments/results/sim/scale/aggregate.csv (experiments/sim/run_local.sh scale).
    python paper_figures/fig01_goodput_vs_scale.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt

import style


def main():
    a = style.args("sim/scale", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.8), sharey=True)
    for ax, metric, title in zip(axes, ("goodput", "fleet_goodput"),
                                 ("Job goodput (ETTR)", "Fleet goodput (spares and redundancy charged)")):
        for s in style.ordered(df.strategy.unique()):
            d = df[df.strategy == s].sort_values("num_gpus")
            style.errorbar(ax, d.num_gpus, d, metric, s)
        ax.set_xscale("log", base=2)
        ticks = sorted(df.num_gpus.unique())
        ax.set_xticks(ticks, [f"{t // 1024}k" for t in ticks])
        ax.set_xlabel("GPUs in the job")
        ax.set_title(title)
    axes[0].set_ylabel("goodput")
    axes[0].legend(loc="lower left")
    days = df.duration_days.iloc[0]
    fig.suptitle(f"Simulated (Llama-3-405B-like job on H100 nodes): llama3 failure rates, {days:g} days, mean and 95% CI over {int(df.n_seeds.min())} seeds",
                 fontsize=9, y=1.0)
    style.save(fig, a.out, "fig01_goodput_vs_scale")


if __name__ == "__main__":
    main()
