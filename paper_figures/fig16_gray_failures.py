"""Figure 16: gray failures at 16,384 GPUs: stragglers and silent data corruption, detected only or handed to spares.

Reads experiments/results/sim/gray/aggregate.csv (python -m sim.gray, experiments/sim/gray.yaml).
Left: goodput (these events only) against the straggler rate, the job slowed while a straggler
lasts (detect only) or until it is migrated to a spare; the dotted line is the goodput at which
a detect-only job runs 1.34x longer (Falcon's average delay, arXiv 2410.12588). Right: hours of
progress a 54-day job loses to silent data corruption, noticed late and restarted from disk, or
found at the next snapshot by the peers' checksums and swapped (Llama 3's rate in the middle).
    python paper_figures/fig16_gray_failures.py [--input DIR] [--out DIR]
"""

import matplotlib.pyplot as plt

import style

LABELS = {"detect": "detected only", "migrate": "migrated to a spare",
          "checksum": "checksums + spare"}
COLOURS = {"detect": "#7f7f7f", "migrate": "#d62728", "checksum": "#d62728"}


def main():
    a = style.args("sim/gray", __doc__.splitlines()[0])
    df = style.load_aggregate(a.input)
    if df is None:
        return
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    st = df[df.kind == "straggler"]
    for p in ("detect", "migrate"):
        d = st[st.policy == p].sort_values("rate_per_1000_node_days")
        x = d.rate_per_1000_node_days
        ax.plot(x, d.goodput_mean, marker="o", ms=4, color=COLOURS[p], label=LABELS[p])
        ax.fill_between(x, d.goodput_lo, d.goodput_hi, color=COLOURS[p], alpha=0.2)
    ax.axhline(1 / 1.34, ls=":", color="k", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("stragglers per 1,000 node-days (assumption, swept)")
    ax.set_ylabel("goodput (straggler events only)")
    ax.legend(frameon=False)
    sdc = df[df.kind == "sdc"]
    rates = sorted(sdc.rate_per_1000_node_days.unique())
    w = 0.38
    for i, p in enumerate(("detect", "checksum")):
        d = sdc[sdc.policy == p].set_index("rate_per_1000_node_days").loc[rates]
        ax2.bar([j + (i - 0.5) * w for j in range(len(rates))], d.lost_h_mean, w,
                color=COLOURS[p], label=LABELS[p], alpha=0.8 if p == "checksum" else 0.6)
    ax2.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
    ax2.set_xlabel("silent corruptions per 1,000 node-days (Llama 3: 0.0543)")
    ax2.set_ylabel("hours lost per 54-day job")
    ax2.set_yscale("log")
    ax2.legend(frameon=False)
    style.save(fig, a.out, "fig16_gray_failures")


if __name__ == "__main__":
    main()
