"""False-positive campaign: failure-free runs with every detector on, counting what fired.

    python experiments/false_positive_campaign.py [--runs 50] [--steps 24]
        [--layouts dp4,dp2tp2pp2] [--out experiments/results/runtime/false_positives]
        [--override KEY=VALUE ...]

The detectors a user gets by default (``conf/ft/default.yaml``): stragglers (``ft.straggler``,
under node agents), silent data corruption (``ft.integrity_check``: data-parallel peers compare
parameter checksums at each snapshot), loss / grad-norm spikes (``ft.spike``), and the liveness
watchdogs (heartbeats, progress). Nothing is injected (``faults=none``), so any recovery a run
records is a false positive: its ``detected_by`` is counted. Each run uses its own seed (model
init and data order differ) and the fault campaign's sizes (``experiments/fault_campaign.py``:
dp4, 24 steps, 2 warm spares) with the user's default timeouts; runs alternate over
``--layouts``. The fault campaign's own tightened timeouts (it waits for hangs it injects) are
``--override ft.progress_timeout_s=3 ft.status_timeout_s=4``. The machine's load is printed per run: false positives come from
jitter, so a loaded machine is the harder test. Writes ``runs.csv`` (one row per run) and
prints a summary; exits 1 if anything fired or a run did not complete.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.fault_campaign import run_bounded  # noqa: E402

LAYOUTS = {"dp4": ["parallel=dp4"],
           "dp2tp2pp2": ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2",
                         "parallel.ranks_per_node=2"]}


def main() -> None:
    from deadpool.launch.config import compose_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--layouts", default="dp4,dp2tp2pp2")
    ap.add_argument("--run_timeout_s", type=float, default=240)
    ap.add_argument("--out", default="experiments/results/runtime/false_positives")
    ap.add_argument("--override", nargs="*", default=[])
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            ap.error(f"--layouts: {name!r} is not one of {sorted(LAYOUTS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, fired = [], {}
    with tempfile.TemporaryDirectory(prefix="deadpool-fp-") as tmp:
        for i in range(args.runs):
            layout = layouts[i % len(layouts)]
            over = ["model=tiny", *LAYOUTS[layout], f"num_steps={args.steps}", "log_every_steps=0",
                    f"seed={i}", "faults=none", "ft.num_spares=2", "ft.replication_chunk_mb=0.5",
                    *args.override]
            t0, load = time.time(), os.getloadavg()[0]
            s = run_bounded(compose_config(over, Path(tmp) / f"r{i}"), args.run_timeout_s)
            outcome = "HANG" if s is None else s["outcome"]
            detected = [] if s is None else [str(r.get("detected_by")) for r in s["recoveries"]]
            for d in detected:
                fired[d] = fired.get(d, 0) + 1
            row = {"run": i, "layout": layout, "seed": i, "outcome": outcome,
                   "recoveries": len(detected), "detected_by": "/".join(detected),
                   # liveness suspicions held back (recovery.suspicion): outcomes, "/"-joined
                   "held_back": "" if s is None else "/".join(
                       h["outcome"] for h in s.get("liveness_held_back", [])),
                   "load_1min": round(load, 1), "wall_s": round(time.time() - t0, 1)}
            rows.append(row)
            print(f"{i:3d} {layout:10s} {outcome:10s} recoveries={len(detected)} "
                  f"{row['detected_by'] or '-':20s} held {row['held_back'] or '-':10s} "
                  f"load {load:5.1f}  {row['wall_s']:6.1f}s",
                  flush=True)
    with open(out / "runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    bad = sum(r["outcome"] != "completed" for r in rows)
    print(f"\n{len(rows)} failure-free runs ({', '.join(layouts)}): "
          f"{sum(r['recoveries'] > 0 for r in rows)} with a detection "
          f"({', '.join(f'{k}: {v}' for k, v in sorted(fired.items())) or 'none'}), "
          f"{bad} not completed  (OUT/runs.csv)")
    sys.exit(1 if fired or bad else 0)


if __name__ == "__main__":
    main()
