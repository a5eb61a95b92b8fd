"""Run outputs: merge per-process metrics (streaming), write summary.json, print the recovery breakdown,
and compare a run's final state with another run's (bitwise)."""

from __future__ import annotations

import heapq
import json
import random
import shutil
import statistics
from pathlib import Path

import torch

from deadpool.checkpoint.dcp_io import read_rank_state
from deadpool.checkpoint.files import latest_step_dir, read_meta
from deadpool.checkpoint.final import final_digest
from deadpool.checkpoint.unique import read_full_rank


MAX_OPEN_FILES = 256  # per merge pass: more files are merged in groups first (file limits)
SAMPLE_ROWS = 1 << 16  # values kept per median; beyond that a seeded uniform sample


class _Sample:
    """Values for a median: all of them up to ``SAMPLE_ROWS``, then a reservoir sample (the
    median of a uniform sample of that size is within a fraction of a percentile)."""

    def __init__(self):
        self.xs: list[float] = []
        self.n = 0
        self.rng = random.Random(0)

    def add(self, x) -> None:
        if x is None:
            return
        self.n += 1
        if len(self.xs) < SAMPLE_ROWS:
            self.xs.append(x)
        else:
            j = self.rng.randrange(self.n)
            if j < SAMPLE_ROWS:
                self.xs[j] = x


class Merged:
    """What the summary needs of the merged metrics, gathered as the rows stream past."""

    MEDIANS = ("step_time_s", "snapshot_copy_s", "replicate_s", "snapshot_blocked_s")

    def __init__(self, num_steps: int | None):
        self.num_steps = num_steps
        self.rows = 0
        self.torn = 0  # lines that were not JSON (a process killed mid-write)
        self._samples = {k: _Sample() for k in self.MEDIANS}
        self._last_losses: dict[int, list[float]] = {}  # generation -> losses at num_steps
        self.val_loss: dict[str, float] = {}

    def add(self, r: dict) -> None:
        self.rows += 1
        if r["generation"] == 0 and r["step"] > 1:  # step 1 includes warm-up
            for k, sample in self._samples.items():
                sample.add(r.get(k))
        if r["step"] == self.num_steps and r.get("loss") is not None:
            self._last_losses.setdefault(r["generation"], []).append(r["loss"])
        if r.get("val_loss") is not None:
            self.val_loss[str(r["step"])] = r["val_loss"]

    def median(self, key: str):
        xs = self._samples[key].xs
        return statistics.median(xs) if xs else None

    def final_loss(self) -> float | None:
        """Mean of the losses logged for the last step (one per last-stage rank; tensor-parallel
        peers log the same value), from the newest generation that logged it."""
        if not self._last_losses:
            return None
        losses = self._last_losses[max(self._last_losses)]
        return round(sum(losses) / len(losses), 6)


def _key(r: dict):
    return (r["t"], r["rank"] if r["rank"] is not None else -1)


def _rows(path: Path, merged: Merged | None):
    """The rows of one file, one at a time (a torn line is counted and skipped)."""
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError:
                if merged is not None:
                    merged.torn += 1


def _merge_into(paths: list[Path], out, merged: Merged | None) -> None:
    for r in heapq.merge(*(_rows(p, merged) for p in paths), key=_key):
        out.write(json.dumps(r) + "\n")
        if merged is not None:
            merged.add(r)


def merge_metrics(run_dir: Path, num_steps: int | None = None) -> Merged:
    """``metrics/slot*.jsonl`` (each process appends in its own time order) merged into
    ``metrics.jsonl`` by (time, rank), streaming: a k-way merge holding one row per open file,
    ties kept in file order (as the stable sort of every row did). More than ``MAX_OPEN_FILES``
    files are merged in groups into temporary files first. Returns what the summary needs."""
    run_dir = Path(run_dir)
    files = sorted((run_dir / "metrics").glob("slot*.jsonl"))
    merged = Merged(num_steps)
    tmp_dir = run_dir / "metrics.merging"
    try:
        level = 0
        while len(files) > MAX_OPEN_FILES:  # groups of consecutive files: ties stay in order
            tmp_dir.mkdir(exist_ok=True)
            groups = [files[i:i + MAX_OPEN_FILES] for i in range(0, len(files), MAX_OPEN_FILES)]
            nxt = []
            for i, group in enumerate(groups):
                part = tmp_dir / f"{level}_{i}.jsonl"
                with open(part, "w") as out:
                    _merge_into(group, out, None)
                nxt.append(part)
            files, level = nxt, level + 1
        tmp = run_dir / "metrics.jsonl.tmp"
        with open(tmp, "w") as out:
            _merge_into(files, out, merged)
        tmp.replace(run_dir / "metrics.jsonl")
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return merged


