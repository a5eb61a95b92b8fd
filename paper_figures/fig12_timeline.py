"""Figure 12: a real run with injected failures over time: throughput and loss, the kills and the
recoveries marked, the failure-free run of the same seed and configuration overlaid in grey.

Reads runtime/strategies/{kills,free}/<strategy>/ under the results root (``--input``; files
``metrics.jsonl``: one row per step and rank with step, rank, generation, loss, step_time_s and t,
the step's end in epoch seconds; ``summary.json``: recoveries with t_kill, kill_to_first_step_s),
written by experiments/compare_strategies.py (CPU, dp=4, tiny model), for DeadPool (hot swap) and
checkpoint/restart. The bottom row compares the loss step by step with the failure-free run.
    python paper_figures/fig12_timeline.py [--input RESULTS_ROOT] [--out DIR]
"""

import json
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import style

SHOWN = ("deadpool", "checkpoint_restart")
GAP_S = 1.0  # no step for this long: a recovery; lines break there instead of bridging it
WINDOW = 5  # steps in the rolling median of the step rate


class Run:
    def __init__(self, d: Path):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        self.summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        self.t0 = min(r["t"] - r["step_time_s"] for r in rows)
        ev = {}  # (generation, step) -> end time (slowest rank), losses by rank
        for r in rows:
            e = ev.setdefault((r["generation"], r["step"]), {"t": 0.0, "loss": {}})
            e["t"] = max(e["t"], r["t"] - self.t0)
            e["loss"][r["rank"]] = r["loss"]
        self.events = sorted(ev.items(), key=lambda kv: kv[1]["t"])  # every step run, recomputed ones too
        newest = {}
        for (g, s), e in ev.items():
            if s not in newest or g > newest[s][0]:
                newest[s] = (g, e)
        self.final = {s: e["loss"] for s, (g, e) in newest.items()}  # step -> {rank: loss} that counted
        self.window = self.events[-1][1]["t"]
        self.kills = [(x["t_kill"] - self.t0, float(x.get("kill_to_first_step_s") or 0.0), x.get("failed_rank"))
                      for x in self.summary.get("recoveries", []) if x.get("t_kill")]

    def loss_vs_time(self):
        t = [e["t"] for _, e in self.events]
        y = [statistics.median(e["loss"].values()) for _, e in self.events]
        return breaks(t, y)

    def rate_vs_time(self):
        t = np.array([e["t"] for _, e in self.events])
        dt = np.diff(t)
        xs, ys = [], []
        for i in range(WINDOW, len(t)):
            w = dt[i - WINDOW:i]
            if w.max() > GAP_S or w.min() <= 0:
                continue
            xs.append(t[i])
            ys.append(float(np.median(1.0 / w)))
        return breaks(xs, ys)


