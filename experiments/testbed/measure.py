"""What a multi-host failure costs, measured on the test bed (experiments/testbed/README.md).

    python -m experiments.testbed.measure [--repeats 3] [--out experiments/results/runtime/multihost]

A dp4 job (tiny model, two ranks per host on hosts 0-1, a spare host 2; the defaults a user gets
otherwise) is started as srun would start it, and at step 10 one of:

    host_killed   every process of host 1 SIGKILLed (a node lost, its host up)
    link_down     host 1's link set down (a partition; up again once the job has gone on)
    sigterm       SIGTERM to the coordinator (walltime, preemption)

Measured from outside, on this machine's clock: the fault to the first step any rank finishes in
the next generation (``fault_to_first_step_s``; the ranks stamp their steps with the same
clock), the fault to the last process of host 1 gone (link_down), the signal to the
coordinator's exit with the state on disk (sigterm). Each run also records the runtime's own
breakdown of the recovery. Writes ``results.json`` and prints a table; needs root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

from experiments.testbed.cluster import ClusterJob
from experiments.testbed.netns import TestBed

OVERRIDES = ["model=tiny", "num_steps=40", "parallel.dp=4", "ft.num_spares=2", "seed=7",
             "log_every_steps=5", "launcher.fork_workers=true"]
AT_STEP = 10
KINDS = ("host_killed", "link_down", "sigterm")


def first_step_after(run_dir: Path, generation: int) -> float | None:
    stamps = [r["t"] for f in (run_dir / "metrics").glob("slot*.jsonl")
              for r in map(json.loads, f.read_text().splitlines())
              if r.get("generation", 0) >= generation]
    return min(stamps, default=None)


def one(kind: str, run_dir: Path) -> dict:
    with TestBed(3) as bed, ClusterJob(bed, run_dir, OVERRIDES, ranks_per_node=2).start() as job:
        job.wait_step(AT_STEP, timeout_s=180)
        t_wall, t0 = time.time(), time.monotonic()
        out: dict = {"kind": kind}
        if kind == "host_killed":
            bed.kill_host(1)
        elif kind == "link_down":
            bed.link_down(1)
            while bed.pids(1) and time.monotonic() - t0 < 30:
                time.sleep(0.02)
            out["host_processes_gone_s"] = round(time.monotonic() - t0, 3)
            job.wait_step(AT_STEP + 5, timeout_s=60)
            bed.link_up(1)
        else:
            job.coord.send_signal(signal.SIGTERM)
            job.coord.wait(timeout=120)
            out["signal_to_ended_s"] = round(time.monotonic() - t0, 3)
        summary = job.wait(timeout_s=180)
        out["outcome"] = summary["outcome"]
        t_first = first_step_after(run_dir, 1)
        if kind != "sigterm" and t_first is not None:
            out["fault_to_first_step_s"] = round(t_first - t_wall, 3)
        for rec in summary.get("recoveries", [])[:1]:
            out["runtime"] = {k: rec.get(k) for k in (
                "detected_by", "plan_s", "rebuild_s", "transfer_s", "first_step_s",
                "kill_to_first_step_s")}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--out", default="experiments/results/runtime/multihost")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for r in range(args.repeats):
        for kind in args.kinds.split(","):  # interleaved: a slow patch of the host hits all
            tmp = Path(tempfile.mkdtemp(prefix=f"testbed-{kind}-"))
            try:
                res = one(kind, tmp / "run")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            res["repeat"] = r
            runs.append(res)
            print(f"[measure] repeat {r} {kind}: " + json.dumps(
                {k: v for k, v in res.items() if k not in ("kind", "repeat")}), flush=True)
    (out / "results.json").write_text(json.dumps({"overrides": OVERRIDES, "at_step": AT_STEP,
                                                  "runs": runs}, indent=1))
    print(f"\n{'fault':<12} {'figure':<26} median (range) over {args.repeats}")
    for kind in args.kinds.split(","):
        for key in ("fault_to_first_step_s", "host_processes_gone_s", "signal_to_ended_s"):
            vals = [x[key] for x in runs if x["kind"] == kind and key in x]
            if vals:
                print(f"{kind:<12} {key:<26} {statistics.median(vals):.2f} "
                      f"({min(vals):.2f}-{max(vals):.2f})")
    print(f"written: {out / 'results.json'}")


if __name__ == "__main__":
    main()
