"""Figure 7: correlated (whole-rack) failures, copies on the adjacent node or one rack over.

Reads experiments/results/sim/correlated/aggregate.csv (experiments/sim/correlated.py).
Left: ETTR against the rack failure rate (16,384 GPUs, 2 nodes per rack); solid lines with the
buddy on the adjacent node (same rack), dashed with the buddy one rack over. Right: DeadPool's
fallbacks to disk per run.
    python paper_figures/fig07_correlated.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt

import style


def main():
    a = style.args("sim/correlated", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    for s in style.ordered(df.strategy.unique()):
        for place, ls in (("adjacent", "-"), ("cross_rack", "--")):
            d = df[(df.strategy == s) & (df.placement == place)].sort_values("rack_rate")
            if place == "cross_rack" and s in ("checkpoint_restart", "elastic"):
                continue  # no buddy: placement does not apply
            if place == "adjacent":
                style.errorbar(ax, d.rack_rate, d, "goodput", s)
            else:
                ax.plot(d.rack_rate, d.goodput_mean, ls=ls, marker=style.marker(s), ms=4, color=style.colour(s))
    ax.set_xlabel("rack failures per 1,000 rack-days (each takes 2 nodes)")
    ax.set_ylabel("ETTR (job goodput)")
    ax.legend(fontsize=7.5, title="solid: buddy adjacent (same rack); dashed: one rack over", title_fontsize=7.5,
              loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3, frameon=False)
    ax.set_title("ETTR, simulated at 16,384 GPUs (mean, 95% CI)")
    for place, ls in (("adjacent", "-"), ("cross_rack", "--")):
        d = df[(df.strategy == "deadpool") & (df.placement == place)].sort_values("rack_rate")
        ax2.plot(d.rack_rate, d.fallbacks_mean, ls=ls, marker="o", color=style.colour("deadpool"), label={"adjacent": "adjacent node", "cross_rack": "one rack over"}.get(place, place))
    ax2.set_xlabel("rack failures per 1,000 rack-days")
    ax2.set_ylabel("DeadPool disk fallbacks per run")
    ax2.legend(fontsize=8, title="DeadPool's buddy", title_fontsize=8)
    ax2.set_title("DeadPool: fallbacks to a disk checkpoint")
    style.save(fig, a.out, "fig07_correlated")


if __name__ == "__main__":
    main()
