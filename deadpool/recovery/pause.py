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
on reading the plan: where the plan names it as its old rank's source (``Source`` kind
``retiring``) it sends the pause step's snapshot to the spare (``send_own``: a 2-process gloo
group of its own, ``xfer/s<slot>-<rank>`` in g+1's namespace; the spare checks the bytes against
the checksums this process's sealed status reported), and ``retire`` keeps it until the
coordinator seals ``running_key(g+1)`` (every rank of g+1 took its first step and is protected
again: ``Migrations.poll``), or g+1 is aborted first (the spare died before its first step: the
next plan restores the rank from its buddies' replicas, as any failure's), or the job ends.
"""

from __future__ import annotations

import threading
import time

from deadpool.rank.comm import _new_group
from deadpool.rank.straggler import pack_paused
from deadpool.snapshot.transfer import outgoing
from deadpool.snapshot.wire import post_sends
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
    send_own(worker, plan)
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


def send_own(worker, plan) -> threading.Thread | None:
    """Send this process's snapshot of ``plan.resume_step`` to the rank the plan says takes it
    from here (``Source("retiring", <this slot>)``), on a daemon thread: the process exits when
    the generation runs or is aborted, whatever the send is doing (the spare's receive then
    fails, g+1 is aborted, and the next plan takes the buddy's replica)."""
    to = [r for r, src in sorted(plan.sources.items())
          if src.kind == "retiring" and src.holder == worker.slot]
    if not to:
        return None
    (rank,), S, eng = to, plan.resume_step, worker.trainer.engine
    piece = outgoing(eng, "peer", rank, S, None, worker.trainer.header)  # the local snapshot
    prefix = f"g{plan.generation}/xfer/s{worker.slot}-{rank}/"
    timeout = float(worker.ft["pg_timeout_s"])

    def send():
        try:
            pg = _new_group("gloo", worker.open_store(), prefix, 0, 2, timeout)
            for w in post_sends(pg, 1, S, *piece, "all", eng.chunk_bytes,
                                after_first_chunk=lambda: worker.injector.fire(S, "transfer")):
                w.wait()
            print(f"[slot {worker.slot}] sent rank {rank}'s state at step {S} to its spare",
                  flush=True)
        except Exception as e:  # the spare gone, or the generation aborted: the replica route
            print(f"[slot {worker.slot}] sending rank {rank}'s state failed: {e}", flush=True)

    t = threading.Thread(target=send, name="send-own", daemon=True)
    t.start()
    return t
