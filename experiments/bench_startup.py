"""Start-up before and after a change, on one machine in one run: two source trees interleaved.

    python experiments/bench_startup.py OUT_DIR --old-tree PATH [--new-tree PATH] [--rounds 2]
        [--model gpt_1b] [--stage-tp 1 2] [--job] [--job-overrides ...] [--job-timeout-s 900]

For each round, old then new (so a load that drifts during the run falls on both):

* ``stage``: a fresh interpreter per tree and per ``--stage-tp`` degree builds rank 0's stage of
  ``--model`` (``parallel.stage.build_stage``, pp 1, the full model's layers, float32, CPU),
  printing launch -> imported -> stage built. This is the piece of the start-up that the
  initialisation changes (the worker's start-up line calls it ``build (stage ...)``).
* ``--job``: launch -> first step of a one-rank job with one warm spare and launch -> the spare
  warm, with the rank's start-up breakdown, through ``experiments/gpu/check_startup.py
  --device cpu`` of each tree (``--job-overrides`` go to the job; a full gpt_1b rank with its
  spare needs ~40 GB of host memory, more than a 24 GB machine has: the job then uses fewer
  layers, see the results' README).

* ``--draw``: in this process, alternating, the per-element cost of the two draws alone on one
  ``[5632, 2048]`` weight (an ffn weight of gpt_1b): the old one (a CPU ``torch.Generator``
  seeded per parameter, ``normal_``, as ``model.init_param`` drew before
  ``deadpool/init_rng.py``) and the new ``init_rng.fill_normal_`` on one thread, the way the
  old build ran it on each of its threads (``--draw-threads``: the new one's chunk threads).

Each tree runs with ``PYTHONPATH`` set to itself (its own ``deadpool``) and the interpreter
running this script. Writes OUT_DIR/startup.json (every run, plus medians per arm) and prints
progress as it goes. The load average is recorded before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STAGE = r"""
import json, sys, tempfile, time
t0 = float(sys.argv[1])
import torch
from deadpool.parallel.stage import build_stage
from deadpool.launch.config import compose_config
t_import = time.time()
cfg = compose_config([f"model={sys.argv[2]}"], tempfile.mkdtemp())["model"]
tp = int(sys.argv[3])
t1 = time.perf_counter()
stage = build_stage(cfg, 0, pp_rank=0, pp=1, tp_rank=0, tp=tp)
build = time.perf_counter() - t1
n = sum(p.numel() for p in stage.parameters())
print(json.dumps({"imports_s": t_import - t0, "build_stage_s": build,
                  "launch_to_built_s": time.time() - t0, "params_held": n,
                  "threads": torch.get_num_threads()}))
