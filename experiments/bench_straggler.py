"""A straggler handed to a warm spare: how fast the job is again after the migration.

    python experiments/bench_straggler.py [--steps 80] [--slow-at 10] [--slow-frac 0.5]
        [--parallel dp4] [--out experiments/results/runtime/straggler]

Two jobs of the same seed: unslowed (``faults=none``) and with rank 1 sleeping ``slow-frac`` of
the unslowed median step time in every step from ``slow-at`` (fault kind ``slow``). From the
second job's ``recoveries`` (``detected_by: straggler``) and both jobs' metrics it reports the
steps/s of each 10-step window after the migration's resume step relative to the same steps of
the unslowed job, the detection and resume steps, and whether the final states are bitwise equal
(``report.compare_final_states``). The issue's target: >= 0.95 within 10 steps of detection.
Run it on a quiet machine: the figure is a ratio of wall-clock step times (on 2 shared cores
the tests measured noise, ``tests/integration/test_migrate.py`` logs it without asserting).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.launch.config import compose_config  # noqa: E402
from deadpool.launch.job import run_job  # noqa: E402
from deadpool.launch.report import compare_final_states  # noqa: E402


def step_times(run_dir: Path) -> dict[int, float]:
    """step -> the job's time for it (the slowest rank's ``step_time_s``)."""
    out: dict[int, float] = {}
    for f in (run_dir / "metrics").glob("slot*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[r["step"]] = max(out.get(r["step"], 0.0), r["step_time_s"])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--slow-at", type=int, default=10)
    ap.add_argument("--slow-frac", type=float, default=0.5)
    ap.add_argument("--parallel", default="dp4")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/runtime/straggler"))
    a = ap.parse_args(argv)
    base = [f"model={a.model}", f"parallel={a.parallel}", f"num_steps={a.steps}",
            "ft.num_spares=1", "log_every_steps=0", "overwrite_run_dir=true"]
    ref_dir, run_dir = a.out / "unslowed", a.out / "slowed"
    ref = run_job(compose_config(base + ["faults=none"], ref_dir), log=print)
    ref_t = step_times(ref_dir)
    delay = a.slow_frac * statistics.median(ref_t[s] for s in range(5, a.steps + 1))
    ev = f"faults.events=[{{rank: 1, step: {a.slow_at}, kind: slow, delay_s: {delay:.4f}}}]"
    run = run_job(compose_config(base + [ev], run_dir), log=print)
    t = step_times(run_dir)
    recs = [r for r in run["recoveries"] if r.get("detected_by") == "straggler"]
    out = {"unslowed_outcome": ref["outcome"], "outcome": run["outcome"], "delay_s": delay,
           "slow_from_step": a.slow_at, "migrations": recs and [
               {k: r.get(k) for k in ("resume_step", "steps_recomputed", "spare_slot")}
               for r in recs]}
    if recs:
        S = recs[0]["resume_step"]
        out["steps_per_s_vs_unslowed_while_slow"] = statistics.median(
            ref_t[k] for k in range(a.slow_at + 1, S)) / statistics.median(
            t[k] for k in range(a.slow_at + 1, S))
        out["windows_after_resume"] = [
            {"steps": [lo, lo + 9], "steps_per_s_vs_unslowed": statistics.median(
                ref_t[k] for k in range(lo, lo + 10)) / statistics.median(
                t[k] for k in range(lo, lo + 10))}
            for lo in range(S + 1, a.steps - 8, 10)]
    out["bitwise_equal"], out["why"] = compare_final_states(run_dir, ref_dir)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "straggler.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
