"""Run one DeadPool job end to end on this machine: store, coordinator, processes, outputs.

``run_job(cfg)`` is what ``deadpool.train``, the tests and the benchmarks call. ``cfg`` is the
resolved Hydra config as a plain dict. The run directory receives::

    job.json        the resolved config the processes read
    logs/slot*.log  each process's output
    metrics.jsonl   per-step, per-rank metrics (merged from metrics/slot*.jsonl)
    final/rank*.pt  each rank's final state (parameters + optimizer state)
    summary.json    recoveries with their timing breakdown, final digest, outcome
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from deadpool.coordinator import Coordinator, JobFailed
from deadpool.launcher import ExternalLauncher, LocalLauncher
from deadpool.report import write_outputs


def validate(cfg: dict) -> None:
    """Reject bad configs before any process starts, with a message naming the field."""
    p, ft = cfg["parallel"], cfg["ft"]
    if p["tp"] != 1 or p["pp"] != 1:
        raise ValueError("parallel.tp and parallel.pp must be 1 for now: tensor and pipeline "
                         "parallelism are not implemented in the runtime yet (data parallel only)")
    if int(cfg["num_steps"]) < 1:
        raise ValueError("num_steps must be >= 1")
    if int(ft["num_spares"]) < 0:
        raise ValueError("ft.num_spares must be >= 0")
    if ft["heartbeat_timeout_s"] <= 2 * ft["heartbeat_interval_s"]:
        raise ValueError("ft.heartbeat_timeout_s must exceed 2 x ft.heartbeat_interval_s")
    if ft["heartbeat_hard_timeout_s"] < ft["heartbeat_timeout_s"]:
        raise ValueError("ft.heartbeat_hard_timeout_s must be >= ft.heartbeat_timeout_s")
    if ft["on_no_spare"] not in ("checkpoint_and_stop",):
        raise ValueError("ft.on_no_spare must be 'checkpoint_and_stop' (elastic shrink is not built yet)")
    world = p["dp"] * p["tp"] * p["pp"]
    for ev in cfg["faults"]["events"]:
        if not 0 <= int(ev["rank"]) < world:
            raise ValueError(f"fault {ev} names rank {ev['rank']}, but ranks are 0..{world - 1}")
        if not 0 <= int(ev["step"]) < int(cfg["num_steps"]):
            raise ValueError(f"fault {ev} is at step {ev['step']}, outside 0..{cfg['num_steps'] - 1}")
    if cfg["device"].startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible")


def run_job(cfg: dict, log=print) -> dict:
    validate(cfg)
    run_dir = Path(cfg["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(cfg["launcher"]["host"], int(cfg["launcher"]["port"]), is_master=True,
                          timeout=timedelta(seconds=60), wait_for_workers=False, use_libuv=True)
    cfg = dict(cfg, _store={"host": cfg["launcher"]["host"], "port": store.port})
    job_json = run_dir / "job.json"
    job_json.write_text(json.dumps(cfg, indent=1))
    n_workers = cfg["parallel"]["dp"] * cfg["parallel"]["tp"] * cfg["parallel"]["pp"]
    slots = list(range(n_workers + int(cfg["ft"]["num_spares"])))
    t0 = time.time()
    if cfg["launcher"]["name"] == "local":
        launcher = LocalLauncher(run_dir, job_json)
        launcher.start(slots)
        log(f"[deadpool] {n_workers} workers + {cfg['ft']['num_spares']} warm spare(s) started; "
            f"store on port {store.port}; run dir {run_dir}")
    else:  # srun / torchrun start the processes: `python -m deadpool.worker --job ... --slot $SLURM_PROCID`
        launcher = ExternalLauncher(store)
        log(f"[deadpool] coordinator up; store {cfg['launcher']['host']}:{store.port}; waiting for "
            f"{len(slots)} processes (job file {job_json})")
    coord = Coordinator(cfg, store, launcher, log=log)
    try:
        coord.run()
    except JobFailed as e:
        coord.outcome, coord.message = "failed", str(e)
        for s in slots:
            launcher.kill(s)
    finally:
        launcher.wait_all(timeout_s=30)
    return write_outputs(cfg, coord, run_dir, wall_s=time.time() - t0)
