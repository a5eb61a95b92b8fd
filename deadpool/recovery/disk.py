"""Between memory and disk, for the coordinator: the state of the resume step written to a
checkpoint by the processes that hold it, or every rank restarted from the newest complete one.

    write_state   plan a generation whose processes write the state of the resume step from
                  memory (``checkpoint_and_stop`` or an elastic ``checkpoint``); complete once
                  every writer's sealed report is in and meta.json is written
    from_disk     no copy of some rank survives in memory: every rank restarts from the newest
                  complete disk checkpoint (else the job stops, naming the ranks)
    stop          the job cannot recover: plan ``stop`` and say why
    resume_hint   how a stopped job resumes: the newest complete checkpoint there is

Used by ``recovery.fallbacks``, ``recovery.elastic`` and ``recovery.preempt``; imports none of them.
"""

from __future__ import annotations

from deadpool import checkpoint
from deadpool.errors import WriterLost
from deadpool.recovery.detect import exit_text
from deadpool.store import reports
from deadpool.store.protocol import Keys, Plan, RecoveryRecord, Source
from deadpool.threads import wait_until


def write_state(coord, generation: int, action: str, decision, reason: str,
                timeout_s: float = 300.0) -> Plan:
    """Plan ``generation`` = ``action`` (``checkpoint_and_stop``: the processes exit after;
    ``checkpoint``: they wait for the next plan): every process with a rank writes the state of
    the resume step from memory (its own, or a replica it holds). Returns once every rank's
    sealed report is in and the step's meta.json makes the checkpoint complete. Raises
    ``WriterLost`` (``lost``: every writer rank -> slot lost) as soon as a writer that has not
    reported exited, stopped beating (SIGSTOP, a lost node) or hangs in its write (the progress
    watchdog: ``checkpoint`` is a watched phase), and for every writer missing after
    ``timeout_s``: meta.json is then never written, so the step never reads as complete."""
    p = Plan(generation, action, dict(coord.members.ranks), decision.resume_step,
             decision.sources, reason=reason, layout=coord.layout)
    coord.write_plan(p)
    coord.members.generation = generation
    keys = Keys(p.generation)
    done = reports.Reports(coord.store, coord.seal, keys.checkpointed, p.assignments,
                           on_forged=lambda r: coord.log(f"[coordinator] checkpoint report of rank "
                                                         f"{r} without the job's secret: ignored"))
    for slot in p.assignments.values():
        coord.live.reset_progress(slot)  # the write's progress clock starts now
    by_slot = {s: r for r, s in p.assignments.items()}

    def lost(slots, why: str) -> WriterLost:
        gone = {by_slot[s]: s for s in slots}
        r = min(gone)
        seen = "; ".join(f"slot {s}: " + (exit_text(code) if (code := coord.launcher.poll(s))
                                          is not None else coord.live.evidence(s))
                         for s in sorted(gone.values()))
        e = WriterLost(r, gone[r], f"rank(s) {sorted(gone)} (slot(s) {sorted(gone.values())}) "
                                   f"{why} while writing the state of step {p.resume_step} to "
                                   f"disk ({reason}; {seen}); the newest complete checkpoint under "
                                   f"{coord.ft['checkpoint_dir']} is the way back")
        e.lost = gone
        return e

    def written() -> bool:
        # the counter is only a hint (anyone can bump it): each rank's sealed report counts
        if int(coord.store.add(keys.checkpointed_count(), 0)) >= len(p.assignments):
            done.poll()
            if done.complete:
                return True
        waiting = [s for s in coord.suspects() if by_slot.get(s) is not None
                   and by_slot[s] not in done.got]
        gone = [s for s in waiting if coord.launcher.poll(s) not in (None, 0) or coord.lost(s)]
        hung = [s for s in coord.live.hung(list(p.assignments.values()))[0]
                if s in by_slot and by_slot[s] not in done.got]
        if gone or hung:  # its part never comes
            done.poll()  # (one that reported meanwhile is not lost)
            missing = [s for s in set(gone) | set(hung) if by_slot[s] not in done.got]
            if missing:
                raise lost(missing, "died, stopped or hung")
        return False
    # every beat read, so that a stopped writer's silence shows (under node agents, the records)
    if not wait_until(written, every_s=0.01, timeout_s=timeout_s,
                      between=lambda: coord.read_heartbeats()):
        done.poll()
        raise lost([s for s, r in by_slot.items() if r not in done.got],
                   f"did not finish within {timeout_s:.0f} s")
    dims = coord.dims
    checkpoint.write_meta(coord.ft["checkpoint_dir"], p.resume_step, dims.world_size, p.reason,
                          layout=dims.layout)
    return p


def from_disk(coord, decision, rec: RecoveryRecord):
    """No consistent copy of some rank in memory: restart every rank from the newest complete
    disk checkpoint, if there is one (else stop, saying which ranks were lost). Returns the
    decision rewritten to disk sources, or None when the job stopped."""
    roots = [r for r in (coord.ft["checkpoint_dir"], coord.ft["resume_from"]) if r]
    step_dir = None
    for root in roots:
        try:
            d = checkpoint.latest_step_dir(root)
        except (FileNotFoundError, OSError):
            continue
        if step_dir is None or int(d.name.split("_")[1]) > int(step_dir.name.split("_")[1]):
            step_dir = d
    if step_dir is None:
        stop(coord, coord.gen + 1, rec, f"{decision.reason}, and there is no complete disk "
             f"checkpoint under {roots} (ft.persist_interval_steps)")
        return None
    S = int(step_dir.name.split("_")[1])
    coord.log(f"[coordinator] {decision.reason}; falling back to the disk checkpoint of step {S}")
    decision.resume_step, decision.steps_recomputed = S, max(0, coord.job_step - S)
    decision.reason = f"{decision.reason}; restarted from disk ({step_dir})"
    decision.sources = {r: Source("disk", r, dir=str(step_dir))
                        for r in range(coord.dims.world_size)}
    rec.update(resume_step=S, steps_recomputed=decision.steps_recomputed, fallback="disk")
    return decision


def stop(coord, generation: int, rec: RecoveryRecord, reason: str) -> None:
    coord.outcome, coord.message = "unrecoverable", reason
    coord.log(f"[coordinator] cannot recover: {reason}")
    coord.write_plan(Plan(generation, "stop", {}, -1, reason=reason))
    coord.members.generation = generation
    rec.outcome = "unrecoverable"
    coord.recoveries.append(rec)


def resume_hint(coord) -> str:
    """How to resume: from the newest complete checkpoint there is, or from step 0."""
    roots = [r for r in (coord.ft["checkpoint_dir"], coord.ft.get("resume_from")) if r]
    steps = [(s, r) for r in roots if (s := checkpoint.latest_complete_step(r)) is not None]
    if not steps:
        return "no complete checkpoint exists: a new run starts from step 0"
    s, root = max(steps)
    auto = "ft.resume_from=auto or " if root == coord.ft["checkpoint_dir"] else ""
    return f"resume from the checkpoint of step {s} with {auto}ft.resume_from={root}"