def breaks(xs, ys):
    ox, oy = [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i and x - xs[i - 1] > GAP_S:
            ox.append(np.nan)
            oy.append(np.nan)
        ox.append(x)
        oy.append(y)
    return ox, oy


def label_rank(rank) -> str:
    return f"ranks {'+'.join(map(str, rank))}" if isinstance(rank, list) else f"rank {rank}"


def loss_vs_step(ax, run: Run, free: Run | None, colour: str) -> None:
    """The loss that counted at each step (newest generation), against the failure-free run's."""
    if free:
        steps = sorted(free.final)
        ax.plot(steps, [statistics.median(free.final[k].values()) for k in steps], color="#999999", lw=4,
                alpha=0.6, label="failure-free run")
    steps = sorted(run.final)
    ax.plot(steps, [statistics.median(run.final[k].values()) for k in steps], ".", color=colour, ms=3.5,
            label=f"with {len(run.kills)} SIGKILLs")
    for k, x in enumerate(run.summary.get("recoveries", [])):
        at = x.get("failed_at_step") or x.get("resume_step")
        if at is not None:
            ax.axvline(at, color="k", ls="--", lw=0.8, label="step of a kill" if k == 0 else None)
    if free:
        same = total = 0
        for k, losses in run.final.items():
            for rank, v in losses.items():
                total += 1
                same += free.final.get(k, {}).get(rank) == v
        ax.text(0.98, 0.6, f"{same} of {total} (step, rank) losses\nequal to the failure-free run's",
                transform=ax.transAxes, ha="right", va="center", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#bbbbbb"))
    ax.set_xlabel("training step")
    ax.legend(fontsize=7, loc="upper right", framealpha=0.9)


def main():
    a = style.args("", __doc__.splitlines()[0])
    root = Path(a.input) / "runtime" / "strategies"
    shown = [s for s in SHOWN if (root / "kills" / s / "metrics.jsonl").exists()]
    if not shown:
        print(f"skip: no kills/<strategy>/metrics.jsonl under {root}")
        return
    runs = {s: Run(root / "kills" / s) for s in shown}
    frees = {s: Run(root / "free" / s) for s in shown if (root / "free" / s / "metrics.jsonl").exists()}
    xmax = max(max(r.window for r in runs.values()), max([r.window for r in frees.values()] or [0]))
    fig = plt.figure(figsize=(5.8 * len(shown), 8.4))
    gs = fig.add_gridspec(3, len(shown), height_ratios=[1.0, 1.0, 0.85])
    axes = [[None] * len(shown) for _ in range(3)]
    for j in range(len(shown)):
        axes[0][j] = fig.add_subplot(gs[0, j], sharex=axes[0][0], sharey=axes[0][0])
        axes[1][j] = fig.add_subplot(gs[1, j], sharex=axes[0][0], sharey=axes[1][0])
        axes[2][j] = fig.add_subplot(gs[2, j], sharex=axes[2][0], sharey=axes[2][0])
    rate_top = 0.0
    for j, strat in enumerate(shown):
        run, free, c = runs[strat], frees.get(strat), style.colour(strat)
        ax_t, ax_l = axes[0][j], axes[1][j]
        if free:
            x, y = free.rate_vs_time()
            ax_t.plot(x, y, color="#999999", lw=1.3, label="failure-free run (same seed)")
            ax_l.plot(*free.loss_vs_time(), color="#999999", lw=3, alpha=0.6, label="failure-free run (same seed)")
            rate_top = max(rate_top, np.nanmax(y))
        x, y = run.rate_vs_time()
        rate_top = max(rate_top, np.nanmax(y))
        n = len(run.kills)
        ax_t.plot(x, y, color=c, lw=1.3, label=f"with {n} SIGKILLs")
        ax_l.plot(*run.loss_vs_time(), color=c, lw=1.1, label=f"with {n} SIGKILLs")
        for k, (tk, dur, rank) in enumerate(run.kills):
            for ax in (ax_t, ax_l):
                ax.axvline(tk, color="k", ls="--", lw=0.8)
                ax.axvspan(tk, tk + dur, color="#ffbb78", alpha=0.6, lw=0,
                           label="kill to first step after" if k == 0 else None)
            ax_t.annotate(f"SIGKILL\n{label_rank(rank)}", (tk, 1.0), xycoords=("data", "axes fraction"),
                          ha="right", va="top", fontsize=7.5, xytext=(-3, -2), textcoords="offset points",
                          bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
        recov = ", ".join(f"{d:.2f} s" for _, d, _ in run.kills)
        win = f"{run.window:.1f} s" + (f" (failure-free: {free.window:.1f} s)" if free else "")
        ax_t.set_title(f"{style.label(strat)}: {len(run.final)} steps in {win}\nkill to first step: {recov}",
                       fontsize=9.5)
        ax_l.set_xlabel("wall time since the first step (s)")
        ax_t.legend(fontsize=7, loc="lower right", framealpha=0.9)
        ax_l.legend(fontsize=7, loc="upper right", framealpha=0.9)
        loss_vs_step(axes[2][j], run, free, c)
        ax_t.tick_params(labelbottom=True)
        if j:
            for r in range(3):
                axes[r][j].tick_params(labelleft=False)
    axes[0][0].set_ylabel(f"steps / s\n(rolling median of {WINDOW} steps)")
    axes[1][0].set_ylabel("training loss\n(median over 4 ranks)")
    axes[2][0].set_ylabel("training loss\n(median over 4 ranks)")
    axes[0][0].set_ylim(0, rate_top * 1.3)
    axes[0][0].set_xlim(0, xmax * 1.02)
    fig.suptitle("A real run with injected failures, measured on a 2-core CPU host (dp=4 tiny model, 120 steps, "
                 "SIGKILL mid-step):\nhot swap vs checkpoint/restart, each next to its failure-free run",
                 fontsize=10.5)
    style.footnote(fig, "Throughput counts every step run, recomputed ones too; no step for > 1 s is a recovery "
                        "(line broken). Checkpoint/restart resumes from its last checkpoint, so its loss steps back "
                        "after each restart.\nStep rates differ by up to ~20 % between runs on this shared 2-core "
                        "host, also before the first failure.")
    style.save(fig, a.out, "fig12_timeline")


if __name__ == "__main__":
    main()
