"""Failure-free overhead against stock torch DDP, measured side by side in one invocation.

    python experiments/bench_overhead.py [--repeats 3] [--steps 30] [--settings 2,4+1]
        [--out experiments/results/runtime/overhead]

Four arms on the same model, data, layout and AdamW kernel, run as whole jobs:
  ddp   stock ``DistributedDataParallel`` over gloo under torchrun (``ddp_reference.py``)
  off   DeadPool with snapshots off (its gradient sync, watchdog, heartbeats, spare)
  on    DeadPool as configured by default: snapshots replicated to a buddy, the interval widened
        from every step while they cost more than ``ft.snapshot_overhead_target`` (2 %) or
        outlast the steps between them (``deadpool/snapshot/schedule.py``; probes every 8 steps here, not
        64, so it settles within the run: the vote of step 16 takes effect at step 32)
  on1   DeadPool with a snapshot every step, never widened: the raw per-step cost
in each setting: ``2`` (2 ranks) and ``4+1`` (4 data-parallel ranks and 1 warm spare, which DDP
does not have). Arms are interleaved (the order rotates every repeat), so slow drift of the host
hits every arm alike. A run's step time is the median over steps after ``--skip`` (by then the
interval has settled) of the mean over ranks; the ratio of two arms is taken per repeat and reported as the median with its range.

Also printed per setting: the bytes each rank replicates per step (its ZeRO-1 shard times the
share of steps that were snapshotted) and the effective protection lag (how many steps behind
the newest step the newest step replicated by every rank is, median and max), with the snapshot
interval the back-pressure settled on. Writes ``results.json`` and each run's files under
``--out``.

Default workload (the one a new user tried in the overhead issue): 2-layer decoder, d_model 256,
4 heads, vocab 512, seq 64, batch 8 per rank.
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

from deadpool.train import compose_config  # noqa: E402
from experiments.common import keep, metrics, run  # noqa: E402

SETTINGS = {"2": ("dp2", 2, 0), "4+1": ("dp4", 4, 1)}  # name -> (parallel, ranks, spares)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_step(per_rank: dict[int, list[tuple[int, float]]], skip: int) -> float:
    """Median over steps > skip of the mean over ranks of the step time."""
    by_step: dict[int, list[float]] = {}
    for rows in per_rank.values():
        for step, t in rows:
            if step > skip:
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
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def protection(rows: list[dict], skip: int, num_steps: int) -> dict:
    """Bytes replicated per rank per step and the effective protection lag (steps)."""
    lag_by_step: dict[int, int] = {}
    snaps: dict[int, int] = {}
    for r in rows:
        if r["step"] > skip and r.get("protection_lag_steps") is not None:
            lag_by_step[r["step"]] = max(lag_by_step.get(r["step"], 0), r["protection_lag_steps"])
        if r["step"] > skip:
            snaps[r["rank"]] = snaps.get(r["rank"], 0) + bool(r.get("snapshot"))
    intervals = [r["snapshot_interval"] for r in rows
                 if r["step"] > skip and r.get("snapshot_interval")]
    lags = list(lag_by_step.values())
    return {"snapshots_per_step": statistics.mean(snaps.values()) / (num_steps - skip)
            if snaps else 0.0,
            "lag_median": statistics.median(lags) if lags else None,
            "lag_max": max(lags) if lags else None,
            "interval_final": intervals[-1] if intervals else None,
            "interval_max": max(intervals) if intervals else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--skip", type=int, default=32, help="steps left out of the medians (warm-up, "
                    "the interval settling)")
    ap.add_argument("--settings", default="2,4+1")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--extra", nargs="*", default=[], help="more DeadPool overrides (every arm)")
    ap.add_argument("--out", default="experiments/results/runtime/overhead")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    results = {"args": vars(args), "settings": {}}
    for name in args.settings.split(","):
        parallel, ranks, spares = SETTINGS[name]
        base = [f"model={args.model}", f"model.d_model={args.d_model}", f"parallel={parallel}",
                f"num_steps={args.steps}", f"batch_size={args.batch_size}",
                f"seq_len={args.seq_len}", f"ft.num_spares={spares}", "faults=none",
                "log_every_steps=0", "ft.persist_interval_steps=0", *args.extra]
        cfg = compose_config(base, tmp / "spec")
        arms = {"ddp": lambda d: run_ddp(cfg, ranks, d),
                "off": lambda d: run_deadpool(base + ["ft.snapshot=false"], d),
                "on": lambda d: run_deadpool(base + ["ft.snapshot_probe_every_steps=8"], d),
                "on1": lambda d: run_deadpool(base + ["ft.snapshot_adaptive=false"], d)}
        order = list(arms)
        times: dict[str, list[float]] = {a: [] for a in arms}
        prot: dict[str, list] = {"on": [], "on1": []}
        for rep in range(args.repeats):
            for arm in order[rep % len(order):] + order[:rep % len(order)]:
                d = tmp / f"{name}-{arm}-{rep}"
                t0 = time.time()
                res = arms[arm](d)
                times[arm].append(median_step(res["per_rank"], args.skip))
                if arm in prot:
                    p = protection(res["rows"], args.skip, args.steps)
                    p["bytes_per_snapshot"] = res["summary"].get(
                        "replicated_bytes_per_rank_per_snapshot") or 0
                    prot[arm].append(p)
                if arm != "ddp":
                    keep(d, out, f"{name}/{arm}-{rep}")
                print(f"[{name}] repeat {rep + 1}/{args.repeats} {arm:3s}: median step "
                      f"{times[arm][-1] * 1e3:6.1f} ms  ({time.time() - t0:.0f} s)", flush=True)
        ratios = {k: [a / b for a, b in zip(times[x], times[y])]
                  for k, (x, y) in {"on/ddp": ("on", "ddp"), "on/off": ("on", "off"),
                                    "off/ddp": ("off", "ddp"), "on1/ddp": ("on1", "ddp"),
                                    "on1/off": ("on1", "off")}.items()}
        res = {"ranks": ranks, "spares": spares, "step_time_s": times, "ratios": ratios,
               "protection": prot}
        results["settings"][name] = res
        print(f"\n== {name}: {ranks} ranks + {spares} spare(s), {args.repeats} interleaved repeats")
        for arm in arms:
            print(f"  {arm:3s} median step {statistics.median(times[arm]) * 1e3:6.1f} ms  "
                  f"(runs {', '.join(f'{t * 1e3:.1f}' for t in times[arm])})")
        for k, v in ratios.items():
            target = {"on/ddp": 1.05, "on/off": 1.02}.get(k)
            tgt = f"   target <= {target}: {'met' if statistics.median(v) <= target else 'NOT met'}" \
                if target else ""
            print(f"  {k:7s} {statistics.median(v):.3f}  [{min(v):.3f}, {max(v):.3f}]{tgt}")
        for arm, ps in prot.items():
            per_step = statistics.median(p["bytes_per_snapshot"] * p["snapshots_per_step"]
                                         for p in ps)
            res[f"bytes_replicated_per_rank_per_step_{arm}"] = per_step
            print(f"  {arm:3s} replicated per rank per step {per_step / 1e6:.2f} MB "
                  f"({ps[0]['bytes_per_snapshot'] / 1e6:.2f} MB per snapshot); protection lag "
                  f"(steps) median {[p['lag_median'] for p in ps]} max {[p['lag_max'] for p in ps]}; "
                  f"interval settled at {[p['interval_final'] for p in ps]}")
        print(flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {out}")


if __name__ == "__main__":
    main()
