"""Replication: each snapshot goes to the rank's ``k`` buddies (``ft.replicas``), and its ``k``
wards' come in, off the critical path (one thread per generation, over the generation's 2-rank
``repl_out*`` / ``repl_in*`` gloo groups, one per buddy and one per ward).

All ranks replicate the same steps in the same order, so sends and receives always pair up:
every rank posts its ``k`` sends (asynchronous) before it waits on any receive, so no order of
the receives can deadlock. A replica counts only when it is complete (and, with
``verify="eager"``, its checksum matches the sender's). A rank counts a step replicated once all
its sends and receives of it are done; a step is *protected* once every rank has (the counter
``Keys.repl_done``); the engine keeps, per ward, the newest protected replica and anything newer.
A snapshot's cycle (what the schedule measures and back-pressure waits for) thus covers all
``k`` copies.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from deadpool.snapshot.held import keep_received
from deadpool.snapshot.wire import blocking, post_sends, recv_state
from deadpool.store import reports
from deadpool.store.rounds import rounds_for
from deadpool.threads import lower_thread_priority
from deadpool.topology import repl_name


class Replicator(threading.Thread):
    """Sends each local snapshot to the buddies and receives the wards', in lockstep with all
    ranks (``buddies[j]`` and ``wards[j]``: this rank's j-th buddy and j-th ward)."""

    def __init__(self, engine, comm, buddies: tuple[int, ...], wards: tuple[int, ...],
                 store_factory):
        super().__init__(name=f"snapshot-repl-g{comm.topo.generation}", daemon=True)
        self.engine, self.comm = engine, comm
        self.buddies, self.wards = tuple(buddies), tuple(wards)
        self.queue: queue.Queue = queue.Queue()
        self.stopped = False
        self.store_factory = store_factory
        self.protected_reported = False
        self.rounds = None  # this thread's (deadpool.store.rounds; on the store, its own client)
        # fresh receive buffers per generation (an abandoned receive may still write into the
        # old ones), sized by what the ward sends: its stage may differ from this rank's
        self.recv_pool: list[torch.Tensor] = []

    def _free_recv_buffer(self, ward: int, nbytes: int, store, busy=frozenset()) -> torch.Tensor:
        """A receive buffer of ``nbytes`` that no kept replica uses, nor one received this cycle
        (``busy``: their ids; they are committed only once every ward's has arrived)."""
        eng = self.engine
        with eng._lock:
            newest = max((r.step for r in eng.replicas.get(ward, [])), default=-1)
        if newest > eng._protected and self.rounds.protected(newest):
            with eng._lock:
                eng._protected = max(eng._protected, newest)
        eng._drop_unneeded_replicas()
        with self.engine._lock:
            held = {id(r.flat) for reps in self.engine.replicas.values() for r in reps} | busy
        for b in self.recv_pool:
            if id(b) not in held and b.numel() == nbytes:
                return b
        # 2 per ward in steady state (the newest protected replica, the one arriving); more
        # only while replication runs ahead of protection
        b = torch.empty(nbytes, dtype=torch.uint8)
        self.recv_pool.append(b)
        return b

    def run(self) -> None:
        lower_thread_priority(self.engine.background_nice)
        outs = [self.comm.group(repl_name("out", j)) for j in range(len(self.buddies))]
        ins = [self.comm.group(repl_name("in", j)) for j in range(len(self.wards))]
        dst, src = 1, 0  # repl_out* is [me, buddy]; repl_in* is [ward, me]
        store = None
        while True:
            slot = self.queue.get()
            if slot is None or self.stopped:
                return
            t0 = time.perf_counter()
            try:
                store = store or self.store_factory()
                self.rounds = self.rounds or rounds_for(self.comm, lambda: store)
                # a "replication" fault fires after the first chunk to the first buddy is
                # posted, the rest not: that buddy is left with a torn replica of this step
                region = self.engine.repl_region
                sends = []
                for j, out in enumerate(outs):
                    hook = ((lambda s=slot.step: self.engine.fault_hook(s, "replication"))
                            if j == 0 else None)
                    sends += post_sends(out, dst, slot.step, self.engine.region(slot.flat, region),
                                        slot.header, slot.crc, region, self.engine.chunk_bytes,
                                        after_first_chunk=hook)
                got = []  # (ward, step, buffer, header, crc), committed once all are in
                for ward, inp in zip(self.wards, ins):
                    held = {}

                    def buffer(nbytes, ward=ward, held=held):
                        held["buf"] = self._free_recv_buffer(ward, nbytes, store,
                                                             busy={id(g[2]) for g in got})
                        return held["buf"]
                    step, header, crc, _ = recv_state(inp, src, buffer, self.engine.chunk_bytes,
                                                       wait=blocking)
                    got.append((ward, step, held["buf"], header, crc))
                for w in sends:
                    w.wait()
                rate = self.engine.max_bytes_per_s
                if rate:  # the replication rate cap: a snapshot takes at least its bytes / rate
                    a, b = self.engine.bounds[region]
                    time.sleep(max(0.0, len(outs) * (b - a) / rate - (time.perf_counter() - t0)))
            except Exception as e:
                # a peer is gone, or this thread failed: either way the ring is broken and
                # every rank would soon wait on protection forever. Report it so the
                # coordinator aborts the generation and rebuilds (replacing whoever is dead).
                if not self.stopped:
                    self.stopped = True
                    try:
                        self.comm.report_error(f"replication of step {slot.step} failed: {e}")
                    except Exception:
                        pass
                self.engine._release(slot)
                return
            self.engine._release(slot)
            kept = keep_received(self.engine, got, self)
            if kept is None:
                return
            self.engine.last_replicate_s = time.perf_counter() - t0
            self.engine.done_step = slot.step
            self.engine.last_cycle_s = time.perf_counter() - slot.taken_at
            if kept and self.rounds.replicated(slot.step):  # (a dropped replica: not replicated)
                with self.engine._lock:
                    self.engine._protected = max(self.engine._protected, slot.step)
            if kept and not self.protected_reported:
                keys, comm = self.comm.keys, self.comm
                reports.send(store, comm.seal, comm.link, keys, "protected", comm.topo.rank,
                             repr(time.time()))
                if comm.link is None:  # the coordinator's wake-up hint, after the sealed report
                    store.add(keys.protected_count, 1)
                self.protected_reported = True
