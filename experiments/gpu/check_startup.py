"""GPU check 6: start-up. Launch -> first step of a 1.4 B rank and launch -> warm of a spare,
with the worker's start-up breakdown (target: the rank's first step <= 15 s after launch).

    python experiments/gpu/check_startup.py OUT_DIR [--model gpt_1b] [--batch-size 8]
        [--seq-len 1024] [--steps 5] [--spares 1] [--timeout-s 120] [--device cuda|cpu]
        [--overrides ...] [--dry-run]

One job, ``parallel.dp=1`` with ``--spares`` warm spares, ``precision=bf16``, snapshots on (the
default) with ``ft.num_local_slots=2`` (``--overrides``: on one machine a gpt_1b rank and its
spare pin 3 x 18.5 GiB each with the default 3 slots, 111 GiB of a 126 GiB host; the lone
rank's start-up with the defaults is check 4's ``deadpool_snapshot_on`` arm). The job runs
through ``jobs.py``, which runs it as ``python -m deadpool.train`` does and records when each
slot reported itself warm (its own wall-clock time, its join announcement as the coordinator
reads it); the job is stopped once rank 0 logged ``--steps`` (not waiting for the final state
write).

Reported (OUT_DIR/check_startup.json): launch -> first step (end of step 1) of rank 0;
launch -> warm of every slot (the rank's warm is its imports done; a spare's, its imports and
its pre-built stage: the first plan waits for every slot); rank 0's start-up line parsed
(imports, build: stage / optimizer / snapshot_buffers, groups, state, first step; ``build``
includes the wait for the first plan, ``waiting_for_plan_s``); launch -> the worker's
interpreter (the coordinator's own start and the process launch). ``--device cpu`` with a
small model: a smoke run of the check.

Before the job (``init_probe``, unless ``--no-init-probe``): the rank's stage built in this
process on the device from the meta device (``stage_build_on_device_s``, the initialisation
drawn there), and whether a chunk of a parameter drawn on the device has the CPU's bits
(``init_bits_equal_cpu``: the draw is meant not to depend on the device, deadpool/init_rng.py).
Its seconds (``probe_s``) are taken from ``--timeout-s``, so the check keeps its bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_info, write_json  # noqa: E402
from jobs import run_bounded  # noqa: E402

TARGET_S = 15.0


def overrides(args) -> list[str]:
    return [f"model={args.model}", f"device={args.device}", "parallel.dp=1",
            f"ft.num_spares={args.spares}", "precision=bf16", f"batch_size={args.batch_size}",
            f"seq_len={args.seq_len}", f"num_steps={args.steps}", "log_every_steps=1",
            # one GPU holds the rank and its spare: NCCL then needs the shared-GPU mode
            *(["launcher.share_gpu=true"] if args.device == "cuda" else []), *args.overrides]


def init_probe(args) -> dict:
    """Stage build on the device (the job's model, float32, tp 1) and CPU == device bits."""
    import torch

    from deadpool.init_rng import fill_normal_, param_key
    from deadpool.parallel.stage import build_stage
    from deadpool.launch.config import compose_config

    cfg = compose_config([f"model={args.model}"], Path(tempfile.mkdtemp()))["model"]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    stage = build_stage(cfg, 0, pp_rank=0, pp=1, tp_rank=0, tp=1, device=args.device)
    sync()
    out = {"stage_build_on_device_s": round(time.perf_counter() - t0, 3),
           "stage_params": sum(p.numel() for p in stage.parameters())}
    del stage
    key, n = param_key(0, "blocks.0.ffn.down.weight"), 1 << 20
    starts = list(range(1, 64 * 4097, 4097))  # odd starts: pairs split at both ends
    here = fill_normal_(torch.empty(n, device=args.device), key, 0.02, [0], n)
    cpu = fill_normal_(torch.empty(n), key, 0.02, [0], n)
    cols_dev = fill_normal_(torch.empty(64, 2049, device=args.device), key, 0.02, starts, 2049)
    cols_cpu = fill_normal_(torch.empty(64, 2049), key, 0.02, starts, 2049)
    out["init_bits_equal_cpu"] = bool(torch.equal(here.cpu(), cpu)
                                      and torch.equal(cols_dev.cpu(), cols_cpu))
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="gpt_1b")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--spares", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=120)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--no-init-probe", action="store_true")
    ap.add_argument("--overrides", nargs="*",
                    default=["ft.num_local_slots=2", "ft.progress_timeout_s=900"],
                    help="extra Hydra overrides")
    args = ap.parse_args()
    here = Path(__file__).resolve().parent
    path = Path(args.out) / "check_startup.json"
    out = {"check": "start-up", "model": args.model, "target_s": TARGET_S,
           "overrides": overrides(args)}
    if args.dry_run:
        from deadpool.launch.config import compose_config

        c = compose_config(overrides(args), Path(tempfile.mkdtemp()))
        out["composed"] = {"dp": c["parallel"]["dp"], "num_spares": c["ft"]["num_spares"],
                           "snapshot": c["ft"]["snapshot"], "num_local_slots": c["ft"]["num_local_slots"]}
        write_json(path, out)
        print(json.dumps(out, indent=1))
        return
    out["env"] = env_info()
    if not args.no_init_probe:
        t_probe = time.monotonic()
        out["init_probe"] = init_probe(args)
        # the probe's seconds come out of the job's bound (the session's step bounds the whole)
        out["init_probe"]["probe_s"] = round(time.monotonic() - t_probe, 2)
        args.timeout_s = max(30.0, args.timeout_s - out["init_probe"]["probe_s"])
        print(f"init probe: {json.dumps(out['init_probe'])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "job"
        warm_json = Path(tmp) / "warm.json"
        cmd = [sys.executable, str(here / "jobs.py"), str(warm_json), *overrides(args),
               f"hydra.run.dir={run_dir}"]
        res = run_bounded(cmd, run_dir, args.steps, args.timeout_s, hide=tmp)
        t0 = res.pop("t_launch")
        warm = json.loads(warm_json.read_text()) if warm_json.exists() else {}
    rows = res.pop("rows")
    world = 1
    out.update(res)
    out["steps_logged"] = [r["step"] for r in rows]
    out["step_s"] = [r["step_time_s"] for r in rows]
    out["launch_to_warm_s"] = {s: round(w["t_warm"] - t0, 3) for s, w in warm.items() if "t_warm" in w}
    out["launch_to_warm_seen_by_coordinator_s"] = {s: round(w["t_seen"] - t0, 3) for s, w in warm.items()}
    spares = {s: v for s, v in out["launch_to_warm_s"].items() if int(s) >= world}
    out["launch_to_spare_warm_s"] = max(spares.values()) if spares else None
    st = out.get("startup")
    if st and out["launch_to_first_step_s"] is not None:
        out["launch_to_worker_exec_s"] = round(out["launch_to_first_step_s"] - st["total_s"], 3)
    first = out["launch_to_first_step_s"]
    out["meets_target"] = first is not None and first <= TARGET_S
    write_json(path, out)
    print(f"launch -> first step {first if first is None else round(first, 1)} s "
          f"(target {TARGET_S:.0f} s); launch -> spare warm {out['launch_to_spare_warm_s']} s; "
          f"warm by slot {out['launch_to_warm_s']}; wall {out['wall_s']} s"
          + (" TIMED OUT" if out["timed_out"] else ""))
    print(out["startup_line"])
    print(json.dumps(st))


if __name__ == "__main__":
    t = time.time()
    main()