"""


def load() -> float:
    return round(os.getloadavg()[0], 2)


def run_stage(tree: Path, model: str, tp: int, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", STAGE, repr(t0), model, str(tp)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=timeout_s)
    if p.returncode:
        return {"error": p.stderr[-2000:]}
    return {k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def run_job(tree: Path, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(tree / "experiments/gpu/check_startup.py"), out, "--device", "cpu",
               "--model", args.model, "--batch-size", "1", "--seq-len", str(args.job_seq_len),
               "--steps", "1", "--spares", "1", "--timeout-s", str(args.job_timeout_s),
               "--overrides", *args.job_overrides]
        if "--no-init-probe" in (tree / "experiments/gpu/check_startup.py").read_text():
            cmd.append("--no-init-probe")  # its in-process stage build is not the job's start-up
        env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                           timeout=args.job_timeout_s + 120)
        path = Path(out) / "check_startup.json"
        if not path.exists():
            return {"error": (p.stdout + p.stderr)[-2000:]}
        res = json.loads(path.read_text())
    keep = ("launch_to_first_step_s", "launch_to_spare_warm_s", "launch_to_warm_s",
            "launch_to_worker_exec_s", "startup", "startup_line", "timed_out", "wall_s",
            "returncode")
    out = {k: res.get(k) for k in keep}
    if out["launch_to_first_step_s"] is None:  # the job's own words on why
        out["tail"] = (res.get("tail") or "")[-1500:]
    return out


def run_draws(rounds: int, threads: int) -> list[dict]:
    import torch

    sys.path.insert(0, str(ROOT))
    from deadpool.init_rng import fill_normal_, param_key

    torch.set_num_threads(1)
    shape = (5632, 2048)
    n = shape[0] * shape[1]
    out = []
    for rnd in range(rounds):
        for arm in ("old", "new"):
            l0 = load()
            t0 = time.perf_counter()
            if arm == "old":
                gen = torch.Generator().manual_seed((0 << 32) | 12345)
                torch.empty(shape).normal_(0.0, 0.02, generator=gen)
            else:
                fill_normal_(torch.empty(shape), param_key(0, "x"), 0.02, [0], n, threads=threads)
            dt = time.perf_counter() - t0
            out.append({"what": "draw", "arm": arm, "round": rnd, "threads": 1 if arm == "old" else threads,
                        "ns_per_element": round(dt / n * 1e9, 2), "load_before": l0})
            print(f"    draw {arm}: {out[-1]['ns_per_element']} ns/element (load {l0})", flush=True)
    return out


def median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return round(statistics.median(vals), 3) if vals else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--old-tree", required=True, type=Path)
    ap.add_argument("--new-tree", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="gpt_1b")
    ap.add_argument("--stage-tp", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--stage-timeout-s", type=float, default=600)
    ap.add_argument("--draw", action="store_true", help="also the two draws alone, in-process")
    ap.add_argument("--draw-rounds", type=int, default=5)
    ap.add_argument("--draw-threads", type=int, default=1)
    ap.add_argument("--job", action="store_true", help="also launch -> first step of a job")
    ap.add_argument("--job-seq-len", type=int, default=128)
    ap.add_argument("--job-timeout-s", type=float, default=900)
    ap.add_argument("--job-overrides", nargs="*",
                    default=["ft.num_local_slots=1", "ft.progress_timeout_s=900"])
    args = ap.parse_args()
    trees = {"old": args.old_tree.resolve(), "new": args.new_tree.resolve()}
    commits = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
               for k, t in trees.items()}
    runs = run_draws(args.draw_rounds, args.draw_threads) if args.draw else []
    for rnd in range(args.rounds):
        for arm in ("old", "new"):
            for tp in args.stage_tp:
                l0 = load()
                print(f"[round {rnd}] {arm} ({commits[arm]}): build_stage {args.model} tp {tp} rank 0 ...",
                      flush=True)
                r = run_stage(trees[arm], args.model, tp, args.stage_timeout_s)
                r.update(what="stage", arm=arm, round=rnd, tp=tp, load_before=l0, load_after=load())
                print(f"    {json.dumps(r)}", flush=True)
                runs.append(r)
            if args.job:
                l0 = load()
                print(f"[round {rnd}] {arm}: job launch -> first step ...", flush=True)
                r = run_job(trees[arm], args)
                r.update(what="job", arm=arm, round=rnd, load_before=l0, load_after=load())
                print(f"    first step {r.get('launch_to_first_step_s')} s, spare warm "
                      f"{r.get('launch_to_spare_warm_s')} s; {r.get('startup_line') or r.get('error')}",
                      flush=True)
                runs.append(r)
    summary = {}
    for arm in ("old", "new"):
        rows = [r for r in runs if r["what"] == "draw" and r["arm"] == arm]
        if rows:
            summary[f"{arm} draw"] = {"ns_per_element": median(rows, "ns_per_element")}
        for tp in args.stage_tp:
            rows = [r for r in runs if r["what"] == "stage" and r["arm"] == arm and r["tp"] == tp]
            summary[f"{arm} stage tp{tp}"] = {k: median(rows, k) for k in
                                              ("build_stage_s", "launch_to_built_s", "imports_s")}
        rows = [r for r in runs if r["what"] == "job" and r["arm"] == arm]
        if rows:
            summary[f"{arm} job"] = {k: median(rows, k) for k in
                                     ("launch_to_first_step_s", "launch_to_spare_warm_s")}
    out = {"bench": "start-up, old vs new tree interleaved", "model": args.model,
           "commits": commits, "cpus": len(os.sched_getaffinity(0)),
           "job_overrides": args.job_overrides if args.job else None,
           "job_seq_len": args.job_seq_len if args.job else None,
           "summary_medians": summary, "runs": runs,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / "startup.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
