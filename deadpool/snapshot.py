"""The snapshot engine: per-step, asynchronous in-memory snapshots replicated to a buddy rank.

After optimizer step ``s`` the trainer calls ``snapshot(s)``; the engine copies parameters and
optimizer state into one flat host buffer (a slot of a small local ring) *off the critical path*:
on CPU a copier thread does it while the next step's forward/backward runs; on CUDA the copy is
issued on a side stream into pinned memory. Parameters only change again in the next optimizer
step, so the trainer must call ``wait_copy()`` after backward and before ``optimizer.step()``:
that wait is the only time snapshots can block training, and it is measured (``blocked_s``).

A replication thread (one per generation, with its own process group) then sends each snapshot to
the rank's buddy in chunks and receives the ward's snapshot. A replica counts only when it is
complete and its checksum (XXH3-64) matches the sender's. Each rank therefore holds:

    local ring:  its own snapshots of the last ``num_local_slots`` snapshot steps (rollback targets)
    replicas:    the last two complete snapshots of its ward (what a spare is rebuilt from)

A replica is checked against the sender's checksum either on receipt (``verify="eager"``) or when it
is used (``verify="lazy"``, the default): every state sent to a spare is checked by the receiver
against the checksum the snapshot was taken with, and a mismatch is reported so that the planner
picks another source. Lazy verification takes one checksum pass per step off the steady state,
and keeps a survivor's status report O(1) (no checksum of GB-scale replicas before answering).

**Regions.** The flat buffer holds the *shared* tensors first (identical on every rank of the
data-parallel group: parameters, and the optimizer state when it is not sharded) and the rank's
*unique* tensors after them (its ZeRO-1 optimizer shard). Each region has its own checksum. With
``replicate="unique"`` only the unique region is replicated (a live data-parallel peer holds the
rest: ``planner.py`` then restores a rank from its buddy's replica plus a peer's parameters), so
replication moves 1/dp of the optimizer state instead of the whole state; ``replicate="full"``
replicates everything (needed when no data-parallel peer may survive, e.g. dp == 1). A state on
the wire names its region: ``all``, ``shared`` or ``unique``.

Headers (step, data position, RNG state) travel as JSON; nothing received is ever unpickled.

All ranks replicate the same steps in the same order (every ``interval``-th step), so the ring of
sends and receives always pairs up. A step is *protected* once every rank has finished
replicating it (a counter per step in the store). The invariant that makes recovery always
possible: a rank never drops its local snapshot, nor a replica, of the newest protected step it
knows of, nor anything newer. So the newest protected step is always in every survivor's local
ring and in the dead rank's buddy's replicas. If replication falls behind, ``snapshot()`` waits
for a slot it may overwrite (backpressure, counted in ``blocked_s``) rather than skipping steps.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import xxhash

from deadpool.comm import PassThrough

HEADER_BYTES = 1 << 16  # JSON metadata (step, RNG states, data position) must fit
_ALIGN = 64


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """A rank's training state in a fixed order: parameters, then AdamW state per parameter."""
    out = [(f"param/{n}", p) for n, p in model.named_parameters()]
    for n, p in model.named_parameters():
        st = opt.state[p]
        for k in ("exp_avg", "exp_avg_sq", "step"):
            out.append((f"{k}/{n}", st[k]))
    return out


@dataclass
class Entry:
    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple


