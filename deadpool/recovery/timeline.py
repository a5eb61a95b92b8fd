"""The recovery's account (``RecoveryRecord``): opened when the plan is made, completed from the
ranks' ``RankTimings`` once every rank of the new generation has taken its first step.

Breakdown (seconds; ``t_kill`` is the injected fault's time when known, else the detection)::

    detect_s      kill -> failure detected
    plan_s        detected -> plan g+1 written
    build_s       a spare building its rank's stage (its part of the rebuild)
    rebuild_s     plan -> every rank's groups of g+1 exist
    transfer_s    groups -> state received (the slowest rank)
    rollback_s    received -> live state at the resume step (a relaunch: load_s, the disk load)
    first_step_s  every rank ready -> every rank finished its first step
    kill_to_first_step_s, kill_to_training_s, kill_to_protected_s: end-to-end

Every record is on disk as soon as it is appended to ``coord.recoveries`` (``RecoveryLog``): a
line of ``run_dir/recoveries.jsonl`` and, with ``logging.tensorboard``, TensorBoard entries, so
a coordinator that crashes leaves the recoveries it made, not only log lines. A record completed
later (a relaunch's, by the relaunched coordinator) is written again: a generation's newest line
is its record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from deadpool.rank.tensorboard_log import RECOVERIES_FILE, recovery_board
from deadpool.store.protocol import UNSET, Keys, RankTimings, RecoveryRecord
from deadpool.store.reports import Reports

INTERRUPTED = "interrupted by another failure"


class RecoveryLog(list):
    """``coord.recoveries``: a list of ``RecoveryRecord`` whose ``append`` also writes the record
    where a crash keeps it (the module's docstring). A write that fails is logged once; the job
    goes on (the summary still carries every record at the end)."""

    def __init__(self, cfg: dict, log=print):
        super().__init__()
        run_dir = cfg.get("run_dir")
        self.path = None if run_dir is None else Path(run_dir) / RECOVERIES_FILE
        self.board = recovery_board(cfg)
        self.log, self.failed = log, False

    def append(self, rec: RecoveryRecord) -> None:
        super().append(rec)
        try:
            d = rec.to_dict()
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a") as f:
                    f.write(json.dumps(d, default=str) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            if self.board is not None:
                self.board.add(d)
        except Exception as e:  # (OSError, or TensorBoard's own errors)
            if not self.failed:
                self.failed = True
                self.log(f"[coordinator] recovery records not written as they happen: {e}")

    def extend(self, recs) -> None:
        for rec in recs:
            self.append(rec)


def one_or_list(xs: list):
    return xs[0] if len(xs) == 1 else xs


def open_record(coord, failed: dict[int, str], faults: dict[int, dict], decision,
                t_detect: float, bad: list[dict]) -> RecoveryRecord:
    """The record of the recovery from ``failed`` (before they leave the membership)."""
    dead = sorted(failed)
    cause, coord.abort_cause = getattr(coord, "abort_cause", None), None
    t_kill = min(min([f["t"] for f in faults.values()] or [t_detect]), t_detect)
    rec = RecoveryRecord(
        coord.gen + 1, failed_rank=one_or_list(dead),
        failed_slot=one_or_list([coord.members.ranks[d] for d in dead]),
        fault=next(iter(faults.values()))["kind"] if faults else "unknown",
        detected_by=failed[dead[0]] if dead else cause or "collective_error",
        resume_step=decision.resume_step, steps_recomputed=decision.steps_recomputed,
        detect_s=t_detect - t_kill, t_kill=t_kill, t_detect=t_detect)
    if bad:
        rec.bad_sources = bad
    return rec


def finish_pending(coord, interrupted: bool = False, force: bool = False) -> None:
    """Complete the open record (``coord.pending``) from the ranks' sealed timing keys once they
    are all there (and, when ranks replicate, every rank is protected again, unless ``force``);
    ``interrupted``: a new failure came first. Called every loop of the coordinator while a
    record is open: each call asks the store only about the reports still missing."""
    rec = coord.pending
    if rec is None:
        return
    keys = Keys(rec.generation)
    ranks = list(coord.members.ranks) if not interrupted else []
    reports = _reports(coord, rec, keys, ranks)
    timings: list[RankTimings] = []
    firsts: list[float] = []
    if not interrupted:
        got = reports["timing"].poll()
        if not reports["timing"].complete:
            return
        timings = [RankTimings.from_json(got[r]) for r in ranks]
        got = reports["first_step"].poll()
        if not reports["first_step"].complete:
            return
        firsts = [float(got[r]) for r in ranks]
    if not (interrupted or force) and coord.replicates and not _protected(coord, keys, reports,
                                                                          len(ranks)):
        return
    if interrupted:
        rec.outcome = INTERRUPTED
    else:
        _breakdown(coord, rec, reports, ranks, timings, firsts)
    coord.recoveries.append(rec)
    coord.pending = None
    coord.record_reports = None
    if not interrupted:
        coord.streak = 0  # every rank completed a step: the job progresses again
        coord.generation_running(rec.generation)  # older generations' keys can go


def _reports(coord, rec: RecoveryRecord, keys: Keys, ranks: list[int]) -> dict[str, Reports]:
    """The record's per-rank reports (timing, first step, protected), kept across calls."""
    held = coord.record_reports
    if held is None or held[0] is not rec:
        def forged(kind):
            return lambda who: coord.log(f"[coordinator] {kind} report of {who} without the "
                                         f"job's secret: ignored")
        held = (rec, {kind: coord.rank_reports(keys, kind, ranks, forged(kind))
                      for kind in ("timing", "first_step", "protected")})
        coord.record_reports = held
    return held[1]


def _protected(coord, keys: Keys, reports: dict[str, Reports], n: int) -> bool:
    """Every rank sealed ``protected/<rank>``; ``num_protected`` is only the hint to look (under
    node agents there is none: their keys are read)."""
    if coord.events is None and int(coord.store.add(keys.protected_count, 0)) < n:
        return False
    reports["protected"].poll()
    return reports["protected"].complete


def _breakdown(coord, rec: RecoveryRecord, reports: dict[str, Reports], ranks: list[int],
               timings: list[RankTimings], firsts: list[float]) -> None:
    tp, tk = rec.t_plan, rec.t_kill
    t_ready = max(t.ready for t in timings)
    rec.rebuild_s = max(t.rebuilt for t in timings) - tp
    rec.transfer_s = max(t.transferred - t.rebuilt for t in timings)
    rec.rollback_s = max(t.rolled_back - t.transferred for t in timings)
    built = [t.built - t.plan_seen for t in timings if t.built is not None]
    rec.build_s = max(built) if built else 0.0  # a spare building its rank's stage
    rec.first_step_s = max(firsts) - t_ready
    rec.kill_to_training_s = t_ready - tk
    rec.kill_to_first_step_s = max(firsts) - tk
    first = chain_start(coord.recoveries, rec)
    if first is not rec:  # a cascade: time from the first fault of the chain
        rec.first_kill_to_first_step_s = max(firsts) - first.t_kill
    prot = [float(t) for t in reports["protected"].poll().values()]
    rec.kill_to_protected_s = (max(prot) - tk) if len(prot) == len(ranks) else None
    rec.bytes_transferred = sum(t.bytes_received for t in timings)
    rec.outcome = "hot-swapped" if rec.get("spare_slot") not in (None, []) else \
        "regrouped (no rank lost)"
    fallback = rec.get("fallback")
    if fallback == "disk":
        rec.outcome = "restarted from disk"
    if fallback in ("restart", "shrink", "grow"):  # relaunched, or regrouped in place from disk
        rec.outcome = {"restart": "relaunched from checkpoint",
                       "shrink": f"shrunk to dp={rec.get('dp')}",
                       "grow": f"regrown to dp={rec.get('dp')}"}[fallback]
        rec.load_s, rec.rollback_s = rec.rollback_s, UNSET  # the checkpoint load
        if rec.get("t_relaunch") is not None:  # (in place, no process started)
            # interpreter start -> module running, and importing torch + deadpool
            rec.exec_s = max(t.exec for t in timings) - rec.t_relaunch
            rec.imports_s = max(t.imported - t.exec for t in timings)


def chain_start(recoveries: list[RecoveryRecord], rec: RecoveryRecord) -> RecoveryRecord:
    """The first recovery of an uninterrupted chain of interrupted ones ending at ``rec``."""
    first = rec
    for r in reversed(recoveries):
        if r.get("outcome") != INTERRUPTED:
            break
        first = r
    return first
