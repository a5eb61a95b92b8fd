"""Figure 13: how likely each ranking is, every assumed parameter sampled jointly (Latin hypercube).

Reads experiments/results/sim/ranking/{p_first.csv,samples.csv} (experiments/sim/ranking.py).
(a), (b): P(strategy ranks first) in ETTR and in fleet goodput at 16,384 and 131,072 GPUs, with
95 % Wilson intervals over the samples; (c): DeadPool's margin over the best other strategy
across the samples (violins; below zero DeadPool is not first).
    python paper_figures/fig13_ranking.py [--input DIR] [--out DIR]
"""

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import style


def main():
    a = style.args("sim/ranking", __doc__.splitlines()[0])
    pf_path, s_path = Path(a.input) / "p_first.csv", Path(a.input) / "samples.csv"
    if not pf_path.exists() or not s_path.exists():
        print(f"skip: no {pf_path} or {s_path} (run experiments/sim/ranking.py first)")
        return
    pf, samples = pd.read_csv(pf_path), pd.read_csv(s_path)
    scales = sorted(pf.num_gpus.unique())
    strategies = style.ordered(pf.strategy.unique())
    n = int(pf.n_samples.max())
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    width = 0.8 / len(strategies)
    for ax, metric, title in ((axes[0], "goodput", "(a) P(ranks first): ETTR"),
                              (axes[1], "fleet_goodput", "(b) P(ranks first): fleet goodput")):
        for i, s in enumerate(strategies):
            d = pf[(pf.metric == metric) & (pf.strategy == s)].set_index("num_gpus").reindex(scales)
            x = np.arange(len(scales)) + (i - (len(strategies) - 1) / 2) * width
            err = [(d.p_first - d.ci95_lo).clip(lower=0), (d.ci95_hi - d.p_first).clip(lower=0)]  # rounding at p = 0, 1
            ax.bar(x, d.p_first, width, color=style.colour(s), label=style.label(s), yerr=err, capsize=2,
                   error_kw={"lw": 0.8})
        ax.set_xticks(np.arange(len(scales)), [f"{g:,} GPUs" for g in scales])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("probability")
        ax.set_title(title)
    axes[0].legend(loc="upper left", fontsize=7)
    ax = axes[2]
    data, labels = [], []
    for g in scales:
        for metric, short in (("goodput", "ETTR"), ("fleet_goodput", "fleet")):
            w = samples[(samples.num_gpus == g) & samples.feasible].pivot_table(index="sample", columns="strategy",
                                                                               values=metric)
            if "deadpool" not in w.columns:
                continue
            m = (w["deadpool"] - w.drop(columns="deadpool").max(axis=1)) * 100
            data.append(m.to_numpy())
            labels.append(f"{g / 1000:.0f}k\n{short}\nP>0 {np.mean(m > 0):.2f}")
    if data:
        parts = ax.violinplot(data, showmedians=True)
        for b in parts["bodies"]:
            b.set_facecolor(style.colour("deadpool"))
            b.set_alpha(0.35)
        ax.set_xticks(np.arange(1, len(data) + 1), labels, fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_ylabel("DeadPool minus best other, points")
    ax.set_title("(c) DeadPool's margin over the samples")
    fig.suptitle(f"Every assumed parameter sampled jointly ({n} Latin-hypercube samples, one trace each, "
                 "same samples at both scales)", fontsize=10)
    style.footnote(fig, "Parameters and ranges: experiments/sim/ranking.yaml. Replication's redundancy has no published "
                        "measurement and is sampled over 0-0.33; a strategy whose memory does not fit a sample is left "
                        "out of that sample's ranking.")
    style.save(fig, a.out, "fig13_ranking")


if __name__ == "__main__":
    main()
