"""Figure 8: spares needed for a target probability that a failure finds the pool empty.

Reads experiments/results/sim/spare_sizing/spares.csv (experiments/sim/spare_sizing.py; closed
form of sim.spares, llama3 failure and maintenance rates). Spares as % of active nodes against
the number of nodes, per repair preset, for targets 1% and 0.1%.
    python paper_figures/fig08_spare_sizing.py [--input DIR] [--out DIR]
"""

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

import style

COLOURS = {"fast": "#2ca02c", "default": "#1f77b4", "rma_tail": "#d62728"}
LABELS = {"fast": "fast repairs (0.5 h / 1 h)", "default": "repairs 1 h median / 3 h mean",
          "rma_tail": "30% hardware RMA (24 h median)"}


def main():
    a = style.args("sim/spare_sizing", __doc__.splitlines()[0])
    p = Path(a.input) / "spares.csv"
    if not p.exists():
        print(f"skip: no {p} (run experiments/sim/spare_sizing.py first)")
        return
    df = pd.read_csv(p)
    fig, ax = plt.subplots(figsize=(6, 4))
    for repair, g in df.groupby("repair", sort=False):
        for target, ls in ((0.01, "-"), (0.001, "--")):
            d = g[g.target == target].sort_values("num_nodes")
            ax.plot(d.num_nodes, 100 * d.spare_frac, ls=ls, marker="o", ms=3.5, color=COLOURS.get(repair),
                    label=f"{LABELS.get(repair, repair)}, P<={target:g}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    nodes = sorted(df.num_nodes.unique())
    ax.set_xticks(nodes, [f"{n:,}" for n in nodes], fontsize=8)
    ax.minorticks_off()
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g} %"))
    ax.set_xlabel("active nodes")
    ax.set_ylabel("spares, % of active nodes")
    ax.axhline(1.0, color="k", lw=0.7, ls=":")
    ax.set_title("Spares for a failure to find the pool empty with probability <= P\n"
                 "(closed form, sim.spares; llama3 failure and maintenance rates)", fontsize=10)
    ax.legend(fontsize=7)
    style.save(fig, a.out, "fig08_spare_sizing")


if __name__ == "__main__":
    main()
