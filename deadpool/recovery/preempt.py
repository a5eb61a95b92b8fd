"""A stop on request (walltime, preemption, Ctrl-C: ``deadpool.launch.stop``), coordinator side.

The steps of a recovery that cannot go on (``fallbacks.checkpoint_and_stop``), without a failure:

    abort     g/abort: every rank leaves what it is doing within one poll (training stops now)
    collect   each rank says what it holds (``detect.collect_statuses``; the silent are lost)
    plan      the newest step every rank can reach from memory: its own state or snapshot, a
              data-parallel peer's, a buddy's replica (``plan.decide``)
    write     plan g+1 = checkpoint_and_stop: each rank, or the holder of its copy, writes that
              step; meta.json once all have (``disk.write_state``): a complete checkpoint
    end       job/stop: spares and agents leave; the summary says how to resume

All of it within ``ft.stop_timeout_s`` of the request: status collection takes at most
``ft.status_timeout_s`` (a silent rank), the write the time left; a write not complete by then
leaves the step incomplete on disk (never read: ``checkpoint.is_complete``), and every process is
fenced. ``coord.stop_record`` is the summary's ``stop``.
"""

from __future__ import annotations

import time
from pathlib import Path

from deadpool import checkpoint
from deadpool.errors import JobFailed, WriterLost
from deadpool.recovery import detect, plan, timeline
from deadpool.recovery.disk import resume_hint, write_state
from deadpool.store.protocol import Keys, Plan


class StoppedBeforeStart(JobFailed):
    """A stop was asked for while the processes were still starting: nothing to write."""


def requested(coord) -> bool:
    """A stop was asked for: a signal to this process, or a node agent's sealed request (read
    under node agents only: nobody else sends one)."""
    st = coord.stopper
    if st is None:
        return False
    if st.why is None and coord.events is not None:
        st.poll_agents(coord)
    if st.why is not None and not st.taken:  # the agents' answer (``launch.stop.ask``)
        st.taken = True
        coord.store.set(Keys.STOP_TAKEN, coord.seal.wrap(Keys.STOP_TAKEN, "1"))
    return st.why is not None


def before_start(coord) -> None:
    """Called while the processes start (``Coordinator.wait_warm``): a stop ends the job there."""
    if requested(coord):
        raise StoppedBeforeStart(f"stopped by {coord.stopper.why} before the first step: nothing "
                                 f"to write; {resume_hint(coord)}")


def due(coord) -> bool:
    """Once per turn of the coordinator's loop: when a stop was asked for, carry it out
    (``save_and_stop``) and return True (the loop ends)."""
    if not requested(coord):
        return False
    save_and_stop(coord)
    return True


def save_and_stop(coord) -> None:
    st, g, ckpt = coord.stopper, coord.gen, coord.ft["checkpoint_dir"]
    deadline = st.t_mono + float(coord.ft["stop_timeout_s"])
    at = coord.job_step  # (the newest any rank reported: the statuses below may know a newer one)
    coord.log(f"[coordinator] {st.why}: training stops; writing the newest step every rank holds "
              "in memory")
    coord.announce_abort(f"stop: {st.why}")
    timeline.finish_pending(coord, force=True)
    timeline.finish_pending(coord, interrupted=True)  # a recovery still open never completes
    failed: dict[int, str] = {}
    statuses = detect.collect_statuses(coord, failed, Keys(g))
    for rank in failed:  # (fenced by the collection) their copies come from peers or replicas
        coord.members.ranks.pop(rank, None)
    at = max([at] + [s.live_step for s in statuses.values() if s.live_step is not None])
    decision = plan.decide(coord, statuses)
    coord.stop_record = {"signal": st.why, "t_request": st.t, "at_step": at, "lost_ranks":
                         sorted(failed), "resume_step": None, "checkpoint": None,
                         "request_to_written_s": None}
    coord.outcome = "preempted"
    if decision.resume_step is None:
        coord.write_plan(Plan(g + 1, "stop", {}, -1, reason=f"stop: {st.why}"))
        coord.members.generation = g + 1
        coord.message = (f"stopped by {st.why} at step {at}; nothing consistent to write from "
                         f"memory ({decision.reason}); {resume_hint(coord)}")
        coord.log(f"[coordinator] {coord.message}")
        return
    S = decision.resume_step
    try:
        write_state(coord, g + 1, "checkpoint_and_stop", decision, f"stopped by {st.why}",
                              timeout_s=max(1.0, deadline - time.monotonic()))
    except WriterLost as e:
        coord.log(f"[coordinator] {e}")
    step_dir = Path(ckpt) / f"step_{S}"
    if checkpoint.is_complete(step_dir):
        took = time.monotonic() - st.t_mono
        coord.stop_record.update(resume_step=S, checkpoint=str(step_dir),
                                 request_to_written_s=round(took, 3))
        coord.message = (f"stopped by {st.why} at step {at}: the state of step {S} is on disk in "
                         f"{step_dir} ({took:.2f} s after the request); resume with "
                         f"ft.resume_from=auto (this run directory) or ft.resume_from={ckpt}")
    else:  # late or lost writers: nobody may linger
        coord.launcher.fence(sorted(set(coord.members.ranks.values()) | set(coord.members.spares)))
        coord.message = (f"stopped by {st.why} at step {at}: the state of step {S} was not "
                         f"written completely within ft.stop_timeout_s="
                         f"{coord.ft['stop_timeout_s']} s; {resume_hint(coord)}")
    coord.log(f"[coordinator] {coord.message}")


