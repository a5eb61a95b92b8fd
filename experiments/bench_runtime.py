"""Runtime benchmark: snapshot overhead and hot-swap recovery time, measured side by side.

    python experiments/bench_runtime.py [--pairs 3] [--steps 40] [--kills 5] [--out experiments/results/runtime/bench]

1. Failure-free step time with snapshots on vs off, 2 workers: first inside one run, snapshots
   taken in alternating blocks of steps (the primary figure: both arms share the process and the
   moment, so host noise cancels), then ``--pairs`` interleaved pairs of whole runs (on, off, ...).
   Prints the ratio of median step times (target <= 1.05 on a 2-core machine) and the main
   thread's blocked time per step.
2. Recovery: one 4-worker job with ``--kills`` warm spares and as many SIGKILLs (mid-step, different
   ranks). Prints kill -> all ranks training again (target <= 1 s) and kill -> first step completed
   (target <= 2 s): median and range. The final state is checked against a failure-free run.
3. Hard cases: a second kill while the first swap is transferring (first kill -> first step), and
   a hung training thread with a live heartbeat (hang -> first step, via the progress watchdog).

Writes each run's summary.json and metrics.jsonl under ``--out`` for paper_figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.launch.config import compose_config  # noqa: E402
from deadpool.launch.job import run_job  # noqa: E402
from deadpool.launch.report import compare_final_states  # noqa: E402

from experiments.common import keep, quiet  # noqa: E402


def step_times(run_dir: Path, skip: int) -> list[float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if r["step"] > skip]


def blocked(run_dir: Path, skip: int) -> list[float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["snapshot_blocked_s"] for r in rows if r["step"] > skip]


def in_run_ab(args, tmp: Path, out: Path) -> None:
    """Snapshots on and off in alternating blocks of steps inside one run: the two arms share the
    process, the data and the moment, so host noise cancels far better than across runs."""
    block = args.ab_block
    base = [f"model={args.model}", "parallel=dp2", f"num_steps={args.ab_steps}", "ft.num_spares=0",
            "faults=none", "log_every_steps=0", f"batch_size={args.batch_size}",
            f"seq_len={args.seq_len}", f"ft.snapshot_ab_block_steps={block}",
            f"ft.snapshot_nice={args.nice}"]
    rd = tmp / "overhead_ab"
    s = run_job(compose_config(base, rd), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    keep(rd, out, "overhead_ab")
    rows = [json.loads(l) for l in (rd / "metrics.jsonl").read_text().splitlines()]
    blocks: dict[int, list[float]] = {}
    blk = []
    for r in rows:
        k = r["step"] - 1  # the snapshot taken after step k is copied/replicated during step k + 1
        if k < block or k % block == 0:  # warm-up block, and the first step of each block (carry-over)
            continue
        blocks.setdefault(k // block, []).append(r["step_time_s"])
        if (k // block) % 2 == 0:
            blk.append(r["snapshot_blocked_s"])
    # pair each on-block with the off-block right after it: slow drift of the host cancels
    pairs = [statistics.median(blocks[b]) / statistics.median(blocks[b + 1])
             for b in sorted(blocks) if b % 2 == 0 and b + 1 in blocks]
    on = [t for b, ts in blocks.items() if b % 2 == 0 for t in ts]
    off = [t for b, ts in blocks.items() if b % 2 == 1 for t in ts]
    q = statistics.quantiles(pairs, n=4)
    ratio = statistics.median(pairs)
    print(f"in-run A/B ({args.ab_steps} steps, blocks of {block}, 2 workers, {args.model}, nice {args.nice}, "
          f"{args.batch_size}x{args.seq_len} tokens/rank/step, {s['state_bytes_per_rank'] / 2**20:.1f} MiB "
          f"state/rank):\n  median step on {statistics.median(on) * 1e3:.1f} ms, off "
          f"{statistics.median(off) * 1e3:.1f} ms; step-time ratio on/off, median of {len(pairs)} adjacent "
          f"block pairs: {ratio:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}; target <= 1.05)")
    print(f"  main-thread blocked per snapshot step: median {statistics.median(blk) * 1e3:.3f} ms, "
          f"max {max(blk) * 1e3:.2f} ms")


def overhead(args, tmp: Path, out: Path) -> None:
    base = [f"model={args.model}", "parallel=dp2", f"num_steps={args.steps}", "ft.num_spares=0",
            "faults=none", "log_every_steps=0", f"batch_size={args.batch_size}",
            f"seq_len={args.seq_len}", f"ft.snapshot_nice={args.nice}"]
    med = {True: [], False: []}
    blk = []
    for i in range(args.pairs):
        for on in (True, False):
            rd = tmp / f"overhead_{i}_{'on' if on else 'off'}"
            s = run_job(compose_config(base + [f"ft.snapshot={str(on).lower()}"], rd), log=quiet)
            assert s["outcome"] == "completed", s["message"]
            ts = step_times(rd, skip=3)
            med[on].append(statistics.median(ts))
            if on:
                blk += blocked(rd, skip=3)
                keep(rd, out, f"overhead_on_{i}")
            print(f"  pair {i}: snapshots {'on ' if on else 'off'}  median step "
                  f"{med[on][-1] * 1e3:7.1f} ms  (state {s['state_bytes_per_rank'] / 2**20:.1f} MiB/rank)",
                  flush=True)
    ratio = statistics.median(med[True]) / statistics.median(med[False])
    per_pair = [a / b for a, b in zip(med[True], med[False])]
    print(f"\nfailure-free step-time ratio snapshots on/off (2 workers, {args.model}): {ratio:.3f} "
          f"(per pair {', '.join(f'{r:.3f}' for r in per_pair)}; target <= 1.05)")
    print(f"main-thread blocked time per step: median {statistics.median(blk) * 1e3:.3f} ms, "
          f"max {max(blk) * 1e3:.3f} ms\n")


def recovery(args, tmp: Path, out: Path) -> None:
    n = args.kills
    first, gap = 6, max(4, (args.steps - 8) // n)
    events = [{"rank": i % 4, "step": first + i * gap, "phase": "mid_step", "kind": "kill"} for i in range(n)]
    steps = first + n * gap + 4
    base = ["model=tiny", "parallel=dp4", f"num_steps={steps}", f"ft.num_spares={n}",
            "log_every_steps=0"]
    ev = "[" + ",".join("{rank:%d,step:%d,phase:mid_step,kind:kill}" % (e["rank"], e["step"])
                        for e in events) + "]"
    rd = tmp / "recovery"
    s = run_job(compose_config(base + [f"faults.events={ev}"], rd), log=quiet)
    keep(rd, out, "recovery")
    ref = tmp / "recovery_ref"
    run_job(compose_config(base + ["faults=none", "ft.num_spares=0"], ref), log=quiet)
    equal, why = compare_final_states(rd, ref)
    recs = [r for r in s["recoveries"] if r.get("outcome") == "hot-swapped"]
    print(f"recovery over {len(recs)} SIGKILLs ({s['outcome']}; 4 workers + {n} warm spares, tiny model):")
    for key, target in (("detect_s", None), ("kill_to_training_s", 1.0), ("kill_to_first_step_s", 2.0),
                        ("kill_to_protected_s", None)):
        xs = [r[key] for r in recs if r.get(key) is not None]
        if xs:
            t = f" (target <= {target:.0f} s)" if target else ""
            print(f"  {key[:-2].replace('_', ' '):24s} median {statistics.median(xs):.3f} s  "
                  f"range {min(xs):.3f} - {max(xs):.3f} s{t}")
    parts = ["detect_s", "plan_s", "rebuild_s", "transfer_s", "rollback_s", "first_step_s"]
    print("  breakdown (median ms): " + "  ".join(
        f"{p[:-2]} {statistics.median([r[p] for r in recs]) * 1e3:.0f}" for p in parts))
    print(f"  final state vs failure-free run: {'EQUAL' if equal else 'DIFFERENT'} ({why})")


def hard_cases(args, tmp: Path, out: Path) -> None:
    """A failure during a recovery (the receiving spare killed while the state is transferred)
    and a hung training thread whose heartbeat lives (found by the progress watchdog)."""
    base = ["model=tiny", "parallel=dp4", "num_steps=24", "log_every_steps=0",
            f"ft.progress_timeout_s={args.progress_timeout}"]
    cases = {
        "kill_during_recovery": ["ft.num_spares=2", "faults.events=[{rank:1,step:12,phase:mid_step,"
                                 "kind:kill},{slot:4,step:12,phase:transfer,kind:kill}]"],
        "hung_training_thread": ["ft.num_spares=1", "faults.events=[{rank:2,step:12,phase:backward,"
                                 "kind:hang}]"],
    }
    ref = tmp / "hard_ref"
    run_job(compose_config(base + ["faults=none", "ft.num_spares=0"], ref), log=quiet)
    for name, over in cases.items():
        rd = tmp / name
        s = run_job(compose_config(base + over, rd), log=quiet)
        keep(rd, out, name)
        equal, _ = compare_final_states(rd, ref) if s["outcome"] == "completed" else (False, "")
        last = s["recoveries"][-1] if s["recoveries"] else {}
        first_fault = last.get("first_kill_to_first_step_s", last.get("kill_to_first_step_s"))
        print(f"{name}: {s['outcome']}, {len(s['recoveries'])} recoveries "
              f"({', '.join(str(r.get('outcome')) for r in s['recoveries'])}); "
              f"first fault -> first step {first_fault if first_fault is None else f'{first_fault:.3f} s'}"
              f" (detected by {last.get('detected_by')}, detect {last.get('detect_s', 0):.3f} s); "
              f"final state {'EQUAL' if equal else 'DIFFERENT'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2, help="interleaved on/off pairs of runs")
    ap.add_argument("--ab-steps", type=int, default=160, help="steps of the in-run A/B run")
    ap.add_argument("--ab-block", type=int, default=4, help="steps per on/off block in the A/B run")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--model", default="small")
    ap.add_argument("--nice", type=int, default=19, help="ft.snapshot_nice of the snapshot threads")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--progress-timeout", type=float, default=2.0,
                    help="ft.progress_timeout_s for the hung-thread case")
    ap.add_argument("--skip", choices=["overhead", "recovery"], default=None)
    ap.add_argument("--out", default="experiments/results/runtime/bench")
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="deadpool-bench-") as tmp:
        if args.skip != "overhead":
            in_run_ab(args, Path(tmp), out)
            if args.pairs:
                overhead(args, Path(tmp), out)
        if args.skip != "recovery":
            recovery(args, Path(tmp), out)
            hard_cases(args, Path(tmp), out)
    print(f"\nbenchmark wall time {time.time() - t0:.0f} s; run summaries in {out}/")


if __name__ == "__main__":
    main()
