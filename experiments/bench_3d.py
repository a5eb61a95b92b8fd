"""3D runtime benchmark (dp2 x tp2 x pp2): snapshot overhead, bytes replicated, recovery per position.

    python experiments/bench_3d.py [--steps 48] [--ab-block 4] [--model tiny]
        [--out experiments/results/runtime/bench3d]

1. Overhead, in one run: snapshots taken in alternating blocks of ``--ab-block`` steps, so the
   on and off arms share the processes, the data and the moment. Prints the ratio of median step
   times, the training thread's blocked time, and the bytes each rank replicates per snapshot
   with ``ft.replicate=unique`` (its ZeRO-1 optimizer shard) against its whole state (what
   ``ft.replicate=full`` would send).
2. Recovery per position: a SIGKILL mid-step of a first-stage tensor-parallel peer (rank 1), a
   last-stage rank (rank 4) and a rank of the other data-parallel replica (rank 6), each run with
   ``ft.rebuild=affected`` (groups without a replaced member kept) and ``ft.rebuild=all``,
   interleaved. Prints kill -> first step, the group rebuild time and the groups kept; every
   final state is compared with a failure-free run of the same seed (bitwise).

Writes each run's summary.json and metrics.jsonl under ``--out`` (figures read those).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.launch.report import compare_final_states  # noqa: E402
from experiments.common import keep, run  # noqa: E402

POSITIONS = {1: "first stage, TP peer (dp 0)", 4: "last stage (dp 0)", 6: "last stage, dp 1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--ab-block", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--out", default="experiments/results/runtime/bench3d")
    args = ap.parse_args()
    out = Path(args.out)
    base = [f"model={args.model}", "parallel=dp2_tp2_pp2", "log_every_steps=0",
            "ft.persist_interval_steps=0"]
    tmp = Path(tempfile.mkdtemp(prefix="bench3d-"))
    results: dict = {"layout": "dp2 x tp2 x pp2", "model": args.model}

    # 1. overhead, in-run A/B
    d = tmp / "ab"
    s = run(base + [f"num_steps={args.steps}", "ft.num_spares=0",
                    f"ft.snapshot_ab_block_steps={args.ab_block}"], d)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 2 * args.ab_block]  # warm-up blocks out
    on = [r["step_time_s"] for r in rows if r["snapshot"]]
    off = [r["step_time_s"] for r in rows if not r["snapshot"]]
    blocked = [r["snapshot_blocked_s"] for r in rows if r["snapshot"]]
    ratio = statistics.median(on) / statistics.median(off)
    results["overhead"] = {
        "step_on_s": statistics.median(on), "step_off_s": statistics.median(off), "ratio": ratio,
        "blocked_ms_median": 1e3 * statistics.median(blocked),
        "state_bytes_per_rank": s["state_bytes_per_rank"],
        "replicated_bytes_per_rank_per_step": s["replicated_bytes_per_rank_per_snapshot"]}
    keep(d, out, "ab")
    o = results["overhead"]
    print(f"[bench3d] step time snapshots on/off (in-run A/B, medians): {o['step_on_s'] * 1e3:.1f} / "
          f"{o['step_off_s'] * 1e3:.1f} ms = {ratio:.3f}; training thread blocked "
          f"{o['blocked_ms_median']:.2f} ms/step", flush=True)
    print(f"[bench3d] bytes replicated per rank per step: {o['replicated_bytes_per_rank_per_step']:,} "
          f"(ZeRO-1 shard) vs {o['state_bytes_per_rank']:,} for the whole state "
          f"({o['replicated_bytes_per_rank_per_step'] / o['state_bytes_per_rank']:.2f})", flush=True)

    # 2. recovery per position, rebuild affected vs all, interleaved
    ref = tmp / "ref"
    run(base + ["num_steps=16", "ft.num_spares=1", "faults=none"], ref)
    results["recovery"] = []
    for rank, where in POSITIONS.items():
        for mode in ("affected", "all"):
            d = tmp / f"kill{rank}_{mode}"
            ev = f"faults.events=[{{rank: {rank}, step: 8, phase: mid_step, kind: kill}}]"
            s = run(base + ["num_steps=16", "ft.num_spares=1", ev, f"ft.rebuild={mode}"], d)
            (rec,) = s["recoveries"]
            equal, _ = compare_final_states(d, ref)
            row = {"rank": rank, "position": where, "rebuild": mode,
                   "kill_to_first_step_s": rec["kill_to_first_step_s"],
                   "rebuild_s": rec["rebuild_s"], "build_s": rec["build_s"],
                   "transfer_s": rec["transfer_s"], "groups_kept": rec.get("groups_kept", 0),
                   "bytes_transferred": rec["bytes_transferred"], "bitwise_equal": equal}
            results["recovery"].append(row)
            keep(d, out, f"kill{rank}_{mode}")
            print(f"[bench3d] kill rank {rank} ({where}), rebuild={mode}: kill -> first step "
                  f"{row['kill_to_first_step_s']:.3f} s, group rebuild {row['rebuild_s'] * 1e3:.0f} ms "
                  f"(spare build {row['build_s'] * 1e3:.0f} ms), {row['groups_kept']} groups kept, "
                  f"{row['bytes_transferred']:,} B transferred, equal={equal}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
