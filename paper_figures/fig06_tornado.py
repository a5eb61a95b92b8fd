"""Figure 6: sensitivity (tornado): each parameter moved alone over its range, 16,384 GPUs.

Reads experiments/results/sim/sensitivity/aggregate.csv (experiments/sim/sensitivity.py). One
panel per strategy: ETTR change from the defaults at the low (light) and high (dark) end of each
parameter. Last panel: DeadPool's ETTR minus the best other strategy's at each end; a bar that
ends below zero (red) is where DeadPool stops winning.
    python paper_figures/fig06_tornado.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt
import numpy as np

import style


def main():
    a = style.args("sim/sensitivity", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    strategies = style.ordered(df.strategy.unique())
    base = df[df.param == "base"].set_index("strategy").goodput_mean
    ends = df[df.param != "base"]
    g = ends.pivot_table(index=["param", "level"], columns="strategy", values="goodput_mean", sort=False)
    params = list(dict.fromkeys(ends.param))
    dp = "deadpool"
    # sort by DeadPool's swing, largest on top
    swing = {p: abs(g.loc[(p, "high"), dp] - g.loc[(p, "low"), dp]) for p in params}
    params.sort(key=lambda p: swing[p])
    labels = {p: ends[(ends.param == p)].set_index("level").value.to_dict() for p in params}
    y = np.arange(len(params))
    fig, axes = plt.subplots(1, len(strategies) + 1, figsize=(2.6 * (len(strategies) + 1), 0.36 * len(params) + 1.8),
                             sharey=True)
    for ax, s in zip(axes, strategies):
        for lvl, alpha in (("low", 0.45), ("high", 1.0)):
            d = np.array([g.loc[(p, lvl), s] - base[s] for p in params]) * 100
            ax.barh(y, d, color=style.colour(s), alpha=alpha, height=0.7, label=f"{lvl} end")
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{style.label(s)}\nETTR {base[s]:.3f}", fontsize=9)
        ax.set_xlabel("ETTR change, points")
    axes[0].set_yticks(y, [f"{p}\n({labels[p]['low']} | {labels[p]['high']})" for p in params], fontsize=7.5)
    axes[0].legend(loc="lower left", fontsize=7)
    ax = axes[-1]
    others = [s for s in strategies if s != dp]
    base_margin = (base[dp] - base[others].max()) * 100
    for lvl, alpha, off in (("low", 0.45, -0.18), ("high", 1.0, 0.18)):
        m = np.array([(g.loc[(p, lvl), dp] - g.loc[(p, lvl), others].max()) * 100 for p in params])
        ax.barh(y + off, m, height=0.36, alpha=alpha, color=np.where(m < 0, "#d62728", "#2ca02c"))
    ax.axvline(0, color="k", lw=0.8)
    ax.axvline(base_margin, color="k", lw=0.8, ls="--")
    ax.set_title(f"DeadPool minus best other\n(defaults {base_margin:+.2f} points)", fontsize=9)
    ax.set_xlabel("ETTR margin, points (red: not best)")
    fig.suptitle("Simulated sensitivity at 16,384 GPUs: ETTR change when one parameter moves to the low or high end "
                 "of its range", fontsize=10)
    style.save(fig, a.out, "fig06_tornado")


if __name__ == "__main__":
    main()
