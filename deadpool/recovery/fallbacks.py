"""Step 5 of a recovery: what the coordinator does when a hot swap is not possible.

    no_recovery         ft.strategy recovers nothing (none) or restarts everything
                        (checkpoint_restart): the job ends here; ``job.run_job`` relaunches it
    from_disk           (``recovery.disk``) no copy of some rank survives in memory: every rank restarts from the
                        newest complete disk checkpoint (else the job stops, naming the ranks)
    stalled             too many recoveries without a completed step: write and stop
    no_spare            a rank has no process and no spare is left: the consistent state goes
                        to disk, then ``ft.on_no_spare`` (elastic | checkpoint_restart |
                        checkpoint_and_stop)
    grow                an elastic job below its full width regrows (a planned regroup)

Each ends the generation with a plan of its own (``stop`` or ``checkpoint_and_stop``) and sets
``coord.outcome`` when the job ends or relaunches.
"""

from __future__ import annotations

import json
import time

from deadpool import checkpoint
from deadpool.errors import WriterLost
from deadpool.recovery import detect, elastic, plan, timeline
from deadpool.recovery.disk import from_disk, resume_hint, stop, write_state
from deadpool.store import reports
from deadpool.store.protocol import UNSET, Keys, Plan, RecoveryRecord


def no_recovery(coord, failed: dict[int, str], t_detect: float) -> None:
    """ft=none: the failure ends the job; ft=checkpoint_restart: the job ends here and
    ``job.run_job`` tears every process down and relaunches the job from the newest complete
    checkpoint (the record says which)."""
    g = coord.gen
    rec = RecoveryRecord(g + 1, failed_rank=timeline.one_or_list(sorted(failed)),
                         detected_by=failed[min(failed)] if failed else "collective_error",
                         detect_s=None, t_detect=t_detect)
    if not coord.strategy.restarts:
        stop(coord, g + 1, rec, f"rank(s) {sorted(failed)} failed and ft.strategy="
                                f"{coord.strategy.name} recovers nothing")
        return
    got = reports.read(coord.store, coord.seal,
                       {r: Keys.fault(s) for r, s in coord.members.ranks.items() if r in failed})
    faults = [json.loads(got[r]) for r in coord.members.ranks if r in got]
    t_kill = min([f["t"] for f in faults] + [t_detect])
    step = checkpoint.latest_complete_step(coord.ft["checkpoint_dir"]) or 0
    rec.update(fault=faults[0]["kind"] if faults else "unknown", t_kill=t_kill,
               detect_s=t_detect - t_kill, failed_at_step=coord.job_step,
               resume_step=step, steps_recomputed=max(0, coord.job_step - step),
               fallback="restart")
    coord.outcome = "restart"
    coord.message = (f"rank(s) {sorted(failed)} failed: relaunching every process from the "
                     f"checkpoint of step {step}" if step else
                     f"rank(s) {sorted(failed)} failed before any complete checkpoint: "
                     "relaunching every process from step 0")
    coord.log(f"[coordinator] {coord.message}")
    coord.write_plan(Plan(g + 1, "stop", {}, -1, reason=coord.message))
    coord.members.generation = g + 1
    coord.recoveries.append(rec)


def stalled(coord, decision, rec: RecoveryRecord, t_detect: float) -> bool:
    """More recoveries in a row than ``ft.max_recoveries_without_progress`` without a completed
    step: write the consistent state and stop (a fault that recurs on every replay). Returns
    True when the job stops here."""
    coord.streak += 1
    if coord.streak <= int(coord.ft["max_recoveries_without_progress"]):
        return False
    reason = (f"{coord.streak} recoveries in a row without a completed step "
              f"(ft.max_recoveries_without_progress); last cause: {rec.detected_by}")
    if any(s.kind == "disk" for s in decision.sources.values()):
        stop(coord, coord.gen + 1, rec, reason)
    else:
        checkpoint_and_stop(coord, coord.gen + 1, decision, rec, reason, t_detect)
    return True


