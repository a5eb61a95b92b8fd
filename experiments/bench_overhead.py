"""Failure-free overhead against stock torch DDP, measured side by side in one invocation.

    python experiments/bench_overhead.py [--repeats 3] [--steps 80] [--settings 2,4+1]
        [--precisions fp32,bf16] [--arms ddp,off,on] [--out experiments/results/runtime/overhead]
    python experiments/bench_overhead.py --quick    # smoke test: 1 repeat, 2 ranks, fp32, 24 steps
    python experiments/bench_overhead.py --settings 4+1 --arms off,on,on2,on1,on1r2  # ft.replicas 1 vs 2
    python experiments/bench_overhead.py --settings 4+1 --arms on1,on1_nocheck  # integrity checks

Arms, on the same model, data, layout, AdamW kernel, decay groups and learning rates, each run
as a whole job:
  ddp   stock ``DistributedDataParallel`` over gloo under torchrun (``ddp_reference.py``; bf16:
        fp32 parameters under ``torch.autocast``, plain PyTorch's recipe)
  off   DeadPool with snapshots off (``ft.snapshot=false``: its ZeRO-1 gradient sync and
        parameter all-gather, watchdog, heartbeats, the spare; ``ft.on_no_spare`` set to the
        choice that needs no snapshot, never used without a failure)
  on    DeadPool with its default settings: snapshots replicated to a buddy, the interval
        widened while they cost more than ``ft.snapshot_overhead_target`` or outlast the steps
        between them (``deadpool/snapshot/schedule.py``; nothing set for the benchmark)
  on1   (optional) a snapshot every step, never widened: the raw per-step cost
  off_ov, on_ov  (optional) off and on with ``parallel.overlap_param_gather=true``: ZeRO-1's
        parameter all-gather posted per bucket and waited by the next forward (parallel/data/zero.py)
  on1_nocheck  (optional) ``on1`` without the silent-corruption comparison and the spike rule
        (``ft.integrity_check=false``, ``ft.spike.rule=off``): on1 / on1_nocheck is their cost
        at a snapshot every step (recovery/integrity.py)
  on2, on1r2  (optional) ``on`` and ``on1`` with ``ft.replicas=2``: every snapshot goes to two
        buddies (needs 3 ranks: run in the ``4+1`` setting only, skipped in ``2``)
in each setting, ``2`` (2 ranks) and ``4+1`` (4 data-parallel ranks and 1 warm spare, which DDP
does not have), and each precision (``fp32``, ``bf16``: bf16 parameters, fp32 master weights and
moments sharded by ZeRO-1). Every repeat runs every (setting, precision) and, inside it, every
arm, in an order that rotates per repeat, so slow drift of the host hits every arm alike.

A run's step time in a window of steps (inclusive, 1-based; default ``early`` 11-29 and
``steady`` 40-79 of 80) is the median over the window's steps of the mean over ranks. Ratios of
two arms are taken per repeat and reported as the median and range over repeats. Also reported:
ZeRO-1's parameter all-gather (``param_gather_s``, median of the steady window, and its share of
the off arm's step: an upper bound on what overlapping it with the next forward could save,
since its wait also holds the ranks' skew), the snapshot interval the schedule settled on, and
the bytes each rank replicates per step (its unique state, under bf16 the fp32 master shard and
moments, per snapshot, times the snapshots per step in the steady window). Writes
``results.json`` (per setting: ``ratios`` of the steady window, what
``paper_figures/fig09_overhead.py`` plots, and ``windows`` with both) and each DeadPool run's
``summary.json`` / ``metrics.jsonl`` under ``--out``.

Default workload: 2-layer decoder, d_model 256, 4 heads, vocab 512, seq 64, batch 8 per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.launch.config import compose_config  # noqa: E402
from experiments.common import keep, metrics, run  # noqa: E402

SETTINGS = {"2": ("dp2", 2, 0), "4+1": ("dp4", 4, 1)}  # name -> (parallel, ranks, spares)
# off: with no snapshots a spare-less failure can only stop (ft.on_no_spare's other choices write
# the state from memory); a failure-free run never reaches it
OVERLAP = ["parallel.overlap_param_gather=true"]
ARM_OVERRIDES = {"off": ["ft.snapshot=false", "ft.on_no_spare=checkpoint_and_stop"], "on": [],
                 "on1": ["ft.snapshot_adaptive=false"], "on2": ["ft.replicas=2"],
                 "on1r2": ["ft.snapshot_adaptive=false", "ft.replicas=2"],
                 "on1_nocheck": ["ft.snapshot_adaptive=false", "ft.integrity_check=false",
                                 "ft.spike.rule=off"]}
ARM_OVERRIDES |= {"off_ov": ARM_OVERRIDES["off"] + OVERLAP, "on_ov": OVERLAP}
MIN_RANKS = {"on2": 3, "on1r2": 3}  # ft.replicas=2 needs two other ranks
RATIOS = {"on/ddp": ("on", "ddp"), "off/ddp": ("off", "ddp"), "on/off": ("on", "off"),
          "on1/ddp": ("on1", "ddp"), "on1/off": ("on1", "off"),
          "off_ov/off": ("off_ov", "off"), "on_ov/on": ("on_ov", "on"),
          "off_ov/ddp": ("off_ov", "ddp"), "on_ov/ddp": ("on_ov", "ddp"), "on2/off": ("on2", "off"),
          "on2/on": ("on2", "on"), "on1r2/off": ("on1r2", "off"), "on1r2/on1": ("on1r2", "on1"),
          "on1/on1_nocheck": ("on1", "on1_nocheck")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def window_step(per_rank: dict[int, list[tuple[int, float]]], lo: int, hi: int) -> float:
    """Median over steps lo..hi (inclusive) of the mean over ranks of the step time."""
    by_step: dict[int, list[float]] = {}
    for rows in per_rank.values():
        for step, t in rows:
            if lo <= step <= hi:
                by_step.setdefault(step, []).append(t)
    return statistics.median(statistics.mean(v) for v in by_step.values())


def run_ddp(cfg: dict, ranks: int, run_dir: Path) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = run_dir / "spec.json"
    spec.write_text(json.dumps(cfg))
    script = Path(__file__).with_name("ddp_reference.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", f"--master-port={free_port()}", str(script),
           "--spec", str(spec), "--out", str(run_dir)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    with open(run_dir / "stderr.txt", "w") as err:
        rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err).returncode
    # torchrun's teardown has been seen to fail after every rank wrote its record: keep those
    if rc and not all((run_dir / f"rank{r}.json").exists() for r in range(ranks)):
        raise RuntimeError(f"DDP reference failed ({rc}): see {run_dir / 'stderr.txt'}")
    per_rank = {}
    for r in range(ranks):
        rec = json.loads((run_dir / f"rank{r}.json").read_text())
        per_rank[r] = list(enumerate(rec["step_time_s"], start=1))
    return {"per_rank": per_rank}


def run_deadpool(overrides: list[str], run_dir: Path) -> dict:
    summary = run(overrides, run_dir)
    assert summary["outcome"] == "completed", summary.get("message")
    rows = metrics(run_dir)
    per_rank: dict[int, list] = {}
    for r in rows:
        per_rank.setdefault(r["rank"], []).append((r["step"], r["step_time_s"]))
    return {"per_rank": per_rank, "rows": rows, "summary": summary}


def details(res: dict, lo: int, hi: int) -> dict:
    """What a DeadPool run did in steps lo..hi: snapshots per step (per rank), the interval in
    force at the end, the median parameter all-gather, bytes replicated per rank per step."""
    rows = [r for r in res["rows"] if lo <= r["step"] <= hi]
    ranks = {r["rank"] for r in rows}
    snaps = sum(bool(r.get("snapshot")) for r in rows) / len(ranks) / (hi - lo + 1)
    gathers = [r["param_gather_s"] for r in rows if r.get("param_gather_s") is not None]
    # the silent-corruption check's time on the training thread (recovery/integrity.py), per step
    # (steps without a snapshot count as 0), and of it the wait for its all-reduce: the slowest
    # peer's arrival, which the next step's collectives would otherwise wait for
    checks = [r.get("integrity_check_s") or 0.0 for r in rows]
    waits = [r.get("integrity_wait_s") or 0.0 for r in rows]
    steps = [r["step_time_s"] for r in rows]
    last = max(rows, key=lambda r: r["step"])
    per_snapshot = res["summary"].get("replicated_bytes_per_rank_per_snapshot") or 0
    return {"snapshots_per_step": snaps, "interval_final": last.get("snapshot_interval"),
            "param_gather_s": statistics.median(gathers) if gathers else None,
            "integrity_check_share": sum(checks) / sum(steps),
            "integrity_wait_share": sum(waits) / sum(steps),
            "bytes_per_snapshot": per_snapshot,
            "bytes_replicated_per_rank_per_step": per_snapshot * snaps}


def spread(v: list[float]) -> str:
    """Median (range); from 5 repeats on also the interquartile range, which one repeat taken
    in a slow patch of the host does not move."""
    text = f"{statistics.median(v):.3f} ({min(v):.3f}-{max(v):.3f}"
    if len(v) >= 5:
        q1, _, q3 = statistics.quantiles(v, n=4)
        text += f"; IQR {q1:.3f}-{q3:.3f}"
    return text + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--early", default="11-29", help="early window, steps lo-hi inclusive")
    ap.add_argument("--steady", default="40-79", help="steady-state window, steps lo-hi inclusive")
    ap.add_argument("--settings", default="2,4+1")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--arms", default="ddp,off,on",
                    help="of ddp, off, on, on1, off_ov, on_ov, on2, on1r2, on1_nocheck")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", default=None, help="default experiments/results/runtime/overhead "
                    "(--quick: a temporary directory)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 2 ranks, fp32, "
                    "24 steps (windows 4-11 and 12-23)")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.steps, args.settings, args.precisions = 1, 24, "2", "fp32"
        args.early, args.steady = "4-11", "12-23"
    out = Path(args.out or (tempfile.mkdtemp(prefix="overhead-quick-") if args.quick
                            else "experiments/results/runtime/overhead"))
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    windows = {w: tuple(int(x) for x in getattr(args, w).split("-")) for w in ("early", "steady")}
    arms = args.arms.split(",")
    configs = [(s, p) for s in args.settings.split(",") for p in args.precisions.split(",")]
    times = {c: {w: {a: [] for a in arms} for w in windows} for c in configs}
    runs: dict = {c: {a: [] for a in arms if a != "ddp"} for c in configs}
    for rep in range(args.repeats):
        for setting, prec in configs:
            parallel, ranks, spares = SETTINGS[setting]
            base = [f"model={args.model}", f"model.d_model={args.d_model}", f"parallel={parallel}",
                    f"num_steps={args.steps}", f"batch_size={args.batch_size}",
                    f"seq_len={args.seq_len}", f"precision={prec}", f"ft.num_spares={spares}",
                    "faults=none", "log_every_steps=0", "ft.persist_interval_steps=0"]
            for arm in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                if ranks < MIN_RANKS.get(arm, 0):
                    continue
                d = tmp / f"{setting}-{prec}-{arm}-{rep}"
                t0 = time.time()
                if arm == "ddp":
                    res = run_ddp(compose_config(base, tmp / "spec"), ranks, d)
                else:
                    res = run_deadpool(base + ARM_OVERRIDES[arm], d)
                    runs[(setting, prec)][arm].append(details(res, *windows["steady"]))
                    keep(d, out, f"{setting}/{prec}/{arm}-{rep}")
                for w, (lo, hi) in windows.items():
                    times[(setting, prec)][w][arm].append(window_step(res["per_rank"], lo, hi))
                print(f"[{setting} {prec}] repeat {rep + 1}/{args.repeats} {arm:3s}: steady "
                      f"{times[(setting, prec)]['steady'][arm][-1] * 1e3:6.1f} ms  "
                      f"({time.time() - t0:.0f} s)", flush=True)
    results = {"args": vars(args) | {"out": str(out)}, "windows": windows, "settings": {}}
    for (setting, prec), by_window in times.items():
        _, ranks, spares = SETTINGS[setting]
        ratios = {w: {k: [a / b for a, b in zip(t[x], t[y])] for k, (x, y) in RATIOS.items()
                      if t.get(x) and t.get(y)} for w, t in by_window.items()}
        entry = {"ranks": ranks, "spares": spares, "precision": prec,
                 "step_time_s": by_window["steady"], "ratios": ratios["steady"],
                 "windows": {w: {"steps": windows[w], "step_time_s": by_window[w],
                                 "ratios": ratios[w]} for w in windows},
                 "runs": runs[(setting, prec)]}
        if "off" in entry["runs"]:  # what overlapping the all-gather could save, at most
            entry["param_gather_share_of_off_step"] = [
                d["param_gather_s"] / t for d, t in zip(entry["runs"]["off"],
                                                        by_window["steady"]["off"])]
        results["settings"][f"{setting} {prec}"] = entry
        report(entry, windows, args.repeats)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {out}")


def report(entry: dict, windows: dict, repeats: int) -> None:
    print(f"\n== {entry['ranks']} ranks + {entry['spares']} spare(s), {entry['precision']}, "
          f"{repeats} interleaved repeats: step time ratio, median (range over repeats; from 5, IQR)")
    for w, (lo, hi) in windows.items():
        ew = entry["windows"][w]
        cells = "  ".join(f"{k} {spread(v)}" for k, v in ew["ratios"].items())
        ms = "  ".join(f"{a} {statistics.median(v) * 1e3:.1f}"
                       for a, v in ew["step_time_s"].items() if v)
        print(f"  {w:6s} steps {lo}-{hi}: {cells}\n    median step ms: {ms}")
    for arm, ds in entry["runs"].items():
        if not ds:
            continue
        g = [d["param_gather_s"] for d in ds if d["param_gather_s"] is not None]
        line = f"  {arm:6s} steady:"
        if g:
            line += f" parameter all-gather {statistics.median(g) * 1e3:.2f} ms"
        if arm == "off" and "param_gather_share_of_off_step" in entry:
            line += f" ({spread(entry['param_gather_share_of_off_step'])} of the step)"
        if not arm.startswith("off") and "nocheck" not in arm:
            own = [(d["integrity_check_share"] - d["integrity_wait_share"]) * 100 for d in ds]
            line += (", silent-corruption check on the training thread "
                     f"{spread([d['integrity_check_share'] * 100 for d in ds])} % of the step, "
                     f"of which its own work (not waiting for the peers' all-reduce) {spread(own)} %")
        if not arm.startswith("off"):
            per_step = statistics.median(d["bytes_replicated_per_rank_per_step"] for d in ds)
            line += (f", interval settled {[d['interval_final'] for d in ds]}, "
                     f"{statistics.median(d['snapshots_per_step'] for d in ds):.3f} snapshots "
                     f"per step, replicated per rank per step {per_step / 1e6:.3f} MB "
                     f"({ds[0]['bytes_per_snapshot'] / 1e6:.3f} MB per snapshot)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