class StateLayout:
    """Where each state tensor lives in the flat byte buffer."""

    @classmethod
    def from_desc(cls, desc: dict) -> "StateLayout":
        """The layout a snapshot header describes (``SnapshotEngine.layout_desc``)."""
        self = cls([])
        self.entries = [Entry(n, o, b, getattr(torch, d), tuple(sh)) for n, o, b, d, sh in
                        desc["entries"]]
        self.nbytes = self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0
        return self

    def __init__(self, tensors: list[tuple[str, torch.Tensor]]):
        self.entries: list[Entry] = []
        off = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            self.entries.append(Entry(name, off, nbytes, t.dtype, tuple(t.shape)))
            off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.nbytes = off

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def state_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.name: v for e, v in zip(self.entries, self.views(flat))}

    def state_dict_live(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {e.name: t for e, t in zip(self.entries, tensors)}


def lower_thread_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority (Linux: nice applies per thread).

    Snapshot copies, checksums and replication traffic then take the CPU time training leaves
    idle (all-reduce waits, Python overhead) instead of competing with it; threads this thread
    creates (e.g. gloo's I/O threads for the replication group) inherit the lower priority.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError:
        pass


def checksum(flat: torch.Tensor) -> int:
    """XXH3-64 of the bytes (the ``xxhash`` package: ~28 GB/s on one core here, 9x zlib's
    checksum, and it releases the GIL, so the copier thread hashes beside the training thread).
    Not cryptographic: it detects torn transfers and memory corruption, not tampering."""
    return xxhash.xxh3_64_intdigest(flat.numpy())


def _to_i64(h: int) -> int:  # a 64-bit digest in an int64 tensor, and back
    return h - (1 << 64) if h >= 1 << 63 else h


def _from_i64(v: int) -> int:
    return v & 0xFFFFFFFFFFFFFFFF


def region_crcs(flat: torch.Tensor, split: int) -> tuple[int, int]:
    """Checksums of the shared region ``flat[:split]`` and of the unique region ``flat[split:]``."""
    return checksum(flat[:split]), checksum(flat[split:])


REGIONS = ("all", "shared", "unique")


@dataclass
class Slot:
    flat: torch.Tensor
    step: int = -1
    header: bytes = b""
    crc: tuple = (0, 0)  # checksum of the shared region, of the unique region
    released: threading.Event = field(default_factory=threading.Event)  # copy done: live may change
    copied: threading.Event = field(default_factory=threading.Event)    # copy and checksum done
    replicating: bool = False
    cuda_event: object = None
    taken_at: float = 0.0  # perf_counter() when the snapshot was started (cycle time)


@dataclass
class Replica:
    owner: int
    step: int
    flat: torch.Tensor  # the replicated region only
    header: bytes
    crc: tuple
    region: str
    verified: bool | None = None  # None: not checked yet (lazy); False: known corrupt


class CorruptState(PassThrough):
    """A state received (or about to be restored) does not match the checksum it was taken with."""

    def __init__(self, msg: str, holder: int, owner: int, step: int):
        super().__init__(msg)
        self.holder, self.owner, self.step = holder, owner, step


def encode_header(header: dict) -> bytes:
    b = json.dumps(header).encode()
    if len(b) > HEADER_BYTES:
        raise ValueError(f"snapshot header is {len(b)} bytes, more than {HEADER_BYTES}")
    return b


def decode_header(b: bytes) -> dict:
    return json.loads(b.decode())


class SnapshotEngine:
    """Owns the local snapshot ring, the ward's replicas, and the copier / replication threads."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], *,
                 num_local_slots: int = 3, chunk_bytes: int = 4 << 20, device: str = "cpu",
                 fault_hook=None, background_nice: int = 0, verify: str = "lazy",
                 num_shared: int = 0, replicate: str = "full",
                 max_bytes_per_s: float | None = None):
        if num_local_slots < 2:
            raise ValueError("ft.num_local_slots must be >= 2 (one being written, one to roll back to)")
        self.tensors = [t for _, t in tensors]
        self.layout = StateLayout(tensors)
        if replicate not in ("unique", "full"):
            raise ValueError(f"ft.replicate must be 'unique' or 'full', got {replicate!r}")
        n = self.layout.nbytes
        split = self.layout.entries[num_shared].offset if num_shared < len(tensors) else n
        self.bounds = {"all": (0, n), "shared": (0, split), "unique": (split, n)}
        # travels in every snapshot header: a holder of a replica whose owner has another stage
        # can still name its tensors (e.g. to write it to disk)
        self.layout_desc = {"split": split, "entries": [
            [e.name, e.offset, e.nbytes, str(e.dtype).removeprefix("torch."), list(e.shape)]
            for e in self.layout.entries]}
        # what the buddy receives every snapshot ("none": nobody needs a replica)
        self.repl_region = "all" if replicate == "full" or split == 0 else (
            "unique" if split < n else "none")
        self.chunk_bytes = max(1 << 16, int(chunk_bytes))
        self.max_bytes_per_s = max_bytes_per_s
        self.device = device
        self.fault_hook = fault_hook or (lambda step, phase: None)
        self.background_nice = int(background_nice)
        if verify not in ("eager", "lazy"):
            raise ValueError(f"ft.replica_verify must be 'eager' or 'lazy', got {verify!r}")
        self.verify = verify
        pin = device.startswith("cuda") and torch.cuda.is_available()
        self.slots = [Slot(torch.empty(self.layout.nbytes, dtype=torch.uint8, pin_memory=pin))
                      for _ in range(num_local_slots)]
        self.replicas: dict[int, list[Replica]] = {}
        self._lock = threading.Condition()
        self._copy_q: queue.Queue = queue.Queue()
        self._last_copy: Slot | None = None
        self._side_stream = torch.cuda.Stream() if pin else None
        self._copier = threading.Thread(target=self._copy_loop, name="snapshot-copier", daemon=True)
        self._copier.start()
        self._repl: _Replicator | None = None
        self._protected = -1          # newest step known protected in the current generation
        self._protect_store = None    # main thread's store client, keys and world size
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
                if slot.replicating:
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
        self.blocked_s += time.perf_counter() - t0
        slot.released.clear()
        slot.copied.clear()
        slot.taken_at = time.perf_counter()
        slot.step = self.taken_step = step
        slot.header = encode_header(dict(header, layout=self.layout_desc))
        if self._side_stream is not None:  # pragma: no cover - needs CUDA
            main = torch.cuda.current_stream()
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                # in pieces of at most 64 MB: another D2H read (the loss) waits for one piece at
                # most in the copy engine's queue, never for the whole state
                for v, t in zip(self.layout.views(slot.flat), self.tensors):
                    dst, src = v.reshape(-1), t.detach().reshape(-1)
                    step_n = max(1, (64 << 20) // src.element_size())
                    for off in range(0, src.numel(), step_n):
                        dst[off:off + step_n].copy_(src[off:off + step_n], non_blocking=True)
                slot.cuda_event = torch.cuda.Event()
                slot.cuda_event.record()
        self._last_copy = slot
        self._copy_q.put(slot)

    def _is_protected(self, step: int) -> bool:
        if step <= self._protected:
            return True
        if self._protect_store is None:
            return False
        store, keys, world = self._protect_store
        if int(store.add(keys.repl_done(step), 0)) >= world:
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
        if slot.cuda_event is not None:  # pragma: no cover - needs CUDA
            torch.cuda.current_stream().wait_event(slot.cuda_event)  # GPU-side wait, CPU goes on
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
                if slot.cuda_event is not None:  # pragma: no cover - needs CUDA
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
                continue
            slot.released.set()  # the live state may change now; the checksum reads the copy
            slot.crc = region_crcs(slot.flat, self.bounds["unique"][0])
            self.last_copy_s = time.perf_counter() - t0
            slot.copied.set()
            if self.repl_region == "none":
                self.done_step, self.last_cycle_s = slot.step, time.perf_counter() - slot.taken_at
            if self.persist_every and slot.step > 0 and slot.step % self.persist_every == 0:
                self._persist(slot)
            repl = self._repl
            if repl is not None and not repl.stopped and self.repl_region != "none":
                with self._lock:
                    slot.replicating = True
                repl.queue.put(slot)

    def _persist(self, slot: Slot) -> None:
        """Hand a copy of this snapshot to the asynchronous disk writer (copier thread).

        The copy into a buffer the writer owns until it is done happens here, off the training
        thread; the writer then needs no staging copy of its own. If the previous write is still
        running this checkpoint is skipped (counted), never waited for."""
        p = self.persister
        if p is None or p.in_flight:
            if p is not None:
                p.skipped += 1
            return
        if self._persist_flat is None:
            self._persist_flat = torch.empty_like(slot.flat)
        self._persist_flat.copy_(slot.flat)
        try:
            p.submit(slot.step, self.layout.state_dict(self._persist_flat),
                     decode_header(slot.header), self.persist_world)
        except Exception as e:  # a failed earlier write must not stop snapshots
            print(f"[deadpool] periodic checkpoint of step {slot.step} not written: {e}", flush=True)

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

    def outgoing(self, kind: str, owner: int, step: int, live_step: int | None, header_fn,
                 region: str = "all"):
        """What to send for a plan source: ``(bytes of region, header, crc)``. Main thread only.

        ``kind="replica"``: the replica of ``owner`` at ``step``; otherwise this rank's own state
        at ``step`` (its local snapshot; taken now from the live state if it is at ``step``).
        """
        if kind == "replica":
            rep = self.replica(owner, step)
            if rep.region != "all" and region != rep.region:
                raise KeyError(f"the replica of rank {owner} holds the {rep.region} region, "
                               f"not {region}")
            if region == rep.region:
                return rep.flat, rep.header, rep.crc
            # a whole-state replica of another stage: cut at its owner's split, not ours
            split = decode_header(rep.header)["layout"]["split"]
            part = rep.flat[:split] if region == "shared" else rep.flat[split:]
            return part, rep.header, rep.crc
        if step not in self.local_steps():
            if live_step != step:
                raise KeyError(f"no state of step {step} to send (live state is at {live_step})")
            self.snapshot(step, header_fn())
            self.drain()
        slot = self.local_slot(step)
        return self.region(slot.flat, region), slot.header, slot.crc

    def transfer(self, comm, sends: list[tuple], recvs: list[tuple], step: int):
        """Send states and receive this rank's pieces; runs in an abortable helper thread.

        ``sends``: ``(dst_rank, region, (bytes, header, crc))``; ``recvs``: ``(src_rank, owner,
        region)``, at most one per region (e.g. the unique region from a replica holder and the
        shared region from a data-parallel peer). Every send is posted before any receive (no
        cycle can deadlock). Pieces land in one fresh buffer (an abandoned transfer may still
        write into it) and each is checked against the checksum its region was taken with
        (``CorruptState`` on mismatch). Returns ``(buffer, header, crc)`` or None.
        """
        me = comm.topo.rank
        # one 2-rank group per (holder, receiver), created in one global order (deadlock-free)
        pairs = sorted({(me, dst) for dst, _, _ in sends} | {(src, me) for src, _, _ in recvs})
        for a, b in pairs:
            comm.pair_group(comm.build_store, a, b)
        works = []
        for dst, region, (flat, header, crc) in sends:
            works += _post_sends(comm.pair_group(None, me, dst), 1, step, flat, header, crc,
                                 region, self.chunk_bytes,
                                 after_first_chunk=lambda: self.fault_hook(step, "transfer"))
        got = None
        if recvs:
            buf = torch.empty(self.layout.nbytes, dtype=torch.uint8,
                              pin_memory=self.slots[0].flat.is_pinned())
            crc, header = [0, 0], b""
            for src, owner, region in recvs:
                got_step, hdr, c, got_region = _recv_state(
                    comm.pair_group(None, src, me), 0, self.region(buf, region), self.chunk_bytes,
                    wait=_blocking, after_first_chunk=lambda: self.fault_hook(step, "transfer"))
                if got_step != step or got_region != region or not self.verify_region(buf, region, c):
                    raise CorruptState(f"{region} state of rank {owner} at step {step} from rank "
                                       f"{src} failed verification (got step {got_step}, region "
                                       f"{got_region}, CRC mismatch)", src, owner, step)
                if region in ("all", "shared"):
                    crc[0] = c[0]
                if region in ("all", "unique"):
                    crc[1], header = c[1], hdr
                elif not header:
                    header = hdr
            got = (buf, header, tuple(crc))
        for w in works:
            w.wait()
        return got

    def install(self, step: int, buf: torch.Tensor, header: bytes, crc: tuple) -> dict:
        """Load a received state live and keep it as the local snapshot of ``step``."""
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
        if self.repl_region == "none":
            return  # every rank's state is held by a live data-parallel peer
        topo = comm.topo
        self._protected = -1
        self._protect_store = (store_factory(), comm.keys, topo.dims.world_size)
        self._repl = _Replicator(self, comm, topo.buddy(), topo.ward(), store_factory)
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

    def _commit_replica(self, rep: Replica, repl: "_Replicator") -> bool:
        with self._lock:
            if repl.stopped:
                return False
            reps = [r for r in self.replicas.get(rep.owner, []) if r.step != rep.step]
            reps.append(rep)
            reps.sort(key=lambda r: r.step)
            # keep the newest protected replica and everything newer (at least two)
            keep_from = min(self._protected, reps[-2].step if len(reps) > 1 else rep.step)
            self.replicas[rep.owner] = [r for r in reps if r.step >= keep_from]
            return True

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

    def verify_replica(self, flat: torch.Tensor, crc: tuple) -> bool:
        if self.repl_region == "all":
            return self.verify_region(flat, "all", crc)
        return checksum(flat) == crc[1]

    def _release(self, slot: Slot) -> None:
        with self._lock:
            slot.replicating = False
            self._lock.notify_all()


class _Replicator(threading.Thread):
    """Sends each local snapshot to the buddy and receives the ward's, in lockstep with all ranks."""

    def __init__(self, engine: SnapshotEngine, comm, buddy: int, ward: int, store_factory):
        super().__init__(name=f"snapshot-repl-g{comm.topo.generation}", daemon=True)
        self.engine, self.comm = engine, comm
        self.buddy, self.ward = buddy, ward
        self.queue: queue.Queue = queue.Queue()
        self.stopped = False
        self.store_factory = store_factory
        self.protected_reported = False
        # fresh receive buffers per generation (an abandoned receive may still write into the
        # old ones), sized by what the ward sends: its stage may differ from this rank's
        self.recv_pool: list[torch.Tensor] = []

    def _free_recv_buffer(self, nbytes: int, store) -> torch.Tensor:
        eng = self.engine
        with eng._lock:
            newest = max((r.step for r in eng.replicas.get(self.ward, [])), default=-1)
        if newest > eng._protected and int(store.add(self.comm.keys.repl_done(newest), 0)) \
                >= self.comm.topo.dims.world_size:
            with eng._lock:
                eng._protected = max(eng._protected, newest)
        eng._drop_unneeded_replicas()
        with self.engine._lock:
            held = {id(r.flat) for reps in self.engine.replicas.values() for r in reps}
        for b in self.recv_pool:
            if id(b) not in held and b.numel() == nbytes:
                return b
        # 2 in steady state (the newest protected replica, the one arriving); more only while
        # replication runs ahead of protection
        b = torch.empty(nbytes, dtype=torch.uint8)
        self.recv_pool.append(b)
        return b

    def run(self) -> None:
        lower_thread_priority(self.engine.background_nice)
        out, inp = self.comm.group("repl_out"), self.comm.group("repl_in")
        dst, src = 1, 0  # repl_out is [me, buddy]; repl_in is [ward, me]
        store = None
        while True:
            slot = self.queue.get()
            if slot is None or self.stopped:
                return
            t0 = time.perf_counter()
            try:
                got = {}
                store = store or self.store_factory()

                def buffer(nbytes):
                    got["buf"] = self._free_recv_buffer(nbytes, store)
                    return got["buf"]
                # a "replication" fault fires after the first chunk is posted, the rest not:
                # the buddy is left with a torn replica of this step
                region = self.engine.repl_region
                sends = _post_sends(out, dst, slot.step, self.engine.region(slot.flat, region),
                                    slot.header, slot.crc, region, self.engine.chunk_bytes,
                                    after_first_chunk=lambda s=slot.step: self.engine.fault_hook(s, "replication"))
                step, header, crc, _ = _recv_state(inp, src, buffer, self.engine.chunk_bytes,
                                                   wait=_blocking)
                buf = got["buf"]
                for w in sends:
                    w.wait()
                rate = self.engine.max_bytes_per_s
                if rate:  # the replication rate cap: a snapshot takes at least its bytes / rate
                    a, b = self.engine.bounds[region]
                    time.sleep(max(0.0, (b - a) / rate - (time.perf_counter() - t0)))
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
            verified = None
            if self.engine.verify == "eager":
                if not self.engine.verify_replica(buf, crc):
                    continue  # a torn or corrupt replica never counts
                verified = True
            rep = Replica(self.ward, step, buf, header, crc, self.engine.repl_region, verified)
            if not self.engine._commit_replica(rep, self):
                return
            self.engine.last_replicate_s = time.perf_counter() - t0
            self.engine.done_step = slot.step
            self.engine.last_cycle_s = time.perf_counter() - slot.taken_at
            if int(store.add(self.comm.keys.repl_done(slot.step), 1)) >= self.comm.topo.dims.world_size:
                with self.engine._lock:
                    self.engine._protected = max(self.engine._protected, slot.step)
            if not self.protected_reported:
                keys = self.comm.keys
                store.set(keys.protected(self.comm.topo.rank), repr(time.time()))
                store.add(keys.protected_count, 1)
                self.protected_reported = True


def _blocking(work) -> None:
    # Point-to-point waits must not use a timeout: a timed-out send/recv breaks the pair. A dead
    # peer is fenced (SIGKILLed) by the coordinator, which closes its sockets and ends this wait.
    work.wait()


def _meta(step: int, nbytes: int, crc: tuple, header_len: int, region: str) -> torch.Tensor:
    return torch.tensor([step, nbytes, _to_i64(crc[0]), _to_i64(crc[1]), header_len,
                         REGIONS.index(region)],
                        dtype=torch.int64)


def _chunks(flat: torch.Tensor, chunk_bytes: int):
    for off in range(0, flat.numel(), chunk_bytes):
        yield flat[off:off + chunk_bytes]


def _post_sends(pg, dst: int, step: int, flat, header: bytes, crc: tuple, region: str,
                chunk_bytes: int, after_first_chunk=None) -> list:
    hdr = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    hdr[:len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    works = [pg.send([_meta(step, flat.numel(), crc, len(header), region)], dst, 0),
             pg.send([hdr], dst, 1)]
    for i, c in enumerate(_chunks(flat, chunk_bytes)):
        works.append(pg.send([c], dst, 2 + i))
        if i == 0 and after_first_chunk is not None:
            after_first_chunk()  # sends are asynchronous: the rest is not posted yet
    return works


def _recv_state(pg, src: int, flat, chunk_bytes: int, wait,
                after_first_chunk=None) -> tuple[int, bytes, tuple, str]:
    """Receive one state into ``flat`` (a tensor of the expected size, or a function giving a
    buffer for the announced size)."""
    meta = torch.zeros(6, dtype=torch.int64)
    hdr = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    wait(pg.recv([meta], src, 0))
    step, nbytes, crc0, crc1, hlen, region = (int(x) for x in meta.tolist())
    if callable(flat):
        flat = flat(nbytes)
    if nbytes != flat.numel():
        raise RuntimeError(f"state layout mismatch: peer sends {nbytes} bytes, expected {flat.numel()}")
    wait(pg.recv([hdr], src, 1))
    for i, c in enumerate(_chunks(flat, chunk_bytes)):
        wait(pg.recv([c], src, 2 + i))
        if i == 0 and after_first_chunk is not None:
            after_first_chunk()
    return step, bytes(hdr[:hlen].numpy()), (_from_i64(crc0), _from_i64(crc1)), REGIONS[region]
