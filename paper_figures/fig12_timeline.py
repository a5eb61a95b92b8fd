"""Figure 12: a real run with injected failures over time: throughput and loss, the kills and
the recoveries marked, the failure-free run of the same seed overlaid.

Reads experiments/results/runtime/strategies/{kills,free}/<strategy>/ (metrics.jsonl, summary.json:
experiments/compare_strategies.py, CPU, dp=4, tiny model), for DeadPool and checkpoint/restart.
    python paper_figures/fig12_timeline.py [--input DIR] [--out DIR]
"""

import json
import statistics
from pathlib import Path

import matplotlib.pyplot as plt

import style

SHOWN = ("deadpool", "checkpoint_restart")


def load(d: Path):
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
    s = json.loads((d / "summary.json").read_text())
    t0 = min(r["t"] - r["step_time_s"] for r in rows)
    by_step = {}
    for r in rows:  # the step's end on its slowest rank; loss of the newest generation that ran it
        e = by_step.setdefault(r["step"], {"t": 0.0, "loss": [], "gen": -1})
        if r["generation"] > e["gen"]:
            e.update(gen=r["generation"], loss=[])
        if r["generation"] == e["gen"]:
            e["t"] = max(e["t"], r["t"] - t0)
            e["loss"].append(r["loss"])
    steps = sorted(by_step)
    ts = [by_step[k]["t"] for k in steps]
    loss = [statistics.mean(by_step[k]["loss"]) for k in steps]
    kills = [(x["t_kill"] - t0, x.get("kill_to_first_step_s") or 0.0, x.get("failed_rank"))
             for x in s.get("recoveries", []) if x.get("t_kill")]
    # every step a rank finished, in time order: throughput = steps per second over a sliding window
    ends = sorted(r["t"] - t0 for r in rows if r["rank"] == min(x["rank"] for x in rows))
    return steps, ts, loss, kills, ends


def gaps(xs, ys, gap_s=1.0):
    """Break the line where nothing happened for ``gap_s`` (a recovery), instead of bridging it."""
    ox, oy = [], []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i and x - xs[i - 1] > gap_s:
            ox.append(float("nan"))
            oy.append(float("nan"))
        ox.append(x)
        oy.append(y)
    return ox, oy


def throughput(ends, width=8):
    """Steps per second over a sliding window of ``width`` steps, not across a recovery gap."""
    xs, ys = [], []
    for i in range(width, len(ends)):
        if max(ends[k] - ends[k - 1] for k in range(i - width + 1, i + 1)) > 1.0:
            continue
        dt = ends[i] - ends[i - width]
        xs.append(ends[i])
        ys.append(width / dt if dt > 0 else 0.0)
    return gaps(xs, ys)


def main():
    a = style.args("runtime/strategies", __doc__.splitlines()[0])
    root = Path(a.input)
    shown = [s for s in SHOWN if (root / "kills" / s / "metrics.jsonl").exists()]
    if not shown:
        print(f"skip: no kills/<strategy>/metrics.jsonl under {root}")
        return
    fig, axes = plt.subplots(2, len(shown), figsize=(5.2 * len(shown), 5.4), sharex="col", squeeze=False)
    for j, strat in enumerate(shown):
        steps, ts, loss, kills, ends = load(root / "kills" / strat)
        free = root / "free" / strat
        ax_t, ax_l = axes[0][j], axes[1][j]
        if (free / "metrics.jsonl").exists():
            fs, fts, floss, _, fends = load(free)
            ax_t.plot(*throughput(fends), color="#999999", lw=1.2, label="failure-free run")
            ax_l.plot(*gaps(fts, floss), color="#999999", lw=2.5, alpha=0.6, label="failure-free run")
        ax_t.plot(*throughput(ends), color=style.colour(strat), lw=1.2, label="with 2 SIGKILLs")
        ax_l.plot(*gaps(ts, loss), color=style.colour(strat), lw=1.0, label="with 2 SIGKILLs")
        for k, (tk, dur, rank) in enumerate(kills):
            for ax in (ax_t, ax_l):
                ax.axvline(tk, color="k", ls="--", lw=0.8)
                ax.axvspan(tk, tk + dur, color="#ffbb78", alpha=0.5, lw=0,
                           label="kill to first step" if k == 0 and ax is ax_t else None)
            ax_t.annotate(f"SIGKILL\nrank {rank}", (tk, 0.97), xycoords=("data", "axes fraction"),
                          ha="right", va="top", fontsize=7.5, xytext=(-3, 0), textcoords="offset points")
        ax_t.set_title(f"{style.label(strat)}: {len(kills)} kills, window {ts[-1]:.0f} s")
        ax_t.set_ylabel("steps / s (8-step window)")
        ax_l.set_ylabel("training loss")
        ax_l.set_xlabel("wall time since the first step (s)")
        ax_t.legend(fontsize=7.5, loc="lower right")
        ax_l.legend(fontsize=7.5, loc="upper right")
    fig.suptitle("A real run with injected failures (CPU, 2 cores, dp=4 tiny model, 120 steps): hot swap vs "
                 "checkpoint/restart", fontsize=10)
    style.save(fig, a.out, "fig12_timeline")


if __name__ == "__main__":
    main()
