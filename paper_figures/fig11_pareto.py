"""Figure 11: failure-free overhead against time lost per failure, every strategy: measured on the
CPU runtime (filled) and simulated at 16,384 GPUs (hollow). Lower left is better.

Reads, under the results root (``--input``):
- runtime/strategies/table.csv (experiments/compare_strategies.py): x = ``ratio_vs_none`` - 1 of the
  failure-free ("free") schedule; y = ``lost_per_failure_s`` of the "kills" schedule (two SIGKILLs,
  the marker) and the "burst" schedule (two ranks in one step, the small marker on the same line):
  the training window's growth over the strategy's own failure-free run, per failure. ft=none
  cannot recover: drawn at the top as "job lost";
- sim/scale/summary.csv (sim.collect of the scale sweep), rows at ``--gpus`` (16,384), mean over
  seeds: x = (snapshot + checkpoint stall + redundant compute) badput / useful time; y = (lost work +
  detection + reconfiguration + restart + waiting for a spare + degraded width) badput / unexpected
  failures (the planned-maintenance swaps' costs included).
    python paper_figures/fig11_pareto.py [--input RESULTS_ROOT] [--out DIR] [--gpus 16384]
"""

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.lines import Line2D

import style

OVERHEAD = ("badput_snapshot_h", "badput_ckpt_stall_h", "badput_redundant_h")
PER_FAILURE = ("badput_lost_h", "badput_detection_h", "badput_reconfiguration_h", "badput_restart_h",
               "badput_wait_spare_h", "badput_degraded_h")
FLOOR = 0.05  # seconds: where a measured loss <= 0 (noise) is drawn


def cli():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=str(style.RESULTS), help="results root")
    ap.add_argument("--out", default=str(style.OUT))
    ap.add_argument("--gpus", type=int, default=16384, help="simulated scenario (num_gpus of the scale sweep)")
    return ap.parse_args()


def measured(table: Path) -> pd.DataFrame:
    t = pd.read_csv(table)
    free = t[t["schedule"] == "free"].set_index("strategy")["ratio_vs_none"].astype(float)
    rows = []
    for s, ratio in free.items():
        r = {"strategy": s, "overhead_pct": (ratio - 1.0) * 100}
        for sched in ("kills", "burst"):
            m = t[(t["schedule"] == sched) & (t["strategy"] == s)]
            if m.empty:
                continue
            m = m.iloc[0]
            r[f"{sched}_outcome"] = m.get("outcome")
            v = m.get("lost_per_failure_s")
            r[f"{sched}_s"] = float(v) if pd.notna(v) else None
            if pd.notna(m.get("lost_min", float("nan"))) and pd.notna(m.get("lost_max", float("nan"))):
                r[f"{sched}_range"] = (float(m["lost_min"]), float(m["lost_max"]))
                r["repeats"] = int(m.get("repeats", 1))
            parts = [m.get(k) for k in ("detect_s", "recover_s", "recompute_s")]
            if all(pd.notna(x) for x in parts) and m.get("failures"):
                r[f"{sched}_breakdown_s"] = sum(float(x) for x in parts) / float(m["failures"])
        rows.append(r)
    return pd.DataFrame(rows)


def simulated(summary: Path, gpus: int) -> pd.DataFrame | None:
    d = pd.read_csv(summary)
    d = d[d["num_gpus"] == gpus]
    if d.empty:
        return None
    cols = [c for c in OVERHEAD + PER_FAILURE if c in d.columns]
    g = d.groupby("strategy")[cols + ["useful_h", "failures"]].mean()
    out = pd.DataFrame({
        "overhead_pct": g[[c for c in OVERHEAD if c in g]].sum(axis=1) / g["useful_h"] * 100,
        "lost_s": g[[c for c in PER_FAILURE if c in g]].sum(axis=1) * 3600 / g["failures"],
    })
    out.attrs["seeds"] = int(d.groupby("strategy").size().max())
    out.attrs["failures"] = float(g["failures"].mean())
    return out.reset_index()


