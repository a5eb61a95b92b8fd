"""Fault campaign: seeded random faults at every phase of training and of recovery, each trial
checked against a failure-free run of the same seed.

    python experiments/fault_campaign.py [--trials 50] [--seed 0] [--spares 2] [--steps 24]
                                         [--out experiments/results/runtime/campaign]
                                         [--override KEY=VALUE ...] [--parallel dp4]
                                         [--only 19 ...] [--keep DIR]

``--parallel`` picks the layout (default dp4; e.g. ``dp2_tp2_pp2 --override
parallel.microbatches=4``: faults then target its 8 ranks). ``--only`` runs the named trials of
the same draw (the faults of trial i do not depend on which trials run); ``--keep`` keeps every
run directory (logs, summaries, checkpoints) under DIR.

Each trial draws one to three faults: a kind (SIGKILL, SIGSTOP, exception, a training-thread hang
with the heartbeat alive, corrupted replica bytes), a target (a rank, or a warm spare's launch
slot), a step and a phase (forward, backward, all-reduce, optimizer step, snapshot copy,
replication, or a phase of a recovery: status, rebuild, transfer, rollback, replication
restart; idle for a spare). Every trial must end one of the documented ways:

    completed            final state bitwise equal (torch.equal) to the failure-free run
    checkpoint_and_stop  more failures than spares: the consistent state was written to disk;
                         the trial resumes from it with spares and must then end bitwise equal
    unrecoverable        only if some rank's every copy was lost (the message says which)

and leave no process behind, within a watchdog (``--trial_timeout_s``). Prints a table and writes
``trials.csv`` (one row per trial) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.launch.config import compose_config  # noqa: E402
from deadpool.launch.job import run_job  # noqa: E402
from deadpool.launch.launcher import job_processes  # noqa: E402
from deadpool.launch.report import compare_final_states  # noqa: E402

quiet = lambda *a, **k: None  # noqa: E731
TRAIN = ["forward", "backward", "mid_step", "allreduce", "optimizer", "snapshot_copy", "replication"]
RECOVERY = ["status", "rebuild", "transfer", "rollback", "repl_restart"]
KINDS = ["kill", "kill", "stop", "exception", "hang", "corrupt"]


def draw_fault(rng: random.Random, steps: int, spares: int, world: int = 4) -> dict:
    kind = rng.choice(KINDS)
    step = rng.randrange(1, steps - 2)
    if kind == "corrupt":  # replicas (in a snapshot thread or a recovery; in the step it is a
        # parameter bit: recovery.integrity); they exist from step 1 and matter when used
        return {"rank": rng.randrange(world), "step": step, "phase": rng.choice(["snapshot_copy", "status"]),
                "kind": kind}
    if rng.random() < 0.25:  # a warm spare: idle, or while it takes over a rank
        slot = world + rng.randrange(spares)
        phase = rng.choice(["idle"] + RECOVERY[1:])
        return {"slot": slot, "step": step if phase == "idle" else 0, "phase": phase, "kind": kind}
    if rng.random() < 0.35:  # a survivor during a recovery (fires at the first one, if any)
        return {"rank": rng.randrange(world), "step": 0, "phase": rng.choice(RECOVERY), "kind": kind}
    return {"rank": rng.randrange(world), "step": step, "phase": rng.choice(TRAIN), "kind": kind}


def fmt(ev: dict) -> str:
    who = f"rank:{ev['rank']}" if "rank" in ev else f"slot:{ev['slot']}"
    return "{%s,step:%d,phase:%s,kind:%s}" % (who, ev["step"], ev["phase"], ev["kind"])


def run_bounded(cfg: dict, timeout_s: float) -> dict | None:
    """run_job in a thread; None if it did not finish in time (a hang)."""
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("s", run_job(cfg, log=quiet)), daemon=True)
    t.start()
    t.join(timeout_s)
    return box.get("s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spares", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--trial_timeout_s", type=float, default=240)
    ap.add_argument("--out", default="experiments/results/runtime/campaign")
    ap.add_argument("--override", nargs="*", default=[],
                    help="config overrides for every run, e.g. launcher.fork_workers=true")
    ap.add_argument("--parallel", default="dp4", help="the layout (conf/parallel), e.g. dp2_tp2_pp2")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="run these trials only")
    ap.add_argument("--keep", default=None, help="keep the run directories under this directory")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = ["model=tiny", f"parallel={args.parallel}", f"num_steps={args.steps}", "log_every_steps=0",
            "ft.replication_chunk_mb=0.5", "ft.progress_timeout_s=3", "ft.status_timeout_s=4",
            "ft.persist_interval_steps=4", "ft.on_no_spare=checkpoint_and_stop", *args.override]
    par = compose_config(base, "unused")["parallel"]  # (composing writes nothing)
    world = int(par["dp"]) * int(par["tp"]) * int(par["pp"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="deadpool-campaign-") as scratch:
        tmp = args.keep or scratch
        ref = Path(tmp) / "ref"
        run_job(compose_config(base + ["faults=none", "ft.num_spares=0"], ref), log=quiet)
        for i in range(args.trials):
            evs = [draw_fault(rng, args.steps, args.spares, world) for _ in range(rng.randint(1, 3))]
            if args.only is not None and i not in args.only:
                continue
            rd = Path(tmp) / f"t{i}"
            over = base + [f"ft.num_spares={args.spares}", "faults.events=[" + ",".join(map(fmt, evs)) + "]"]
            t0 = time.time()
            s = run_bounded(compose_config(over, rd), args.trial_timeout_s)
            hang = s is None
            outcome = "HANG" if hang else s["outcome"]
            verdict, why = "FAIL", ""
            if hang:
                why = "no outcome within the watchdog"
            elif outcome == "completed":
                ok, why = compare_final_states(rd, ref)
                verdict = "equal" if ok else "FAIL"
            elif outcome == "checkpoint_and_stop":  # resume from what was written, with spares
                rs = Path(tmp) / f"t{i}-resume"
                s2 = run_bounded(compose_config(base + ["faults=none", f"ft.num_spares={args.spares}",
                                                        f"ft.resume_from={rd / 'checkpoints'}"], rs),
                                 args.trial_timeout_s)
                ok, why = (compare_final_states(rs, ref) if s2 and s2["outcome"] == "completed" else
                           (False, "resume: " + (f"{s2['outcome']}: {s2['message']}" if s2 else
                                                 "no outcome within the watchdog")))
                verdict = "resumed equal" if ok else "FAIL"
            elif outcome == "unrecoverable":
                verdict, why = "documented stop", s["message"]
            time.sleep(1.0)
            left = job_processes(rd)
            if left:
                verdict, why = "FAIL", f"processes left behind: {left}"
            recs = [] if hang else s["recoveries"]
            row = {"trial": i, "faults": " ".join(map(fmt, evs)), "outcome": outcome,
                   "recoveries": len(recs),
                   "interrupted": sum(r.get("outcome") == "interrupted by another failure" for r in recs),
                   "detected_by": "/".join(sorted({str(r.get("detected_by")) for r in recs})),
                   "verdict": verdict, "leftover_processes": len(left), "wall_s": round(time.time() - t0, 1),
                   "note": why[:300]}
            rows.append(row)
            print(f"{i:3d} {verdict:15s} {outcome:20s} rec={row['recoveries']} "
                  f"({row['detected_by']})  {row['wall_s']:5.1f}s  {row['faults']}"
                  + (f"\n      {why}" if verdict == "FAIL" else ""), flush=True)
    with open(out / "trials.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    print("\nverdict            trials")
    for k, v in sorted(counts.items()):
        print(f"{k:18s} {v}")
    fails = counts.get("FAIL", 0)
    print(f"\n{len(rows) - fails}/{len(rows)} trials ended as documented; "
          f"{sum(r['outcome'] == 'HANG' for r in rows)} hangs; "
          f"{sum(r['leftover_processes'] for r in rows)} leftover processes  ({out / 'trials.csv'})")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
