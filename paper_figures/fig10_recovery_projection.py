"""Figure 10: hot-swap recovery time, measured per parallel axis (left) and projected against the
number of GPUs with the simulator's cost model (right).

Left, measured (one bar per recovery, stacked: detect, plan, rebuild, transfer, rollback, first step;
a black tick marks the measured kill-to-first-step time). Reads, under the results root (``--input``):
- runtime/strategies/{scale/dp2,scale/dp3,kills,burst}/deadpool/summary.json: data parallel only,
  dp = 2, 3, 4 ranks (experiments/compare_strategies.py, CPU);
- runtime/bench3d/kill{1,4,6}_{affected,all}/summary.json and runtime/bench3d/results.json:
  dp2 x tp2 x pp2, one rank killed at a tensor-parallel, pipeline-stage or data-parallel position,
  rebuilding the affected communicators or all of them (experiments/bench_3d.py, CPU);
- gpu/<date>-h100/summary.json ``check_hotswap*``: 4 ranks sharing one H100 (gloo), when present.

Right, projected: detect (crash) + plan + rebuild(num_gpus) + transfer(state bytes per node) + warm-up,
the closed form of sim/costs.py (``costs.reconfig``) evaluated on a calibration file, for the
Llama-3-405B-like layout of sim/conf/cluster/h100_405b.yaml (tp 8 x pp 16, ZeRO-1) at 128..131,072
GPUs; ``gpu_h100`` (the GPU profile) and ``cpu_strategies`` (fitted by sim.calibrate on the CPU
runs). For comparison, checkpoint/restart's detect + ``costs.restart_s`` (requeue, relaunch, load).
No simulation is run. The step time (warm-up is counted in steps) is held at its 16,384-GPU value.
    python paper_figures/fig10_recovery_projection.py [--input RESULTS_ROOT] [--out DIR]
"""

import json
import statistics
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import yaml

import style

sys.path.insert(0, str(style.ROOT))
from sim import costs  # noqa: E402  (closed-form cost model only; no simulation)
from sim.layout import Layout  # noqa: E402

PHASES = ("detect_s", "plan_s", "rebuild_s", "transfer_s", "rollback_s", "first_step_s")
NAMES = ("detect", "plan", "rebuild communicators", "state transfer", "rollback", "first step")
COLOURS = ("#ff7f0e", "#bcbd22", "#8c564b", "#1f77b4", "#d62728", "#7f7f7f")
DP_RUNS = (("scale/dp2", "dp=2"), ("scale/dp3", "dp=3"), ("kills", "dp=4"), ("burst", "dp=4"))
KILLS_3D = ((1, "TP peer\n(rank 1,\nstage 0)"), (4, "PP stage 1\n(rank 4,\ndp 0)"),
            (6, "DP replica 1\n(rank 6,\nstage 1)"))
CLUSTER = style.ROOT / "sim" / "conf" / "cluster" / "h100_405b.yaml"
GPUS = [2 ** k for k in range(7, 18)]  # 128 .. 131,072: one tp8 x pp16 replica and up
CLAIM_GPUS, CLAIM_S = 512, 40.0


def rec_row(r: dict) -> dict:
    row = {p: float(r.get(p) or 0.0) for p in PHASES}
    row["total"] = float(r.get("kill_to_first_step_s") or sum(row.values()))
    return row


