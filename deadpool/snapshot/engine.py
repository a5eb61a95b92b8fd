"""The snapshot engine: a rank's local ring of snapshots and the copier thread that fills it.

After optimizer step ``s`` the trainer calls ``snapshot(s)``; the engine copies parameters and
optimizer state into one flat host buffer (a slot of a small local ring) *off the critical path*:
on CPU a copier thread does it while the next step's forward/backward runs; on CUDA the copy is
issued on a side stream into pinned memory. Parameters only change again in the next optimizer
step, so the trainer must call ``wait_copy()`` after backward and before ``optimizer.step()``:
that wait is the only time snapshots can block training, and it is measured (``blocked_s``).

The copier hands each finished snapshot to this generation's ``Replicator`` (replication.py),
which sends it to the rank's ``ft.replicas`` buddies and receives its wards' (a rank holds the
replicas of as many wards as it has buddies).
The invariant that makes recovery always possible: a rank never drops its local snapshot, nor a
replica, of the newest protected step it knows of, nor anything newer. So the newest protected
step is always in every survivor's local ring and in each of the dead rank's buddies' replicas. If
replication falls behind, ``snapshot()`` waits for a slot it may overwrite (backpressure, counted
in ``blocked_s``) rather than skipping steps. Nor is a slot reused while its previous snapshot is
queued, copied or checksummed (``Slot.pending``): on CUDA the host never waits for the copy, and
a copier slower than the step fell behind without bound, hashing buffers being overwritten. The
ring's buffers are allocated in the background (ring.py); a snapshot waits only for its own.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from deadpool.errors import CorruptState
from deadpool.snapshot.buffers import Replica, Slot
from deadpool.snapshot.layout import (StateLayout, checksum, decode_header, encode_header,
                                      region_crcs)
from deadpool.snapshot.persist import persist_snapshot
from deadpool.snapshot.replication import Replicator
from deadpool.snapshot.ring import RingAllocator, device_copy, device_wait
from deadpool.snapshot.transfer import check_header
from deadpool.store.rounds import rounds_for
from deadpool.threads import lower_thread_priority
from deadpool.topology import replica_region


class SnapshotEngine:
    """Owns the local snapshot ring, the wards' replicas, and the copier / replication threads."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], *,
                 num_local_slots: int = 3, chunk_bytes: int = 4 << 20, device: str = "cpu",
                 fault_hook=None, background_nice: int = 0, verify: str = "lazy",
                 num_shared: int = 0, replicate: str = "unique",
                 max_bytes_per_s: float | None = None, allocate_slots: bool = True):
        if num_local_slots < 2:
            raise ValueError("ft.num_local_slots must be >= 2 (one being written, one to roll back to)")
        self.tensors = [t for _, t in tensors]
        self.layout = StateLayout(tensors)
        n = self.layout.nbytes
        split = self.layout.entries[num_shared].offset if num_shared < len(tensors) else n
        self.bounds = {"all": (0, n), "shared": (0, split), "unique": (split, n)}
        # travels in every snapshot header: a holder of a replica whose owner has another stage
        # can still name its tensors (e.g. to write it to disk)
        self.layout_desc = {"split": split, "entries": [
            [e.name, e.offset, e.nbytes, str(e.dtype).removeprefix("torch."), list(e.shape)]
            for e in self.layout.entries]}
        # what the buddy receives every snapshot ("none": nobody needs a replica)
        self.repl_region = replica_region(replicate, split > 0, split < n)
        self.chunk_bytes = max(1 << 16, int(chunk_bytes))
        self.max_bytes_per_s = max_bytes_per_s
        self.device = device
        self.fault_hook = fault_hook or (lambda step, phase: None)
        self.background_nice = int(background_nice)
        if verify not in ("eager", "lazy"):
            raise ValueError(f"ft.replica_verify must be 'eager' or 'lazy', got {verify!r}")
        self.verify = verify
        pin = self.pinned = device.startswith("cuda") and torch.cuda.is_available()
        # ``allocate_slots=False`` (ft.snapshot=false): a buffer is allocated at its slot's first
        # snapshot (after a recovery, say), never the whole pinned ring for nothing
        self.slots = [Slot(None) for _ in range(num_local_slots)]
        self.replicas: dict[int, list[Replica]] = {}
        self._lock = threading.Condition()
        self._ring = RingAllocator(self.slots, self._alloc, self._lock)  # ring.py
        if allocate_slots:
            self._ring.start()
        self._copy_q: queue.Queue = queue.Queue()
        self._last_copy: Slot | None = None
        self._side_stream = torch.cuda.Stream() if pin else None
        self._copier = threading.Thread(target=self._copy_loop, name="snapshot-copier", daemon=True)
        self._copier.start()
        self._repl: Replicator | None = None
        self.num_buddies = 1  # ft.replicas: holders of this rank's replica (from the topology)
        self._protected = -1          # newest step known protected in the current generation
        self.rounds = None            # this generation's agreements (deadpool.store.rounds)
        # timings of the latest snapshot / replication (seconds), read by the trainer's metrics
        self.last_copy_s = 0.0
        self.last_replicate_s = 0.0
        self.blocked_s = 0.0
        # newest snapshot this rank has finished (copied, and replicated when it replicates),
        # and how long that took from the snapshot call (the cycle the schedule must cover)
        self.done_step = -1
        self.taken_step = -1
        self.last_cycle_s: float | None = None
        self.copy_error: BaseException | None = None  # the copier thread failed: fatal for the rank
        # periodic disk checkpoints (checkpoint.AsyncPersister), fed from the copier thread
        self.persister = None
        self.persist_every = 0
        self.persist_world = 1
        self._persist_flat: torch.Tensor | None = None

    def close(self) -> None:
        """Stop the engine's threads (its rank is rebuilt for other coordinates)."""
        self.stop_replication()
        self._copy_q.put(None)
        if self.persister is not None:
            self.persister.close()

    def _alloc(self) -> torch.Tensor:
        flat = torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self.layout.zero_gaps(flat)  # no state there, but the same bytes in every copy

    def ring_allocated(self) -> bool:
        """Every slot of the local ring has its buffer (the background allocation is done)."""
        return self._ring.done()

    def _next_slot(self, step: int) -> "Slot":
        """The slot to write ``step`` into: the one already holding ``step`` (a snapshot taken
        again, e.g. after a restore: two slots of one step would leave no older one to reuse),
        else the one holding the oldest snapshot (or none)."""
        same = [s for s in self.slots if s.step == step]
        return same[0] if same else min(self.slots, key=lambda s: s.step)

    # -- main thread: take a snapshot -------------------------------------------------------------
    def snapshot(self, step: int, header: dict, abort_check=None, on_block=None) -> None:
        """Start an asynchronous snapshot of the live state tagged ``step``. Main thread only.

        ``abort_check`` is called while waiting for a free slot; it must raise if the generation
        was aborted (a replication peer may be gone, so the slot would never free up).
        ``on_block`` is called once if the call has to wait (backpressure).
        """
        self._raise_copy_error()
        slot = self._next_slot(step)
        t0 = last_check = time.perf_counter()
        blocked = False
        while True:
            with self._lock:
                # its previous snapshot still queued, copied, checksummed or replicated
                if slot.replicating or slot.pending:
                    self._lock.wait(0.01)
                    busy = True
                else:
                    busy = False
            if not busy and (self._repl is None or self._may_overwrite(slot)):
                break
            if not blocked and on_block is not None:
                on_block()
            blocked = True
            if abort_check is not None and time.perf_counter() - last_check > 0.01:
                abort_check()
                last_check = time.perf_counter()
            if not busy:
                time.sleep(0.0005)
        self._ring.ensure(slot)  # the background allocation may not have reached it yet
        self.blocked_s += time.perf_counter() - t0
        slot.released.clear()
        slot.copied.clear()
        slot.taken_at = time.perf_counter()
        slot.step = self.taken_step = step
        slot.header = encode_header(dict(header, layout=self.layout_desc))
        with self._lock:
            slot.pending = True
        if self._side_stream is not None:
            slot.cuda_event = self._device_copy(slot)
        self._last_copy = slot
        self._copy_q.put(slot)

    def _device_copy(self, slot: "Slot"):
        return device_copy(self.layout.views(slot.flat), self.tensors, self._side_stream)

    _device_wait = staticmethod(device_wait)

    def _is_protected(self, step: int) -> bool:
        if step <= self._protected:
            return True
        if self.rounds is None:
            return False
        if self.rounds.protected(step):
            self._protected = max(self._protected, step)
            return True
        return False

    def wait_done(self, step: int, abort_check) -> None:
        """Block until snapshot ``step`` is copied and replicated (``ft=sync_snapshot``); the wait
        counts as blocked time. ``abort_check`` must raise once the generation is aborted."""
        t0 = last = time.perf_counter()
        while self.done_step < step:
            self._raise_copy_error()
            if self._repl is not None and self._repl.stopped:
                break  # replication failed: the coordinator is told and aborts the generation
            if time.perf_counter() - last > 0.01:
                abort_check()
                last = time.perf_counter()
            time.sleep(0.0002)
        self.blocked_s += time.perf_counter() - t0

    def in_flight(self) -> bool:
        """A snapshot's copy or replication has not finished yet."""
        return self.done_step < self.taken_step

    def slows_step(self) -> bool:
        """Snapshot work that can slow the step about to start is running (the schedule's
        "active" steps must be the ones slowed, or a probe's steps never read as quiet): on the
        host path any copy, checksum or replication; on CUDA the newest snapshot's device copy
        (the step's optimizer waits for it on the GPU) or replication, not the host's checksum."""
        if self._side_stream is None:
            return self.in_flight()
        slot = self._last_copy
        copying = slot is not None and slot.cuda_event is not None and not slot.cuda_event.query()
        return copying or any(s.replicating for s in self.slots)

    def pending_cycle_s(self) -> float | None:
        """How long the oldest unfinished snapshot has been running: a lower bound on its cycle,
        which the schedule counts before the cycle ends (a copier far behind reports none)."""
        with self._lock:
            open_ = [s.taken_at for s in self.slots
                     if s.step > self.done_step and (s.pending or s.replicating)]
        return time.perf_counter() - min(open_) if open_ else None

    def protected_floor(self) -> int:
        """The newest step this rank knows every rank has replicated (-1: none yet)."""
        return self._protected

    def _may_overwrite(self, slot: "Slot") -> bool:
        """A slot may be reused once a newer step than the one it holds is protected."""
        if slot.step < 0:
            return True
        newer = sorted((s.step for s in self.slots if s.step > slot.step), reverse=True)
        return any(self._is_protected(st) for st in newer)

    def wait_copy(self) -> None:
        """Must be called after backward and before the optimizer step: the live state may change."""
        slot = self._last_copy
        if slot is None:
            return
        t0 = time.perf_counter()
        if slot.cuda_event is not None:
            self._device_wait(slot.cuda_event)  # GPU-side wait, CPU goes on
        else:
            slot.released.wait()
        self.blocked_s += time.perf_counter() - t0
        self._raise_copy_error()

    def _raise_copy_error(self) -> None:
        if self.copy_error is not None:
            raise RuntimeError(f"snapshot copier failed: {self.copy_error}") from self.copy_error

    def _copy_loop(self) -> None:
        lower_thread_priority(self.background_nice)
        while True:
            slot: Slot = self._copy_q.get()
            if slot is None:
                return
            t0 = time.perf_counter()
            try:
                self.fault_hook(slot.step, "snapshot_copy")
                if slot.cuda_event is not None:
                    slot.cuda_event.synchronize()
                else:
                    # one call, so this low-priority thread takes the GIL once, not once per
                    # tensor (a preempted low-priority GIL holder would stall the training thread)
                    torch._foreach_copy_(self.layout.views(slot.flat), self.tensors)
            except BaseException as e:  # the rank cannot snapshot any more: tell the trainer
                self.copy_error = e
                slot.step = -1
                slot.released.set()
                slot.copied.set()
                self._finish(slot, replicate=False)
                continue
            slot.released.set()  # the live state may change now; the checksum reads the copy
            slot.crc = region_crcs(slot.flat, self.bounds["unique"][0])
            self.last_copy_s = time.perf_counter() - t0
            slot.copied.set()
            if self.repl_region == "none":
                self.done_step, self.last_cycle_s = slot.step, time.perf_counter() - slot.taken_at
            if self.persist_every and slot.step > 0 and slot.step % self.persist_every == 0:
                persist_snapshot(self, slot)  # persist.py
            repl = self._repl
            replicate = repl is not None and not repl.stopped and self.repl_region != "none"
            self._finish(slot, replicate)
            if replicate:
                repl.queue.put(slot)

    def _finish(self, slot: Slot, replicate: bool) -> None:
        """The copier is done with ``slot``: reusable, unless replication takes it over (in one
        step, so a waiting ``snapshot()`` never sees it free in between)."""
        with self._lock:
            slot.replicating = slot.replicating or replicate
            slot.pending = False
            self._lock.notify_all()

    @property
    def replicated_bytes(self) -> int:
        """Bytes this rank sends per snapshot: its replicated region, once per buddy."""
        if self.repl_region == "none":
            return 0
        a, b = self.bounds[self.repl_region]
        return (b - a) * self.num_buddies

    # -- what this rank can resume from ------------------------------------------------------------
    def local_steps(self) -> list[int]:
        self.drain()
        return sorted(s.step for s in self.slots if s.step >= 0 and s.copied.is_set())

    def replica_steps(self) -> dict[int, list[int]]:
        """Steps of the complete replicas held, per owner, except those known corrupt.

        Never checksums (a status report must be quick at GB scale): whoever receives a replica
        checks it against the checksum it was taken with, and reports a mismatch.
        """
        with self._lock:
            return {o: sorted(r.step for r in rs if r.verified is not False)
                    for o, rs in self.replicas.items()}

    def corrupt_replicas(self) -> None:
        """Fault injection: flip one byte of the newest replica held of each ward (a memory
        error; its checksum no longer matches)."""
        with self._lock:
            for rs in self.replicas.values():
                if rs:
                    rs[-1].flat[rs[-1].flat.numel() // 2] ^= 0xFF

    def drain(self) -> None:
        """Wait until every queued local copy has finished (not replication)."""
        for s in self.slots:
            if s.step >= 0:
                s.copied.wait()

    def local_slot(self, step: int) -> Slot:
        self.drain()
        for s in self.slots:
            if s.step == step and s.copied.is_set():
                return s
        raise KeyError(f"no local snapshot of step {step}")

    def restore_local(self, step: int, rank: int = -1) -> dict:
        """Roll the live state back to this rank's own snapshot of ``step``; returns its header."""
        slot = self.local_slot(step)
        if not self.verify_region(slot.flat, "all", slot.crc):
            raise CorruptState(f"local snapshot of step {step} is corrupt (CRC mismatch)",
                               rank, rank, step)
        self._load(slot.flat)
        return decode_header(slot.header)

    def _load(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self.tensors, self.layout.views(flat))

    def replica(self, owner: int, step: int) -> Replica:
        with self._lock:
            for r in self.replicas.get(owner, []):
                if r.step == step:
                    return r
        raise KeyError(f"no replica of rank {owner} at step {step}")

    # -- state transfer to a rank that needs it (before replication starts) ---------------------
    def region(self, flat: torch.Tensor, region: str) -> torch.Tensor:
        """The bytes of ``region`` in a full state buffer of this rank's layout."""
        a, b = self.bounds[region]
        return flat[a:b]

    def verify_region(self, flat: torch.Tensor, region: str, crc: tuple) -> bool:
        """Check a full-size buffer's ``region`` against ``crc`` (shared, unique)."""
        split = self.bounds["unique"][0]
        ok = True
        if region in ("all", "shared"):
            ok &= checksum(flat[:split]) == crc[0]
        if region in ("all", "unique"):
            ok &= checksum(flat[split:]) == crc[1]
        return ok

    def install(self, step: int, buf: torch.Tensor, header: bytes, crc: tuple, owner=None,
                holder: int = -1, rank=None) -> dict:
        """Load a received state live and keep it as the local snapshot of ``step``. Refuses
        (``CorruptState``) a state of another step or layout, or, given the plan's ``owner``,
        of another rank (``transfer.check_header``); kept under ``rank``'s name when given."""
        header = check_header(header, step, self.layout_desc, owner, holder, rank)
        self.drain()
        slot = self._next_slot(step)
        with self._lock:
            slot.flat, slot.step, slot.header, slot.crc = buf, step, header, crc
            slot.released.set()
            slot.copied.set()
        self._load(buf)
        return decode_header(header)

    # -- replication thread lifecycle ------------------------------------------------------------
    def start_replication(self, comm, store_factory, first_step: int | None) -> None:
        """Start this generation's replication thread; optionally replicate ``first_step`` (a local
        snapshot, e.g. the state just restored) at once so the new rank is protected quickly."""
        self.stop_replication()
        topo = comm.topo
        if self.repl_region != "none" and all(b == topo.rank for b in topo.buddies()):
            # a job of one rank: nobody can hold a replica, snapshots stay local (and count as
            # protected once copied, as with nothing to replicate)
            self.repl_region = "none"
        if self.repl_region == "none":
            return  # every rank's state is held by a live data-parallel peer
        self._protected = -1
        self.rounds = rounds_for(comm, store_factory)
        self.num_buddies = len(topo.buddies())
        self._repl = Replicator(self, comm, topo.buddies(), topo.wards(), store_factory)
        self._repl.start()
        if first_step is not None:
            slot = self.local_slot(first_step)
            with self._lock:
                slot.replicating = True
            self._repl.queue.put(slot)

    def stop_replication(self) -> None:
        """Abandon the current replication thread (it may be blocked on a dead peer)."""
        if self._repl is not None:
            self._repl.stopped = True
            self._repl.queue.put(None)
            self._repl = None
        with self._lock:
            for s in self.slots:
                s.replicating = False
            self._lock.notify_all()

    def _drop_unneeded_replicas(self) -> None:
        """Forget replicas older than the newest protected one held (the invariant keeps that one
        and anything newer), so the next receive reuses their buffer."""
        with self._lock:
            for owner, reps in self.replicas.items():
                keep = [r for r in reps if r.step <= self._protected]
                floor = keep[-1].step if keep else -1
                self.replicas[owner] = [r for r in reps if r.step >= floor]

    def truncate_after(self, step: int) -> None:
        """Forget local snapshots and replicas newer than ``step`` (a timeline rolled back)."""
        self.drain()
        with self._lock:
            for s in self.slots:
                if s.step > step:
                    s.step = -1
            for owner in list(self.replicas):
                self.replicas[owner] = [r for r in self.replicas[owner] if r.step <= step]

    def _release(self, slot: Slot) -> None:
        with self._lock:
            slot.replicating = False
            self._lock.notify_all()
