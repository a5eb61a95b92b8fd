"""Every runtime strategy on the same job and fault schedules, side by side (CPU, small model).

    python experiments/compare_strategies.py [--steps 40] [--out experiments/results/runtime/strategies]

Strategies (``ft=``): none, deadpool, sync_snapshot, checkpoint_restart (async DCP writes every
``--ckpt_every`` steps), elastic (in place: the survivors keep their processes) and
elastic_relaunch (``ft=elastic ft.elastic_mode=relaunch``: every process restarted at the new
width, as torchelastic does). Schedules (``--schedules``):

    free    no failure: the failure-free step time, as a ratio to ft=none measured in this run.
            Run ``--free_rounds`` times, the strategies interleaved in a rotated order each round;
            the ratio is the median over rounds of (step time / that round's ft=none step time),
            so slow phases of a shared host hit every strategy alike
    kills   SIGKILLs of ranks 1 and 2 at fixed steps (``--kills``), mid-step
    burst   two ranks killed in the same step (ranks 1 and 3)

DeadPool and sync_snapshot hold ``--spares`` warm spares (2: a burst of two is hot-swapped;
with fewer, DeadPool falls back to elastic). For each run the table gives:

    ratio      median over rounds of the failure-free step time / ft=none's (free schedule only;
               ratio_min, ratio_max: the spread over rounds)
    lost/fail  (training window - the strategy's failure-free window, the median over the free
               rounds) / failures: everything a
               failure costs, from the kill to being back at speed, recomputed steps included
    detect, recover, recompute  the runtime's own breakdown, summed over the run's failures
               (recover: kill -> first step again minus detection; recompute: steps rolled back
               x the failure-free step time)
    goodput    num_steps x ft=none's step time / training window (the first step's start to the
               last step's end), per GPU held: x workers / (workers + spares)

The failure schedules run ``--repeats`` times (rounds with the strategies in a rotated order, as
the free rounds): on a shared 2-core host one run's relaunch or a slow phase of the host moves
its goodput by 10 % and its window by seconds, so ``lost_per_failure_s`` and ``goodput`` are
means over the repeats (free schedule: over the rounds), with ``lost_min`` and ``lost_max`` the
spread; detect, recover and recompute (the runtime's own record) are the least noisy.

Writes ``table.csv`` and keeps every run's ``summary.json``, ``metrics.jsonl`` and ``job.json``
under ``<out>/<schedule>/<strategy>/`` (repeats and free rounds after the first:
``<out>/<schedule>/rep<k>/<strategy>/``; ``sim.calibrate``, ``sim.replay`` and ``paper_figures``
read them). ``--world_sizes`` also runs DeadPool
and checkpoint/restart with one kill at other data-parallel widths
(``<out>/scale/dp<N>/<strategy>/``), so the calibration fits slopes over world size.
Takes ~13 minutes on 2 cores with the defaults (120 steps, 3 free rounds, 3 repeats).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.common import keep, metrics, run  # noqa: E402

STRATEGIES = ("none", "deadpool", "sync_snapshot", "checkpoint_restart", "elastic",
              "elastic_relaunch")


def schedule_events(name: str, kills: list[int]) -> list[dict]:
    if name == "free":
        return []
    if name == "kills":
        return [{"rank": 1 + i % 3, "step": s, "phase": "mid_step", "kind": "kill"}
                for i, s in enumerate(kills)]
    if name == "burst":
        s = kills[0]
        return [{"rank": 1, "step": s, "phase": "mid_step", "kind": "kill"},
                {"rank": 3, "step": s, "phase": "mid_step", "kind": "kill"}]
    raise ValueError(f"unknown schedule {name!r}")


def overrides(strategy: str, args, dp: int) -> list[str]:
    ft = "elastic" if strategy == "elastic_relaunch" else strategy
    o = [f"ft={ft}", "model=tiny", f"parallel.dp={dp}", f"num_steps={args.steps}",
         "log_every_steps=0"]
    if strategy in ("deadpool", "sync_snapshot"):
        o += [f"ft.num_spares={args.spares}", "ft.persist_interval_steps=0"]
    elif strategy == "checkpoint_restart":
        o += [f"ft.persist_interval_steps={args.ckpt_every}"]
    elif strategy == "elastic":
        o += ["ft.persist_interval_steps=0", "ft.elastic_mode=in_place"]
    elif strategy == "elastic_relaunch":
        o += ["ft.persist_interval_steps=0", "ft.elastic_mode=relaunch"]
    return o


def fmt_events(events: list[dict]) -> str:
    return "faults.events=[" + ",".join(
        "{rank:%d,step:%d,phase:%s,kind:%s}" % (e["rank"], e["step"], e["phase"], e["kind"])
        for e in events) + "]"


def window(rows: list[dict], num_steps: int) -> float | None:
    """The first step's start to the last step's end (None if the job never finished)."""
    ends = [r["t"] for r in rows if r["step"] == num_steps]
    if not ends:
        return None
    return max(ends) - min(r["t"] - r["step_time_s"] for r in rows)


def step_time(rows: list[dict]) -> float:
    """Median step time of the first generation (the first step includes warm-up)."""
    return statistics.median(r["step_time_s"] for r in rows if r["generation"] == 0 and r["step"] > 1)


def run_one(strategy: str, sched: str, args, dp: int, tmp: Path, out: Path) -> dict:
    events = schedule_events(sched, args.kills)
    rd = tmp / sched / strategy
    t0 = time.time()
    s = run(overrides(strategy, args, dp) + [fmt_events(events)], rd)
    keep(rd, out / strategy, "", files=("summary.json", "metrics.jsonl", "job.json"))
    rows = metrics(rd)
    print(f"  {sched:6s} {strategy:19s} dp={dp} {s['outcome']:14s} {time.time() - t0:5.1f} s",
          flush=True)
    return {"summary": s, "rows": rows, "failures": len(events)}


def table_rows(results: dict, free_rounds: list[dict], args) -> list[dict]:
    """One row per (schedule, strategy); ``results[schedule][strategy]`` is a list of repeats
    (``results["free"]``: one per free round). The failure-free references are medians over the
    free rounds (one slow round on a shared host must not become every failure's baseline)."""
    t_none = statistics.median(step_time(r["rows"]) for r in results["free"]["none"])
    rounds = [{k: v["summary"]["step_time_s"] for k, v in r.items()} for r in free_rounds]
    out = []
    for sched, by in results.items():
        for strategy, reps in by.items():
            free = results["free"].get(strategy)
            w_free = statistics.median(window(r["rows"], args.steps) for r in free) if free else None
            t_free = statistics.median(step_time(r["rows"]) for r in (free or reps[:1]))
            per = [_measures(r, args, w_free, t_free, t_none) for r in reps]
            first, done = reps[0], [p for p in per if p["window_s"]]
            lost = [p["lost_per_failure_s"] for p in per if p["lost_per_failure_s"] is not None]
            spares, workers = int(first["summary"].get("num_spares", 0)), int(args.dp)  # held from the start
            row = {"schedule": sched, "strategy": strategy, "outcome": first["summary"]["outcome"],
                   "repeats": len(reps), "failures": first["failures"], "gpus_held": workers + spares,
                   "step_time_s": round(statistics.fmean(p["step_time_s"] for p in per), 5),
                   "ratio_vs_none": None, "ratio_min": None, "ratio_max": None,
                   "window_s": round(statistics.fmean(p["window_s"] for p in done), 3) if done else None,
                   "lost_per_failure_s": round(statistics.fmean(lost), 3) if lost else None,
                   "lost_min": round(min(lost), 3) if lost else None,
                   "lost_max": round(max(lost), 3) if lost else None}
            for k in ("detect_s", "recover_s", "recompute_s"):
                xs = [p[k] for p in per if p[k] is not None]
                row[k] = round(statistics.fmean(xs), 3) if xs else None
            row["steps_recomputed"] = round(statistics.fmean(p["steps_recomputed"] for p in per), 2)
            row["goodput"] = round(statistics.fmean(p["goodput"] for p in per), 3)
            row["goodput_per_gpu_held"] = round(row["goodput"] * workers / row["gpus_held"], 3)
            if sched == "free":
                ratios = [rd[strategy] / rd["none"] for rd in rounds if strategy in rd and "none" in rd]
                row["ratio_vs_none"] = round(statistics.median(ratios), 3)
                row["ratio_min"], row["ratio_max"] = round(min(ratios), 3), round(max(ratios), 3)
            out.append(row)
    return out


def _measures(r: dict, args, w_free: float | None, t_free: float, t_none: float) -> dict:
    """One run's window, time lost per failure, the runtime's breakdown and goodput."""
    s, rows = r["summary"], r["rows"]
    w = window(rows, args.steps)
    recs = [x for x in s["recoveries"] if x.get("outcome") != "interrupted by another failure"]
    return {"step_time_s": step_time(rows), "window_s": w,
            "lost_per_failure_s": (w - w_free) / r["failures"] if w and w_free and r["failures"] else None,
            "detect_s": sum(x.get("detect_s") or 0 for x in recs) if recs else None,
            "recover_s": sum((x.get("kill_to_first_step_s") or 0) - (x.get("detect_s") or 0)
                             for x in recs) if recs else None,
            "recompute_s": sum((x.get("steps_recomputed") or 0) for x in recs) * t_free if recs else None,
            "steps_recomputed": sum((x.get("steps_recomputed") or 0) for x in recs),
            "goodput": args.steps * t_none / w if w else 0.0}


def print_table(rows: list[dict]) -> None:
    cols = ["schedule", "strategy", "outcome", "repeats", "gpus_held", "ratio_vs_none", "ratio_min",
            "ratio_max", "lost_per_failure_s", "lost_min", "lost_max",
            "detect_s", "recover_s", "recompute_s", "goodput", "goodput_per_gpu_held"]
    w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(w[c]) for c in cols))
    for r in rows:
        print("  ".join(str("-" if r[c] is None else r[c]).ljust(w[c]) for c in cols))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--kills", type=int, nargs="+", default=[32, 76], help="steps of the kills")
    ap.add_argument("--free_rounds", type=int, default=3,
                    help="failure-free rounds, strategies interleaved (ratio: median over rounds)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each failure schedule, strategies interleaved (table: means over them)")
    ap.add_argument("--spares", type=int, default=2)
    ap.add_argument("--ckpt_every", type=int, default=10, help="checkpoint_restart's interval (steps)")
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    ap.add_argument("--schedules", nargs="+", default=["free", "kills", "burst"])
    ap.add_argument("--world_sizes", type=int, nargs="*", default=[2, 3],
                    help="extra data-parallel widths for deadpool and checkpoint_restart, one kill")
    ap.add_argument("--out", default="experiments/results/runtime/strategies")
    args = ap.parse_args(argv)
    if "free" not in args.schedules or "none" not in args.strategies:
        ap.error("the table is relative to ft=none's failure-free run: keep 'free' and 'none'")
    out = Path(args.out)
    results: dict[str, dict] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="deadpool-strategies-") as tmp:
        tmp = Path(tmp)
        free_rounds: list[dict] = []
        for k in range(max(1, args.free_rounds)):
            order = args.strategies[k % len(args.strategies):] + args.strategies[:k % len(args.strategies)]
            print(f"free round {k + 1}/{args.free_rounds}: {' '.join(order)}", flush=True)
            got = {}
            for strategy in order:
                dest = out / "free" if k == 0 else out / "free" / f"rep{k}"
                got[strategy] = run_one(strategy, "free", args, args.dp, tmp / f"r{k}", dest)
            free_rounds.append(got)
        results["free"] = {k: [r[k] for r in free_rounds] for k in free_rounds[0]}
        scheds = [x for x in args.schedules if x != "free"]
        for k in range(max(1, args.repeats)):
            order = args.strategies[k % len(args.strategies):] + args.strategies[:k % len(args.strategies)]
            if scheds:
                print(f"failure round {k + 1}/{args.repeats}: {' '.join(order)}", flush=True)
            for sched in scheds:
                for strategy in order:
                    if strategy == "none" and (k or sched != scheds[0]):
                        continue  # one failed ft=none run says it all
                    dest = out / sched if k == 0 else out / sched / f"rep{k}"
                    r = run_one(strategy, sched, args, args.dp, tmp / f"f{k}", dest)
                    results.setdefault(sched, {}).setdefault(strategy, []).append(r)
        for dp in args.world_sizes:
            one = argparse.Namespace(**{**vars(args), "kills": [args.kills[0]]})
            for strategy in ("deadpool", "checkpoint_restart"):
                rd = tmp / f"scale{dp}" / strategy
                ev = [{"rank": 1, "step": args.kills[0], "phase": "mid_step", "kind": "kill"}]
                s = run(overrides(strategy, one, dp) + [fmt_events(ev)], rd)
                keep(rd, out / "scale" / f"dp{dp}" / strategy, "",
                     files=("summary.json", "metrics.jsonl", "job.json"))
                print(f"  scale  {strategy:19s} dp={dp} {s['outcome']}", flush=True)
    rows = table_rows(results, free_rounds, args)
    print_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print(f"wrote {out / 'table.csv'} and the run directories under {out} "
          f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