def measured(root: Path) -> list[tuple[str, str, dict, bool]]:
    """(group, tick label, phases, rebuild-all) per recovery, in plotting order; bars of one group
    that share a tick label stand side by side under it."""
    bars = []
    strat = root / "runtime" / "strategies"
    for sub, lab in DP_RUNS:
        f = strat / sub / "deadpool" / "summary.json"
        if not f.exists():
            continue
        s = json.loads(f.read_text())
        for r in s.get("recoveries") or []:
            if r.get("outcome", "hot-swapped") != "hot-swapped":
                continue
            failed = r.get("failed_rank")
            who = (f"ranks {'+'.join(map(str, failed))}\nat once" if isinstance(failed, list)
                   else f"rank {failed}")
            bars.append(("data parallel only\nCPU", f"{lab}\n{who}", rec_row(r), False))
    b3 = root / "runtime" / "bench3d"
    pos = {}
    if (b3 / "results.json").exists():
        for e in json.loads((b3 / "results.json").read_text()).get("recovery") or []:
            pos[(e.get("rank"), e.get("rebuild"))] = e
    for rank, lab in KILLS_3D:
        for mode in ("affected", "all"):
            f = b3 / f"kill{rank}_{mode}" / "summary.json"
            recs = json.loads(f.read_text()).get("recoveries") if f.exists() else None
            if recs:
                row = rec_row(recs[0])
            elif (rank, mode) in pos:  # the bench's own record: no detect/plan/first-step split
                e = pos[(rank, mode)]
                row = {p: float(e.get(p) or 0.0) for p in PHASES}
                row["total"] = float(e["kill_to_first_step_s"])
            else:
                continue
            bars.append(("dp2 x tp2 x pp2 (8 ranks)\nCPU", lab, row, mode == "all"))
    gpu = style.gpu_summary(root)
    if gpu is not None:
        s = json.loads(gpu.read_text())
        for key, lab in (("check_hotswap", "determ."), ("check_hotswap_nondeterministic", "non-det.")):
            for r in (s.get(key) or {}).get("recovery") or []:
                bars.append(("4 ranks sharing\none H100 (gloo)", f"dp=4\nrank {r.get('failed_rank')}\n{lab}",
                             rec_row(r), False))
    return bars


def panel_measured(ax, bars) -> None:
    # x positions: bars under one tick label of one group stand side by side; gaps between groups
    x, ticks, pos, prev = [], {}, -1.0, None
    for g, lab, _, _ in bars:
        if prev is not None and (g, lab) == prev:
            pos += 0.72
        else:
            pos += 1.0 + (0.5 if prev is not None and g != prev[0] else 0.0)
        x.append(pos)
        ticks.setdefault((g, lab), []).append(pos)
        prev = (g, lab)
    x = np.array(x)
    bottom = np.zeros(len(bars))
    for p, name, c in zip(PHASES, NAMES, COLOURS):
        v = np.array([row[p] for _, _, row, _ in bars])
        ax.bar(x, v, bottom=bottom, width=0.7, color=c, label=name, edgecolor="white", lw=0.3,
               hatch=["///" if h else None for *_, h in bars])
        bottom += v
    tot = [row["total"] for _, _, row, _ in bars]
    ax.plot(x, tot, "k_", ms=12, mew=2, label="kill to first step")
    if any(h for *_, h in bars):
        from matplotlib.patches import Patch
        ax.bar([0], [0], width=0, color="white", edgecolor="#555555", hatch="///",
               label="rebuild every communicator\n(else only the affected ones)")
    centres = [float(np.mean(v)) for v in ticks.values()]
    ax.set_xticks(centres, [lab for _, lab in ticks], fontsize=7)
    groups = list(dict.fromkeys(g for g, *_ in bars))
    for g in groups:
        xs = [xi for xi, (gi, *_) in zip(x, bars) if gi == g]
        ax.annotate(g, ((min(xs) + max(xs)) / 2, -0.2), xycoords=("data", "axes fraction"), ha="center",
                    va="top", fontsize=8, weight="bold", annotation_clip=False)
    ax.set_ylabel("seconds from SIGKILL")
    top = max(max(tot), float(bottom.max()))
    ax.set_ylim(0, top * 1.12)
    ax.set_xlim(x[0] - 0.7, x[-1] + 0.7)
    ax.set_title("(a) measured hot-swap recoveries, one bar each (tiny models)")
    ax.legend(loc="upper left", fontsize=7, ncol=2, framealpha=0.9, columnspacing=0.8, handlelength=1.3)


