"""Soak test: seeded random faults (kill / stop / exception at random ranks, steps and phases),
several per job, each job checked bitwise against a failure-free run of the same seed.

    python experiments/soak_runtime.py [--jobs 3] [--faults 4] [--steps 40] [--seed 0]

Not part of the test suite (minutes of CPU); run it after touching the recovery protocol.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.launch.config import compose_config  # noqa: E402
from deadpool.launch.job import run_job  # noqa: E402
from deadpool.launch.report import compare_final_states  # noqa: E402

quiet = lambda *a, **k: None  # noqa: E731


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--faults", type=int, default=4, help="faults per job (as many warm spares)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    base = ["model=tiny", "parallel=dp4", f"num_steps={args.steps}", "log_every_steps=0",
            "ft.replication_chunk_mb=0.5"]
    failures = 0
    with tempfile.TemporaryDirectory(prefix="deadpool-soak-") as tmp:
        ref = Path(tmp) / "ref"
        run_job(compose_config(base + ["faults=none", "ft.num_spares=0"], ref), log=quiet)
        for j in range(args.jobs):
            steps = sorted(rng.sample(range(2, args.steps - 1), args.faults))
            evs = [(rng.randrange(4), s, rng.choice(["step_start", "mid_step", "replication"]),
                    rng.choice(["kill", "kill", "stop", "exception"])) for s in steps]
            ev = "[" + ",".join("{rank:%d,step:%d,phase:%s,kind:%s}" % e for e in evs) + "]"
            rd = Path(tmp) / f"job{j}"
            s = run_job(compose_config(base + [f"ft.num_spares={args.faults}", f"faults.events={ev}"], rd),
                        log=quiet)
            equal, why = compare_final_states(rd, ref) if s["outcome"] == "completed" else (False, s["message"])
            outcomes = [r.get("outcome") for r in s["recoveries"]]
            print(f"job {j}: faults {evs}\n  outcome {s['outcome']}, recoveries {outcomes}, "
                  f"final state {'EQUAL' if equal else 'DIFFERENT: ' + why}", flush=True)
            failures += not equal
    print(f"{args.jobs - failures}/{args.jobs} jobs ended bitwise equal to the failure-free run")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