def main():
    a = cli()
    root = Path(a.input)
    table = root / "runtime" / "strategies" / "table.csv"
    summary = root / "sim" / "scale" / "summary.csv"
    meas = measured(table) if table.exists() else None
    sim = simulated(summary, a.gpus) if summary.exists() else None
    if meas is None and sim is None:
        print(f"skip: neither {table} nor {summary} (with num_gpus={a.gpus})")
        return
    if meas is None:
        print(f"skip measured points: no {table}")
    if sim is None:
        print(f"skip simulated points: no rows at {a.gpus} GPUs in {summary}")
    fig, ax = plt.subplots(figsize=(8.2, 5.6))
    ax.set_yscale("log")
    anns, notes = [], []
    marked_breakdown = False
    top_y = 3000.0
    if meas is not None:
        for _, r in meas.iterrows():
            s, x, c = r["strategy"], r["overhead_pct"], style.colour(r["strategy"])
            if r.get("kills_outcome") == "unrecoverable" or (pd.isna(r.get("kills_s")) and s == "none"):
                ax.plot([x], [top_y], marker="^", color=c, ms=9, clip_on=False, zorder=5)
                ax.plot([x, x], [top_y * 0.45, top_y], color=c, lw=1.2, clip_on=False)
                anns.append(ax.annotate("ft=none: job lost at the first failure", (x, top_y), xytext=(8, -3),
                                        textcoords="offset points", fontsize=8, va="center", color="#333333"))
                continue
            ys = {}
            for sched in ("kills", "burst"):
                v = r.get(f"{sched}_s")
                if v is None or pd.isna(v):
                    continue
                if v <= 0:  # the window grew less than the failure-free run's noise: show the runtime's own sum
                    b = r.get(f"{sched}_breakdown_s")
                    ys[sched] = (b if b and b > 0 else FLOOR, True)
                else:
                    ys[sched] = (v, False)
            if not ys:
                continue
            if len(ys) == 2:
                ax.plot([x, x], [ys["kills"][0], ys["burst"][0]], color=c, lw=1.0, alpha=0.7)
            for sched, (y, fallback) in ys.items():
                lo, hi = r.get(f"{sched}_range") if isinstance(r.get(f"{sched}_range"), tuple) else (y, y)
                if not fallback and hi > lo:  # spread over the schedule's repeats
                    ax.plot([x, x], [max(lo, FLOOR), hi], color=c, lw=2.5, alpha=0.35, solid_capstyle="butt")
                ax.plot([x], [y], marker=style.marker(s), color=c, ms=9 if sched == "kills" else 5,
                        mec="k" if fallback else c, mew=1.2 if fallback else 0.5, ls="none", zorder=4)
            b = r.get("kills_breakdown_s")
            if "kills" in ys and not ys["kills"][1] and b is not None and pd.notna(b) and b > 0:
                ax.plot([x], [b], marker="x", color="k", ms=6, mew=1.2, ls="none", zorder=5)
                marked_breakdown = True
            y0, fb = ys.get("kills", next(iter(ys.values())))
            lab = style.label(s) + (" *" if any(f for _, f in ys.values()) else "")
            anns.append(ax.annotate(lab, (x, y0), xytext=(8, 0), textcoords="offset points", fontsize=8,
                                    va="center", color=c))
        if marked_breakdown:
            notes.append("x: the runtime's own record of the kills, per failure (detect + kill-to-first-step + "
                         "recomputed steps); the window-based point also holds slower (or, narrower, faster) steps after a "
                         "recovery and the host's noise.")
        reps = int(meas["repeats"].max()) if "repeats" in meas and meas["repeats"].notna().any() else 1
        if reps > 1:
            notes.append(f"measured: mean over {reps} runs of each failure schedule; the pale bar spans their "
                         f"min to max.")
        if meas.get("kills_breakdown_s") is not None and any(
                (r.get("kills_s") is not None and pd.notna(r.get("kills_s")) and r["kills_s"] <= 0)
                for _, r in meas.iterrows()):
            notes.append("* the training window grew less than the failure-free run's noise (lost per failure <= 0); "
                         "drawn instead: the runtime's own detect + recover + recompute per failure (black edge).")
    if sim is not None:
        for _, r in sim.iterrows():
            s = r["strategy"]
            ax.plot([r["overhead_pct"]], [r["lost_s"]], marker=style.marker(s), color=style.colour(s), mfc="white",
                    mew=1.8, ms=9, ls="none", zorder=4)
            anns.append(ax.annotate(style.label(s), (r["overhead_pct"], r["lost_s"]), xytext=(8, 0),
                                    textcoords="offset points", fontsize=8, va="center", color=style.colour(s)))
        notes.append(f"hollow: simulator, {a.gpus:,} GPUs (Llama-3-405B-like job, llama3 failure rates, "
                     f"{sim.attrs['seeds']} seeds x 54 days, ~{sim.attrs['failures']:.0f} failures each), "
                     f"mean over seeds; the degraded width of an elastic job counts as time lost.")
    ax.set_xlabel("failure-free overhead (% of useful time: step time / ft=none's - 1)")
    ax.set_ylabel("time lost per failure (s, log)")
    xmax = max([0.0] + ([meas["overhead_pct"].max()] if meas is not None else [])
               + ([sim["overhead_pct"].max()] if sim is not None else []))
    ax.set_xlim(-1.0, xmax + 9.0)  # room for the labels right of the points
    ax.set_ylim(FLOOR / 1.5, top_y * 1.6)
    handles = []
    if meas is not None:
        handles += [Line2D([], [], marker="o", color="#555555", ls="none", ms=9,
                           label="measured: CPU runtime, 2 cores, dp=4 tiny model (large: 2 kills; small: 2 at once)")]
    if sim is not None:
        handles += [Line2D([], [], marker="o", color="#555555", mfc="white", mew=1.8, ls="none", ms=9,
                           label=f"simulated: {a.gpus:,} GPUs (scale sweep)")]
    ax.legend(handles=handles, loc="lower right", fontsize=7.5, framealpha=0.9)
    ax.set_title("Overhead vs time lost per failure: measured on a 2-core CPU host (filled) and simulated at "
                 f"{a.gpus:,} GPUs (hollow)\nlower left is better; the two workloads differ, compare within a kind",
                 fontsize=10)
    fig.tight_layout()
    style.spread_labels(ax, anns)
    style.footnote(fig, "\n".join(notes))
    style.save(fig, a.out, "fig11_pareto")


if __name__ == "__main__":
    main()
