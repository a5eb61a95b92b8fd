"""The end of a job at dp4: bytes its final state writes, and how long each rank takes.

    python experiments/bench_final_write.py --label new [--model tiny] [--set model.d_model=512 ...]

Runs a failure-free job (ZeRO-1, fp32, no snapshots, 2 steps) at dp4 from the current directory's
``deadpool`` (run it from an older checkout, with this file's path, to measure the code of
before: the workers are started from that directory), then reads back ``<run>/final``: the bytes
of every file under it, and each rank's "final state ... in T s" log line (its write, from the
job's done flag to its record: digest, host copy, files, fsync). The job's end takes the slowest
rank's time, all ranks writing at once. Expectation: before issue 37 every rank wrote its whole
state (fp32 ZeRO-1 at dp4: 4 B/param parameters + 3 B/param of its moments and master view),
about 4 x 7 = 28 B/param in all, the slowest rank 7; with the final state one checkpoint of
unique state, spread, 4 + 4 x 3 = 16 B/param, each rank 1 + 3 = 4.
Prints one JSON row; ``--out FILE`` appends it there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the checkout being measured, not this file's

from deadpool.launch.config import compose_config  # noqa: E402
from deadpool.launch.job import run_job  # noqa: E402

WRITE_LINE = re.compile(r"\[rank (\d+)\] final state.* in ([0-9.]+) s")


def measure(label: str, model: str, sets: list[str], steps: int, work: Path) -> dict:
    run = work / "run"
    os.environ["PYTHONPATH"] = os.getcwd()  # the workers import the same checkout
    cfg = compose_config([f"model={model}", *sets, "parallel=dp4", "ft=none", "ft.snapshot=false",
                          f"num_steps={steps}", "log_every_steps=0"], run)
    t0 = time.perf_counter()
    s = run_job(cfg, log=lambda *a, **k: None)
    wall = time.perf_counter() - t0
    assert s["outcome"] == "completed", s["message"]
    times = {}
    for log in (run / "logs").glob("slot*.log"):
        for m in WRITE_LINE.finditer(log.read_text()):
            times[int(m.group(1))] = float(m.group(2))
    files = [f for f in (run / "final").rglob("*") if f.is_file()]
    per_rank: dict[str, int] = {}
    for f in files:  # final/rank<r>.pt (before) or final/step_<S>/rank_<r>/... (now)
        m = re.search(r"rank_?(\d+)", str(f.relative_to(run / "final")))
        if m:
            per_rank[m.group(1)] = per_rank.get(m.group(1), 0) + f.stat().st_size
    return {"label": label, "model": model, "sets": sets, "model_params": s["model_params"],
            "state_bytes_per_rank": s["state_bytes_per_rank"],
            "final_bytes": sum(f.stat().st_size for f in files),
            "final_bytes_per_rank": per_rank, "write_s_per_rank": times,
            "write_s_slowest": max(times.values()) if times else None, "job_wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True, help="what is measured (e.g. before, after)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--set", action="append", default=[], help="another config override")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", help="a JSON-lines file to append the row to")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(args.label, args.model, args.set, args.steps, Path(tmp))
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