def projection(calib: dict, base: dict, gpus=GPUS):
    rows = []
    step = Layout.from_cfg(base).step_time_s  # held at the file's own num_gpus (16,384: 6.3 s)
    for n in gpus:
        lay = Layout.from_cfg({**base, "num_gpus": n, "step_time_s": step, "num_spares": 0})
        rc = costs.reconfig(lay, calib)
        det = costs.detection(calib, lay).crash_s
        rows.append(dict(gpus=n, detect=det, plan=rc.plan_s, rebuild=rc.rebuild_s, transfer=rc.transfer_s,
                         warmup=rc.warmup_s, total=det + rc.swap_s, restart=det + costs.restart_s(lay, calib),
                         gb_per_node=lay.state_bytes_per_node / 1e9))
    return rows, step


def panel_projection(ax, calibs: dict, base: dict) -> list[str]:
    notes = []
    step = Layout.from_cfg(base).step_time_s
    for name, ls, mfc, lab in (("gpu_h100", "-", None, "gpu_h100 (GPU profile)"),
                               ("cpu_strategies", "--", "white", "cpu_strategies (fitted on the CPU runs)")):
        if name not in calibs:
            continue
        rows, _ = projection(calibs[name], base)
        n = [r["gpus"] for r in rows]
        ax.plot(n, [r["total"] for r in rows], ls, marker="o", color="#d62728", mfc=mfc, ms=4,
                lw=2 if name == "gpu_h100" else 1.5, label=f"hot swap, {lab}")
        ax.plot(n, [r["restart"] for r in rows], ls, marker="s", color="#1f77b4", mfc=mfc, ms=4,
                lw=1.5 if name == "gpu_h100" else 1.2, label=f"checkpoint/restart, {name}")
        if name == "gpu_h100":
            at = {r["gpus"]: r for r in rows}[CLAIM_GPUS]
            ax.annotate(f"{at['total']:.0f} s", (CLAIM_GPUS, at["total"]), xytext=(6, 6), textcoords="offset points",
                        fontsize=7.5, color="#d62728", ha="left")
        else:
            c = calibs[name]
            notes.append(f"(b) cpu_strategies: state moves at the CPU host's fitted "
                         f"{float(c['transfer_gbps_per_node']):.2f} GB/s per node and a relaunch costs "
                         f"{float(c.get('launch_per_node_s', 0)):.1f} s per node (every process imports torch on "
                         f"the same 2 cores); checkpoint/restart = detect + requeue + relaunch + load (sim.costs.restart_s).")
    ax.plot([CLAIM_GPUS], [CLAIM_S], "kv", ms=7, label=f"paper: < {CLAIM_S:.0f} s at {CLAIM_GPUS} GPUs")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlim(GPUS[0] / 1.3, GPUS[-1] * 1.3)
    ax.set_xticks(GPUS[::2], [f"{g:,}" for g in GPUS[::2]], fontsize=8)
    ax.set_ylim(0.5, None)
    ax.set_xlabel("GPUs (8 per node; 405 B params, tp 8 x pp 16, ZeRO-1)")
    ax.set_ylabel("seconds from failure to training again")
    ax.set_title(f"(b) projected: cost model (sim/costs.py) on two calibrations")
    ax.legend(loc="lower right", fontsize=7, framealpha=0.9)
    return notes


