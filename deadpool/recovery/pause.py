"""A rank's side of a migration's pause: every rank holds at one step boundary.

A migration (``recovery.migrate``) moves live ranks to warm spares without losing or recomputing
a step, so the job must stop where no rank is inside a step: the coordinator pushes
``pause (g, T)`` (an event every node agent writes on its board), and each rank of generation g,
at the top of step T (step T-1 complete, nothing torn), calls ``hold_at_pause``: it snapshots T
(unless the schedule just did), waits until the snapshot is replicated to its buddies (the
moving ranks' state then exists outside their processes), marks its board word paused
(``straggler.pack_paused``) and waits for the coordinator's abort, which starts the ordinary
recovery protocol at its step 3 with every rank live at T.

A pause moved to a later step (the coordinator's first guess was passed by a rank that had not
seen the word yet) releases the ranks holding at the old one: they train on to the new step.

A process whose slot plan g+1 names in ``Plan.retire`` (its rank moved to a spare) does not exit
on reading the plan: ``retire`` keeps it until the coordinator seals ``running_key(g+1)`` (every
rank of g+1 took its first step and is protected again: ``Migrations.poll``), or g+1 is aborted
first (the spare died before its first step: the next plan restores the rank from its buddies'
replicas, as any failure's), or the job ends.
"""

from __future__ import annotations

import time

from deadpool.rank.straggler import pack_paused
from deadpool.store.protocol import Keys

RETIRE_POLL_S = 0.02  # a store round trip per poll, from one process, for a few steps


def running_key(g: int) -> str:
    """The coordinator's sealed word that generation ``g`` runs (collected with ``g``'s keys)."""
    return f"g{g}/running"


def retire(worker, plan) -> int:
    """This process's slot is in ``plan.retire``: wait until generation ``plan.generation`` runs,
    is aborted, or the job ends (or the coordinator is lost); returns the exit code (0)."""
    g, store, seal = plan.generation, worker.store, worker.seal
    keys, n = Keys(g), 0
    while True:
        if seal.flag(store, running_key(g)):
            why = "running (every rank took its first step)"
        elif seal.flag(store, keys.abort):
            why = "aborted before it ran"
        elif worker.lost.is_set() or worker._job_done() or worker._job_stopped(n):
            why = "ended with the job"
        else:
            n += 1
            time.sleep(RETIRE_POLL_S)
            continue
        print(f"[slot {worker.slot}] retired: generation {g} {why} (t={time.time():.6f})",
              flush=True)
        return 0


def hold_at_pause(tr, comm) -> None:
    """Must be called at the top of every step, before any work of step ``tr.step``. Returns at
    once unless the node's board asks generation ``comm.topo.generation`` to hold at this step;
    then raises ``Aborted`` (from ``comm.raise_if_aborted``) once the coordinator aborts, or
    returns if the pause moved."""
    link = getattr(comm, "link", None)
    if link is None or link.board.pause != (comm.topo.generation, tr.step):
        return
    T = tr.step
    tr.progress.set(T, "pause")
    tr.settle_params(comm)
    if tr.snapshots_on:
        if tr.engine.taken_step < T:  # (the schedule may have taken T at the end of T-1)
            tr.engine.snapshot(T, tr.header(), abort_check=comm.raise_if_aborted)
        tr.engine.wait_done(T, comm.raise_if_aborted)
    link.board.set_compute(link.index, pack_paused(T))
    while link.board.pause == (comm.topo.generation, T):
        comm.raise_if_aborted()
        time.sleep(0.005)
