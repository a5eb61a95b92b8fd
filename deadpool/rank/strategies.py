"""Fault-tolerance strategies of the runtime, chosen by the ``ft=`` config group.

A strategy is what a job does per step to be able to recover, and what it does when a rank
fails. The trainer and the coordinator ask the job's ``Strategy`` instead of branching on names:

    deadpool       per-step snapshots copied and replicated off the critical path (widened under
                   back-pressure, ``snapshot_schedule.py``); a failure is hot-swapped onto a warm
                   spare while the survivors keep their processes
    sync_snapshot  the same snapshots, but the training thread waits for each one's copy and
                   replication before the next step (no overlap); the same hot-swap
    none           nothing: the overhead reference; a failure ends the job cleanly
    checkpoint_restart
                   periodic torch.distributed.checkpoint writes (synchronous, or async_save
                   overlapping training), interval fixed or Young/Daly from ``ft.mtbf_s``; a
                   failure tears the whole job down and relaunches every process from the newest
                   complete checkpoint (what torchrun / a Slurm requeue do; ``job.run_job``)
    elastic        no spares: a failure drops the dead rank's data-parallel replica and the job
                   goes on narrower with the same global batch, regrowing later (the state comes
                   from the same in-memory snapshots, through one disk checkpoint re-cut for the
                   new width). In place by default, the survivors keeping their processes
                   (``ft.elastic_mode=in_place``, as torchft does); ``relaunch`` restarts every
                   process at the new width, as torchelastic does. DeadPool falls back to it
                   when its spares run out (``ft.on_no_spare``)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    recovers: bool       # a failure is hot-swapped (else the job ends, outcome "unrecoverable")
    sync_snapshot: bool  # each snapshot is copied and replicated before the next step starts
    restarts: bool = False  # a failure relaunches every process from the newest disk checkpoint


STRATEGIES = {s.name: s for s in (
    Strategy("deadpool", recovers=True, sync_snapshot=False),
    Strategy("sync_snapshot", recovers=True, sync_snapshot=True),
    Strategy("none", recovers=False, sync_snapshot=False),
    Strategy("checkpoint_restart", recovers=False, sync_snapshot=False, restarts=True),
    Strategy("elastic", recovers=True, sync_snapshot=False))}


def strategy_of(ft: dict) -> Strategy:
    """The strategy of a resolved ``ft`` config; raises ``ValueError`` on a bad combination."""
    name = ft.get("strategy", "deadpool")
    if name not in STRATEGIES:
        raise ValueError(f"ft.strategy must be one of {sorted(STRATEGIES)}, got {name!r}")
    s = STRATEGIES[name]
    if s.sync_snapshot and not ft["snapshot"]:
        raise ValueError("ft=sync_snapshot needs ft.snapshot=true")
    if not s.recovers and int(ft["num_spares"]) > 0:
        raise ValueError(f"ft={name} hot-swaps nothing: it takes no spares (ft.num_spares=0)")
    if name == "elastic" and (int(ft["num_spares"]) or ft["on_no_spare"] != "elastic"):
        raise ValueError("ft=elastic shrinks instead of swapping: ft.num_spares=0, ft.on_no_spare=elastic")
    if s.restarts:
        if ft["snapshot"]:
            raise ValueError("ft=checkpoint_restart takes no in-memory snapshots (ft.snapshot=false)")
        every = ft["persist_interval_steps"]
        if every == "auto":
            if not ft.get("mtbf_s") or float(ft["mtbf_s"]) <= 0:
                raise ValueError("ft.persist_interval_steps=auto (Young/Daly) needs ft.mtbf_s > 0")
        elif not isinstance(every, int) or every < 1:
            raise ValueError("ft=checkpoint_restart needs ft.persist_interval_steps >= 1 or 'auto', "
                             f"got {every!r}")
        if int(ft.get("max_restarts", 0)) < 0:
            raise ValueError("ft.max_restarts must be >= 0")
    elif ft["persist_interval_steps"] == "auto":
        raise ValueError("ft.persist_interval_steps=auto is for ft=checkpoint_restart")
    return s


def young_daly_steps(cost_s: float, mtbf_s: float, step_s: float) -> int:
    """Checkpoint interval in steps minimising expected lost time: Young's first-order optimum
    tau = sqrt(2 * delta * M) (Daly's higher-order correction changes it by < 10 % while
    delta < M / 50), for a checkpoint costing ``cost_s`` on the critical path, a job MTBF of
    ``mtbf_s`` and steps of ``step_s``; at least 1."""
    tau = (2.0 * max(cost_s, 1e-6) * mtbf_s) ** 0.5
    return max(1, round(tau / max(step_s, 1e-9)))


def decide_persist_interval(tr, comm, ckpt_s: float, step_s: float) -> None:
    """Young/Daly interval from this probe: each rank proposes one, all adopt the widest
    (every rank must checkpoint the same steps) as ``tr.persist_every`` (``Trainer``).
    Asynchronous checkpoints cost only their copy on the critical path, but a write must finish
    within an interval."""
    from deadpool.parallel.grad_norm import global_max  # (torch: only where a rank trains)
    ft = tr.cfg["ft"]
    write_s = tr.engine.persister.last_write_s or ckpt_s
    cost = ckpt_s - write_s if ft.get("persist_async", True) else ckpt_s
    mine = max(young_daly_steps(max(cost, 0.0), float(ft["mtbf_s"]), step_s),
               int(write_s // max(step_s, 1e-9)) + 1 if ft.get("persist_async", True) else 1)
    # what this rank measured and proposed, in this step's metrics record
    tr._proposal = {"proposed": mine, "cost_s": cost, "step_s": step_s, "write_s": write_s}
    # the widest proposal, over the job's own groups (no store request, O(log) per rank)
    tr.persist_every = int(global_max(mine, comm, tr.device))
    if tr.rank == 0:
        print(f"[rank 0] checkpoint interval {tr.persist_every} steps (Young/Daly: checkpoint "
              f"{cost * 1e3:.1f} ms on the critical path, write {write_s * 1e3:.1f} ms, step "
              f"{step_s * 1e3:.1f} ms, MTBF {float(ft['mtbf_s']):.0f} s)", flush=True)