def checkpoint_and_stop(coord, generation: int, decision, rec: RecoveryRecord, reason: str,
                        t_detect: float) -> None:
    """Persist the consistent state from memory (the processes left write it), then stop. A
    writer lost meanwhile leaves the step incomplete: the job stops saying so, never that it was
    written, and names the newest complete checkpoint there is."""
    try:
        p = write_state(coord, generation, "checkpoint_and_stop", decision, reason)
    except WriterLost as e:
        coord.launcher.fence(sorted(getattr(e, "lost", {e.rank: e.slot}).values()))
        stop(coord, coord.gen + 1, rec, f"{reason}: {e}; the state of step "
                                        f"{decision.resume_step} was not written; {resume_hint(coord)}")
        return
    rec.update(outcome="checkpoint_and_stop", plan_s=p.t_written - t_detect)
    coord.recoveries.append(rec)
    coord.outcome = "checkpoint_and_stop"
    coord.message = (f"stopping ({p.reason}): state of step {p.resume_step} "
                     f"written to {coord.ft['checkpoint_dir']}/step_{p.resume_step}; resume with "
                     f"ft.resume_from={coord.ft['checkpoint_dir']}"
                     + (" and more ft.num_spares" if "spare" in p.reason else ""))
    if coord.ft["on_no_spare"] == "checkpoint_and_stop" or "spare" not in p.reason:
        coord.log(f"[coordinator] {coord.message}")  # (else the job goes on: said by the caller)


def no_spare(coord, generation: int, decision, rec: RecoveryRecord, dead: set[int],
             t_detect: float, statuses: dict | None = None) -> None:
    """A rank has no process and no spare is left: the consistent state (every rank's, from
    memory) goes to disk, then ``ft.on_no_spare``: ``elastic`` - the job goes on without the
    dead ranks' data-parallel replicas (the smallest unit containing them; global batch kept,
    ``parallel.global_dp``), in place (``recovery.elastic``: the survivors keep their
    processes) or, with ``ft.elastic_mode=relaunch``, relaunched by ``job.run_job`` at the new
    width; ``checkpoint_restart`` - it relaunches every process at the same width;
    ``checkpoint_and_stop`` - the job stops there. ``statuses``: what the survivors reported,
    to plan again if one dies while the in-place checkpoint is written."""
    dims = coord.dims
    action = coord.ft["on_no_spare"]
    dropped = sorted({dims.coords(d)["dp"] for d in dead})
    if action == "elastic" and dims.dp - len(dropped) < 1:
        coord.log("[coordinator] elastic: no data-parallel replica would be left; stopping")
        action = "checkpoint_and_stop"
    in_place = action == "elastic" and coord.ft.get("elastic_mode", "in_place") == "in_place"
    if any(s.kind == "disk" for s in decision.sources.values()) and not in_place:
        stop(coord, generation, rec, f"{decision.reason}; no warm spare left to restart from "
                                     f"the disk checkpoint at step {decision.resume_step}")
        return
    if in_place:  # (from memory, or from the complete disk checkpoint the decision names)
        _regroup_in_place(coord, generation, decision, rec, set(dead), t_detect, statuses or {})
        return
    checkpoint_and_stop(coord, generation, decision, rec, "no warm spare left", t_detect)
    if action == "checkpoint_and_stop" or coord.outcome != "checkpoint_and_stop":
        return
    rec.outcome = UNSET
    if action == "elastic":
        rec.update(fallback="shrink", elastic="relaunch", dropped_dp=dropped,
                   dp=dims.dp - len(dropped))
        coord.outcome = "shrink"
        coord.message = (f"no warm spare left: continuing without data-parallel replica(s) "
                         f"{dropped} (dp {dims.dp} -> {rec.dp}) from step "
                         f"{decision.resume_step}")
    else:
        rec.update(fallback="restart", failed_at_step=coord.job_step)
        coord.outcome = "restart"
        coord.message = (f"no warm spare left: relaunching every process from step "
                         f"{decision.resume_step}")
    coord.log(f"[coordinator] {coord.message}")