def panel_breakdown(ax, calib: dict, base: dict) -> str:
    shown = [128, CLAIM_GPUS, 2048, 16384, 131072]
    rows, step = projection(calib, base, shown)
    comp = (("detect", "#ff7f0e", "detect (crash)"), ("plan", "#bcbd22", "plan"),
            ("rebuild", "#8c564b", "rebuild communicators"), ("transfer", "#1f77b4", "state transfer"),
            ("warmup", "#9edae5", "warm-up (1 step)"))
    bottom = np.zeros(len(rows))
    x = np.arange(len(rows))
    for k, c, lab in comp:
        v = np.array([r[k] for r in rows])
        ax.bar(x, v, bottom=bottom, color=c, width=0.65, label=lab, edgecolor="white", lw=0.3)
        bottom += v
    top = float(bottom.max())
    for xi, t in zip(x, bottom):
        ax.text(xi, t + 0.01 * top, f"{t:.0f} s", ha="center", va="bottom", fontsize=7.5, weight="bold")
    i = shown.index(CLAIM_GPUS)
    ax.plot([i - 0.45, i + 0.45], [CLAIM_S] * 2, color="k", lw=2)
    ax.annotate(f"paper:\n< {CLAIM_S:.0f} s", (i - 0.4, CLAIM_S), xytext=(i - 0.5, top * 1.12), ha="center",
                va="bottom", fontsize=7.5, arrowprops=dict(arrowstyle="-", lw=0.8))
    ax.set_xticks(x, [f"{g:,}" for g in shown], fontsize=8)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("seconds (gpu_h100 calibration)")
    ax.set_ylim(0, top * 1.6)
    ax.set_title(f"(c) gpu_h100's hot swap by phase\n(step held at {step:.1f} s)")
    ax.legend(loc="upper left", fontsize=7, ncol=2, framealpha=0.9, columnspacing=0.8, handlelength=1.3)
    at = rows[i]
    return (f"(c) at {CLAIM_GPUS} GPUs: {at['total']:.0f} s = detect {at['detect']:.0f} + plan {at['plan']:.1f} + "
            f"rebuild {at['rebuild']:.0f} + transfer {at['transfer']:.1f} ({at['gb_per_node']:.0f} GB per node, "
            f"dp {CLAIM_GPUS // 128}) + warm-up {at['warmup']:.1f}; gpu_h100's detection (10 s heartbeat timeout) and "
            f"rebuild (2 s per doubling) are assumptions, not measurements (sim/conf/calibration/gpu_h100.yaml).")


def main():
    a = style.args("", __doc__.splitlines()[0])
    root = Path(a.input)
    bars = measured(root)
    calibs = {}
    for name in ("gpu_h100", "cpu_strategies"):
        f = style.calibration_file(name)
        if f.exists():
            calibs[name] = yaml.safe_load(f.read_text())
        else:
            print(f"skip curve: no calibration {f}")
    base = yaml.safe_load(CLUSTER.read_text()) if CLUSTER.exists() else None
    if base is None:
        calibs = {}
    if not bars and not calibs:
        print(f"skip: no runtime recoveries under {root} and no calibration files")
        return
    if not bars:
        print(f"skip panel (a): no hot-swap recoveries under {root}/runtime")
    # (a) across the top, (b) and (c) below it; whichever has no input is left out
    lower = (["p"] if calibs else []) + (["c"] if "gpu_h100" in calibs else [])
    rows = (["m"] if bars else []) + (["pc"] if lower else [])
    fig = plt.figure(figsize=(11.5, 4.6 * len(rows)))
    gs = fig.add_gridspec(len(rows), 2 if lower == ["p", "c"] else 1, width_ratios=[1.45, 1.0] if lower == ["p", "c"] else None)
    notes = []
    if bars:
        panel_measured(fig.add_subplot(gs[0, :]), bars)
    r = len(rows) - 1
    for j, p in enumerate(lower):
        ax = fig.add_subplot(gs[r, j])
        if p == "p":
            notes += panel_projection(ax, calibs, base)
        else:
            notes.append(panel_breakdown(ax, calibs["gpu_h100"], base))
    fig.suptitle("Hot-swap recovery time: measured on a 2-core CPU host and one H100 (a), "
                 "projected to GPU clusters (b, c)", fontsize=11)
    if bars:
        notes.insert(0, "(a) first step = the first training step after the swap, which includes one ordinary step "
                        "(0.04-0.25 s on CPU); the ranks share 2 CPU cores (or one GPU), so each phase is slower than "
                        "with a core per rank.")
    style.footnote(fig, "\n".join(notes))
    style.save(fig, a.out, "fig10_recovery_projection")


if __name__ == "__main__":
    main()
