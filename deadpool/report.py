"""Run outputs: merge per-process metrics, write summary.json, print the recovery breakdown,
and compare a run's final state with another run's (bitwise)."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import torch


def merge_metrics(run_dir: Path) -> list[dict]:
    rows = []
    for f in sorted((run_dir / "metrics").glob("slot*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: (r["t"], r["rank"] if r["rank"] is not None else -1))
    with open(run_dir / "metrics.jsonl", "w") as out:
        for r in rows:
            out.write(json.dumps(r) + "\n")
    return rows


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def write_outputs(cfg: dict, coord, run_dir: Path, wall_s: float) -> dict:
    rows = merge_metrics(run_dir)
    finals = coord.finals
    digest = None
    if finals and len(finals) == coord.dims.world_size:
        h = hashlib.sha256()
        for r in sorted(finals):
            h.update(finals[r]["digest"].encode())
        digest = h.hexdigest()
    gen0 = [r for r in rows if r["generation"] == 0 and r["step"] > 1]  # step 1 includes warm-up
    state_bytes = max((f["state_bytes"] for f in finals.values()), default=None)
    repl_bytes = max((f.get("replicated_bytes", 0) for f in finals.values()), default=None)
    n_params = next((f["model_params"] for f in finals.values()), None)
    p = cfg["parallel"]
    summary = {
        "strategy": cfg["ft"].get("strategy", "deadpool"),
        "outcome": coord.outcome,
        "message": coord.message,
        "world_size": coord.dims.world_size,
        "num_spares": int(cfg["ft"]["num_spares"]),
        "dp": p["dp"], "tp": p["tp"], "pp": p["pp"],
        "model_params": n_params,
        "state_bytes_per_rank": state_bytes,          # the largest rank's
        "replicated_bytes_per_rank_per_snapshot": repl_bytes,
        "steps": int(cfg["num_steps"]),
        "step_time_s": _median(r["step_time_s"] for r in gen0),
        "snapshot": {
            "enabled": bool(cfg["ft"]["snapshot"]),
            "interval_steps": int(cfg["ft"]["snapshot_interval_steps"]),
            "copy_s_median": _median(r["snapshot_copy_s"] for r in gen0),
            "replicate_s_median": _median(r["replicate_s"] for r in gen0),
            "blocked_s_median": _median(r["snapshot_blocked_s"] for r in gen0),
        },
        "recoveries": [r.to_dict() for r in coord.recoveries],
        "stop": getattr(coord, "stop_record", None),  # a signal's stop (recovery.preempt)
        "final_digest": digest,
        # the last pipeline stage logs the loss (the mean of its data-parallel rank's batch)
        "final_loss": _mean_loss(rows, cfg["num_steps"]),
        # validation loss by step (eval_every_steps; the same on every last-stage rank)
        "val_loss": {str(r["step"]): r["val_loss"] for r in rows if r.get("val_loss") is not None},
        "wall_s": wall_s,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def print_report(summary: dict, log=print) -> None:
    log(f"[deadpool] outcome: {summary['outcome']}  steps: {summary['steps']}  "
        f"final loss: {summary['final_loss']}  wall: {summary['wall_s']:.1f} s")
    if summary["message"]:
        log(f"[deadpool] {summary['message']}")
    if summary.get("val_loss"):
        vals = summary["val_loss"]
        log("[deadpool] validation loss: " + "  ".join(f"step {s} {v:.4f}" for s, v in vals.items()))
    for rec in summary["recoveries"]:
        to = {"restart": "every process relaunched",
              "shrink": f"dp={rec.get('dp')} without replica(s) {rec.get('dropped_dp')}",
              "grow": f"dp={rec.get('dp')}"}.get(rec.get("fallback"),
                                                f"spare slot {rec.get('spare_slot')}")
        log(f"[deadpool] recovery (gen {rec['generation']}): rank {rec['failed_rank']} "
            f"({rec.get('fault')}, detected by {rec['detected_by']}) -> {to}; "
            f"resumed at step {rec['resume_step']}, {rec['steps_recomputed']} step(s) recomputed; "
            f"{rec.get('outcome')}")
        parts = ["detect_s", "teardown_s", "plan_s", "exec_s", "imports_s", "build_s", "rebuild_s",
                 "transfer_s", "rollback_s", "load_s", "first_step_s"]
        log("           " + "  ".join(f"{k[:-2]} {rec[k] * 1e3:.0f} ms" for k in parts
                                      if rec.get(k) is not None))
        for k in ("kill_to_training_s", "kill_to_first_step_s", "kill_to_protected_s"):
            if rec.get(k) is not None:
                log(f"           {k[:-2].replace('_', ' ')}: {rec[k]:.3f} s")


def _mean_loss(rows: list[dict], step: int) -> float | None:
    """Mean of the losses logged for ``step`` (one per last-stage rank; tensor-parallel peers
    log the same value), from the newest generation that logged it."""
    at = [r for r in rows if r["step"] == step and r.get("loss") is not None]
    if not at:
        return None
    gen = max(r["generation"] for r in at)
    losses = [r["loss"] for r in at if r["generation"] == gen]
    return round(sum(losses) / len(losses), 6)


def compare_final_states(run_a: Path, run_b: Path) -> tuple[bool, str]:
    """torch.equal on every tensor of every rank's final state. Returns (equal, explanation)."""
    fa = sorted((Path(run_a) / "final").glob("rank*.pt"))
    fb = sorted((Path(run_b) / "final").glob("rank*.pt"))
    if not fa or [f.name for f in fa] != [f.name for f in fb]:
        return False, f"different final rank files: {[f.name for f in fa]} vs {[f.name for f in fb]}"
    for a, b in zip(fa, fb):
        sa, sb = torch.load(a), torch.load(b)
        if sa.keys() != sb.keys():
            return False, f"{a.name}: different state keys"
        for k in sa:
            if not torch.equal(sa[k], sb[k]):
                diff = (sa[k].double() - sb[k].double()).abs().max().item()
                return False, f"{a.name}: {k} differs (max abs diff {diff:.3e})"
    return True, f"{len(fa)} ranks, every parameter and optimizer tensor bitwise equal"