def _regroup_in_place(coord, generation: int, decision, rec: RecoveryRecord, dead: set[int],
                      t_detect: float, statuses: dict, grow_to: int | None = None) -> None:
    """Shrink in place without the data-parallel replicas of ``dead`` (or, with ``grow_to`` and
    nobody dead, regrow to that width): ``elastic.reshape``. A process that dies while the
    regroup's checkpoint is written takes what it held with it: plan again from what the others
    reported (``statuses``), without its replica too, one generation on."""
    dims = coord.dims
    while True:
        dropped = sorted({dims.coords(d)["dp"] for d in dead})
        keep = [d for d in range(dims.dp) if d not in dropped]
        if not keep:
            stop(coord, coord.gen + 1, rec, "no data-parallel replica left to continue with")
            return
        if decision.resume_step is None:
            decision = from_disk(coord, decision, rec)
            if decision is None:
                return
        dp = grow_to if grow_to is not None and not dead else len(keep)
        if dead:
            coord.log(f"[coordinator] no warm spare left: continuing in place without data-"
                      f"parallel replica(s) {dropped} (dp {dims.dp} -> {dp}) from step "
                      f"{decision.resume_step}")
            rec.update(fallback="shrink", dropped_dp=dropped,
                       failed_rank=timeline.one_or_list(sorted(dead)))
        try:
            elastic.reshape(coord, generation, decision, rec, dp, keep, t_detect)
        except WriterLost as e:
            coord.log(f"[coordinator] {e}: planning the regroup again without it")
            gone = getattr(e, "lost", {e.rank: e.slot})
            for r in gone:
                coord.members.ranks.pop(r, None)
            coord.launcher.fence(sorted(gone.values()))
            dead = dead | set(gone)
            decision = plan.decide(coord, {r: st for r, st in statuses.items() if r not in dead})
            # the lost writer's copy may be older (its buddy's replica of an earlier step): the
            # record names the step and sources the job really resumes from
            rec.update(resume_step=decision.resume_step,
                       steps_recomputed=decision.steps_recomputed,
                       sources=decision.described_sources())
            generation = coord.gen + 1
            continue
        coord.grow_at = _grow_time(coord) if dp < int(coord.configured["parallel"]["dp"]) else None
        return


def _grow_time(coord) -> float | None:
    """When the job regrows: a ``time.monotonic()`` deadline of this process (never written
    for another process to read)."""
    after = coord.ft.get("elastic_regrow_after_s")
    return None if after is None else time.monotonic() + float(after)


def grow(coord) -> None:
    """An elastic job below its full width regrows once a replacement is available
    (``ft.elastic_regrow_after_s`` after the shrink, standing in for a repaired node joining):
    a planned regroup writes the consistent state, then in place (``recovery.elastic``) the new
    processes, warm by now, join the survivors at full width; with ``ft.elastic_mode=relaunch``
    ``job.run_job`` relaunches every process at full width."""
    g, t = coord.gen, time.time()
    keys = Keys(g)
    in_place = coord.ft.get("elastic_mode", "in_place") == "in_place"
    coord.announce_abort("regrow")
    timeline.finish_pending(coord, force=True)
    timeline.finish_pending(coord, interrupted=True)
    failed: dict[int, str] = {}
    statuses = detect.collect_statuses(coord, failed, keys)
    if failed:  # somebody died meanwhile: an ordinary recovery
        coord.recover(failed, t)
        return
    decision = plan.decide(coord, statuses)
    rec = RecoveryRecord(g + 1, failed_rank=None, detected_by="regrow", fault="none", t_kill=t,
                         t_detect=t, detect_s=0.0, resume_step=decision.resume_step,
                         steps_recomputed=decision.steps_recomputed)
    full = int(coord.configured["parallel"]["dp"])
    coord.grow_at = None
    if in_place:
        coord.log(f"[coordinator] regrowing in place to dp={full} from step "
                  f"{decision.resume_step}")
        rec.update(fallback="grow")
        _regroup_in_place(coord, g + 1, decision, rec, set(), t, statuses, grow_to=full)
        return
    checkpoint_and_stop(coord, g + 1, decision, rec, "regrow", t)
    if coord.outcome == "checkpoint_and_stop":
        rec.outcome = UNSET
        rec.update(fallback="grow", elastic="relaunch", dp=full)
        coord.outcome, coord.message = "grow", f"regrowing to dp={full}"
        coord.log(f"[coordinator] {coord.message} from step {decision.resume_step}")
