"""The benchmark's command line (``experiments/bench_control_plane.py``), ``DIR/table.csv`` and
``DIR/runs.json``."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from experiments.control_plane.common import raise_fd_limit
from experiments.control_plane.measure import run_size

COLUMNS = ["ranks", "protocol", "store_ops_per_s_per_rank", "exit_detect_s", "node_detect_s",
           "plan_everywhere_s", "coordinator_cpu_frac", "detect_to_plan_s", "recovery_store_ops",
           "statuses_in_s", "plan_after_statuses_s", "node_react_ms", "coordinator_recovery_cpu_s",
           "dilation", "survived"]


def write_table(rows: list[dict], out: Path) -> None:
    """``DIR/table.csv``: these rows, and the rows already there for other (ranks, protocol)
    pairs (so sizes run separately, or the new protocol's rows, share one table)."""
    path = out / "table.csv"
    fresh = {(str(r["ranks"]), r["protocol"]): {k: (round(v, 6) if isinstance(v, float) else v)
                                                 for k, v in r.items() if k in COLUMNS}
             for r in rows}
    kept = []
    if path.exists():
        with open(path) as f:
            kept = [r for r in csv.DictReader(f) if (r["ranks"], r["protocol"]) not in fresh]
    table = sorted(kept + list(fresh.values()), key=lambda r: (r["protocol"], int(r["ranks"])))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(table)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Control-plane benchmark: the store protocol with N "
                                 "fake ranks and the real coordinator")
    ap.add_argument("--ranks", default="512,2048,8192,16384")
    ap.add_argument("--out", required=True)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--dilation", default="1", help="1 | auto (N / 256) | one per size: 2,8,...")
    ap.add_argument("--phases", default="steady,exit,node")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0,
                    help="give a size up when plan 0 is not read everywhere by then")
    ap.add_argument("--snapshot-every-s", type=float, default=1.0,
                    help="a training rank replicates a snapshot this often (0: none)")
    ap.add_argument("--protocol", default="new,old",
                    help="old (every process polls the store) | new (node agents) | both")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    if args.dilation == "auto":
        args.dilation_of = {n: max(1.0, n / 256) for n in sizes}
    else:
        ds = [float(x) for x in args.dilation.split(",")]
        if len(ds) not in (1, len(sizes)):
            ap.error("--dilation: one value, auto, or one per size")
        args.dilation_of = dict(zip(sizes, ds * len(sizes) if len(ds) == 1 else ds))
    args.phases = set(args.phases.split(","))
    # one store connection per fake node's follower, plus each thread's, plus slack
    raise_fd_limit(max(sizes) // args.ranks_per_node + 4 * args.procs * args.threads + 1024)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for protocol in args.protocol.split(","):
        run_protocol(protocol, sizes, args, out, rows)


def run_protocol(protocol: str, sizes: list[int], args, out: Path, rows: list[dict]) -> None:
    for n in sizes:
        print(f"[bench] {n} ranks, protocol {protocol}, dilation {args.dilation_of[n]:g}",
              flush=True)
        row = run_size(n, args, protocol)
        rows.append(row)
        print("[bench] " + json.dumps(row), flush=True)
        write_table(rows, out)
        runs = out / "runs.json"
        older = [r for r in (json.loads(runs.read_text()) if runs.exists() else [])
                 if (r["ranks"], r["protocol"]) not in {(x["ranks"], x["protocol"]) for x in rows}]
        runs.write_text(json.dumps(older + rows, indent=1))
        if not row["survived"]:
            print(f"[bench] {n} ranks not survived ({row.get('failed')}); larger sizes not run",
                  flush=True)
            break


