"""Figure 15: the generator fitted on the InfiniteHBD half-trace against the data, with its tests.

Reads experiments/results/sim/validation/{fit_curves.csv,fit_days_0_174.json} (``python -m
sim.fit_trace``) and prediction_days_174_348.json (``python -m sim.predict_trace``). (a) time
between a server's faults: data vs exponential and Weibull (KS p in the legend); (b) repair
time: data vs lognormal and Weibull; (c) faults per server: data vs Poisson and negative
binomial; (d) faults per day, with the in-sample rate and the predicted rate for days 174-348.
    python paper_figures/fig15_trace_fit.py [--input DIR] [--out DIR]
"""

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import style


def main():
    a = style.args("sim/validation", __doc__.splitlines()[0])
    d = Path(a.input)
    if not (d / "fit_curves.csv").exists():
        print(f"skip: no {d / 'fit_curves.csv'} (run python -m sim.fit_trace first)")
        return
    c = pd.read_csv(d / "fit_curves.csv")
    rep = json.loads((d / "fit_days_0_174.json").read_text())
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    colours = {"data": "k", "exponential": "#1f77b4", "weibull": "#d62728", "lognormal": "#2ca02c",
               "poisson": "#1f77b4", "negative binomial": "#d62728"}
    for ax, panel, key, title in ((axes[0], "tbf", "time_between_failures_d", "(a) time between a server's faults"),
                                  (axes[1], "repair", "repair_d", "(b) repair time")):
        for s, g in c[c.panel == panel].groupby("series"):
            lab = s if s == "data" else f"{s} (KS p {rep[key][s]['ks_p']:.2g})"
            if s == "data":
                ax.step(g.x, g.y, where="post", color="k", lw=1.4, label=f"data (n={rep[key]['n']})")
            else:
                ax.plot(g.x, g.y, color=colours[s], lw=1.2, label=lab)
        ax.set_xscale("log")
        ax.set_xlabel("days")
        ax.set_ylabel("CDF")
        ax.set_title(title)
        ax.legend(fontsize=7)
    ax = axes[2]
    g = c[c.panel == "counts"]
    for s, w in (("data", -0.27), ("poisson", 0.0), ("negative binomial", 0.27)):
        h = g[g.series == s]
        ax.bar(h.x + w, h.y, 0.27, color=colours[s], label=s)
    pc = rep["per_server_counts"]
    ax.set_yscale("log")
    ax.set_xlabel("faults per server, days 0-174")
    ax.set_ylabel("servers")
    ax.set_title(f"(c) over-dispersion: NB shape {pc['nb_shape']:.2f}, LR p {pc['lr_p']:.1g}")
    ax.legend(fontsize=7)
    ax = axes[3]
    g = c[(c.panel == "daily")]
    ax.bar(g.x, g.y, 1.0, color="#7f7f7f", label="data (faults per day)")
    rate = rep["fault_starts"] / 174.0
    ax.axhline(rate, color="k", lw=1, label=f"days 0-174: {rate:.2f}/day")
    p = d / "prediction_days_174_348.json"
    if p.exists():
        pr = json.loads(p.read_text())["fault_starts"]
        ax.fill_between([174, 348], pr["lo"] / 174, pr["hi"] / 174, color="#d62728", alpha=0.25, label="predicted 90 %")
        ax.plot([174, 348], [pr["mean"] / 174] * 2, color="#d62728", lw=1.2)
    ax.set_xlim(0, 348)
    ax.set_xlabel("day")
    tr = rep["trend"]
    ax.set_title(f"(d) trend: Laplace z {tr['laplace_z']:.1f}; dispersion {rep['bursts']['daily_dispersion_index']:.1f}")
    ax.legend(fontsize=7)
    style.save(fig, a.out, "fig15_trace_fit")


if __name__ == "__main__":
    main()