def write_outputs(cfg: dict, coord, run_dir: Path, wall_s: float) -> dict:
    m = merge_metrics(run_dir, int(cfg["num_steps"]))
    finals = coord.finals
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
        "step_time_s": m.median("step_time_s"),
        "snapshot": {
            "enabled": bool(cfg["ft"]["snapshot"]),
            "interval_steps": int(cfg["ft"]["snapshot_interval_steps"]),
            "copy_s_median": m.median("snapshot_copy_s"),
            "replicate_s_median": m.median("replicate_s"),
            "blocked_s_median": m.median("snapshot_blocked_s"),
        },
        "recoveries": [r.to_dict() for r in coord.recoveries],
        "stop": getattr(coord, "stop_record", None),  # a signal's stop (recovery.preempt)
        # liveness-only suspicions held back, as they ended (recovery.suspicion)
        "liveness_held_back": getattr(getattr(coord, "suspicion", None), "held", []),
        # from the ranks' own digests (checkpoint.final): nothing read back from disk
        "final_digest": final_digest(finals, coord.dims.world_size),
        # bytes of the final checkpoint's files, every rank's part (checkpoint.final)
        "final_written_bytes": sum(f.get("written_bytes", 0) for f in finals.values()) or None,
        # the last pipeline stage logs the loss (the mean of its data-parallel rank's batch)
        "final_loss": m.final_loss(),
        # validation loss by step (eval_every_steps; the same on every last-stage rank)
        "val_loss": m.val_loss,
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


def final_step_dir(run) -> Path:
    """The run's final checkpoint (``<run>/final/step_<S>``; FileNotFoundError if incomplete)."""
    return latest_step_dir(Path(run) / "final")


def final_ranks(run) -> list[int]:
    """The ranks of the run's final checkpoint (the layout the job ended at)."""
    return list(range(int(read_meta(final_step_dir(run))["world_size"])))


def load_final_rank(run, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s whole final state (name -> tensor), its shared tensors joined from the
    parts its data-parallel peers wrote (``checkpoint.unique.read_full_rank``)."""
    return read_full_rank(final_step_dir(run), rank)[0]


def compare_final_states(run_a: Path, run_b: Path) -> tuple[bool, str]:
    """Two runs' final states, bitwise: ``torch.equal`` on every tensor each rank wrote, and
    every rank's digest of its *whole* state (a data-parallel replica's parameters are written
    by one replica only: a replica given another rank's parameters differs in its digest).
    Returns (equal, explanation)."""
    try:
        da, db = final_step_dir(run_a), final_step_dir(run_b)
    except FileNotFoundError as e:
        return False, f"no complete final state: {e}"
    ma, mb = read_meta(da), read_meta(db)
    if (ma["world_size"], ma.get("layout")) != (mb["world_size"], mb.get("layout")):
        return False, (f"different final layouts: {ma['world_size']} ranks {ma.get('layout')} vs "
                       f"{mb['world_size']} ranks {mb.get('layout')}")
    n = int(ma["world_size"])
    for r in range(n):
        (sa, ha), (sb, hb) = read_rank_state(da, r), read_rank_state(db, r)
        if sa.keys() != sb.keys():
            return False, f"rank {r}: different state keys written ({sorted(sa)} vs {sorted(sb)})"
        for k in sa:
            if not torch.equal(sa[k], sb[k]):
                diff = (sa[k].double() - sb[k].double()).abs().max().item() if (
                    sa[k].shape == sb[k].shape) else float("nan")
                return False, f"rank {r}: {k} differs (max abs diff {diff:.3e})"
        if ha.get("digest") is None or ha.get("digest") != hb.get("digest"):
            return False, (f"rank {r}: the digest of its whole state differs ({ha.get('digest')} "
                           f"vs {hb.get('digest')}), in a part another rank wrote")
    return True, (f"{n} ranks, every parameter and optimizer tensor written bitwise equal, and "
                  "every rank's whole-state digest")
