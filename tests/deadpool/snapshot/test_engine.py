import threading
import time

import pytest
import torch

from deadpool.model import build_model, build_optimizer
from deadpool.rank.comm import Communicator
from deadpool.snapshot import SnapshotEngine, StateLayout, checksum, state_tensors
from deadpool.snapshot.transfer import header_digest, outgoing, transfer
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads

TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_mult=2, max_seq_len=16)


def make_state(seed):
    model = build_model(TINY, seed)
    opt = build_optimizer(model, 1e-2, 0.0)
    return model, opt


def train_one_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 8), generator=g)
    model(x, x).backward()
    opt.step()
    opt.zero_grad()


def test_layout_views_cover_every_state_tensor_disjointly():
    model, opt = make_state(0)
    tensors = state_tensors(model, opt)
    layout = StateLayout(tensors)
    flat = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for v, (_, t) in zip(layout.views(flat), tensors):
        v.copy_(t)
    for v, (_, t) in zip(layout.views(flat), tensors):
        assert torch.equal(v, t)
    assert layout.nbytes >= sum(t.numel() * t.element_size() for _, t in tensors)


def test_snapshot_is_consistent_and_restore_rolls_back_exactly():
    model, opt = make_state(0)
    eng = SnapshotEngine(state_tensors(model, opt), num_local_slots=2)
    train_one_step(model, opt, 1)
    before = {n: t.clone() for n, t in state_tensors(model, opt)}
    eng.snapshot(1, {"step": 1})
    eng.wait_copy()  # the contract: before the next optimizer step
    train_one_step(model, opt, 2)
    assert any(not torch.equal(before[n], t) for n, t in state_tensors(model, opt))
    assert eng.restore_local(1)["step"] == 1
    for n, t in state_tensors(model, opt):
        assert torch.equal(before[n], t), n
    with pytest.raises(KeyError):
        eng.restore_local(7)


def test_unallocated_slots_are_allocated_on_first_use_only():
    model, opt = make_state(0)
    eng = SnapshotEngine(state_tensors(model, opt), num_local_slots=3, allocate_slots=False)
    assert all(s.flat is None for s in eng.slots)  # a job without snapshots holds no ring
    train_one_step(model, opt, 1)
    before = {n: t.clone() for n, t in state_tensors(model, opt)}
    eng.snapshot(1, {"step": 1})
    eng.drain()
    assert sum(s.flat is not None for s in eng.slots) == 1 and eng.local_steps() == [1]
    train_one_step(model, opt, 2)
    assert eng.restore_local(1)["step"] == 1
    for n, t in state_tensors(model, opt):
        assert torch.equal(before[n], t), n
    eng.close()


def test_backpressure_never_overwrites_a_slot_being_replicated():
    model, opt = make_state(0)
    eng = SnapshotEngine(state_tensors(model, opt), num_local_slots=2)
    eng.snapshot(0, {"step": 0})
    eng.snapshot(1, {"step": 1})
    eng.drain()
    slot = eng.local_slot(0)
    with eng._lock:
        slot.replicating = True
    t0 = time.perf_counter()
    import threading
    threading.Timer(0.2, eng._release, args=(slot,)).start()
    eng.snapshot(2, {"step": 2})  # the oldest slot is the next one: must wait for the release
    assert eng.local_steps() == [1, 2]
    assert time.perf_counter() - t0 >= 0.15
    assert eng.blocked_s >= 0.15


def test_ring_replication_delivers_verified_replicas_to_buddies():
    n = 3
    master = master_store()
    engines, models = {}, {}

    def rank_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=n), r, 0), store)
        model, opt = make_state(seed=r)  # different state per rank
        eng = SnapshotEngine(state_tensors(model, opt), chunk_bytes=1 << 16)
        engines[r], models[r] = eng, (model, opt)
        eng.snapshot(0, {"step": 0, "who": r})
        eng.drain()
        eng.start_replication(comm, lambda: client(master.port), first_step=0)
        train_one_step(model, opt, 10 + r)
        eng.wait_copy()
        eng.snapshot(1, {"step": 1, "who": r})
        deadline = time.time() + 30
        while eng.replica_steps().get((r - 1) % n) != [0, 1]:
            assert time.time() < deadline, eng.replica_steps()
            time.sleep(0.01)
        return comm

    comms = run_threads(rank_fn, n)
    for r in range(n):
        ward = (r - 1) % n
        rep = engines[r].replica(ward, 1)
        own = engines[ward].local_slot(1)
        assert torch.equal(rep.flat, own.flat)
        assert rep.crc == own.crc == (checksum(own.flat[:0]), checksum(own.flat))
    # a replica known corrupt is never reported as a resume candidate
    rep = engines[0].replica(n - 1, 1)
    rep.flat[100] ^= 0xFF
    rep.verified = False
    assert engines[0].replica_steps()[n - 1] == [0]
    for c in comms:
        c.park()
    for e in engines.values():
        e.stop_replication()


def test_state_transfer_installs_a_good_state_and_names_the_holder_of_a_corrupt_one():
    from deadpool.errors import CorruptState
    from deadpool.snapshot import encode_header
    master = master_store()
    out, reported = {}, threading.Event()

    def rank_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=2), r, 0), store)
        model, opt = make_state(seed=r)  # distinct states: a wrong route would show
        eng = SnapshotEngine(state_tensors(model, opt))
        if r == 0:
            eng.snapshot(5, {"step": 5})
            eng.drain()
            good = outgoing(eng, "peer", 0, 5, 5, lambda: {"step": 5})
            out["want"] = [*good[2], header_digest(good[1])]  # what its status reports
            reported.set()
            transfer(eng, comm, [(1, "all", good)], [], 5)
            bad = (good[0].clone(), good[1], good[2])
            bad[0][-1] ^= 1  # the bytes no longer match the checksums
            transfer(eng, comm, [(1, "all", bad)], [], 5)
            out["sent"] = good[0].clone()
        else:
            reported.wait(30)
            header = eng.install(5, *transfer(eng, comm, [], [(0, 0, "all", out["want"])], 5))
            out["got"] = eng.local_slot(5).flat.clone()
            out["header"] = header
            with pytest.raises(CorruptState) as e:
                transfer(eng, comm, [], [(0, 0, "all", out["want"])], 5)
            out["bad"] = (e.value.holder, e.value.owner, e.value.step)
        return comm

    run_threads(rank_fn, 2)
    assert torch.equal(out["sent"], out["got"]) and out["header"]["step"] == 5
    assert out["header"]["layout"]["entries"][0][0] == "param/embed.weight"  # layout travels
    assert out["bad"] == (0, 0, 5)
    assert encode_header({"step": 5}) == b'{"step": 5}'


def test_unique_replication_and_a_restore_from_two_sources_by_region():
    """ZeRO-1 layout: parameters shared by data-parallel peers, optimizer state unique. Only the
    unique region is replicated; a rank is rebuilt from its buddy's replica (unique) plus a
    peer's parameters (shared). Every rank's state is distinct, so a wrong route would show."""
    n = 3
    master = master_store()
    engines, states = {}, {}

    def make(r):
        shared = torch.arange(1000, dtype=torch.float32)            # the same on every rank
        unique = torch.full((257,), float(r)) + torch.arange(257.0)  # this rank's own
        return [("params", shared), ("zero/exp_avg", unique)]

    def rank_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=n), r, 0), store)
        tensors = make(r)
        eng = SnapshotEngine(tensors, chunk_bytes=1 << 16, num_shared=1, replicate="unique")
        engines[r], states[r] = eng, tensors
        assert eng.repl_region == "unique"
        eng.snapshot(3, {"step": 3, "who": r})
        eng.drain()
        eng.start_replication(comm, lambda: client(master.port), first_step=3)
        deadline = time.time() + 30
        while eng.replica_steps().get((r - 1) % n) != [3]:
            assert time.time() < deadline
            time.sleep(0.01)
        return comm

    comms = run_threads(rank_fn, n)
    e0 = engines[0]
    unique_bytes = e0.bounds["unique"][1] - e0.bounds["unique"][0]
    rep = engines[1].replica(0, 3)  # rank 1 holds rank 0's replica (ring)
    assert rep.flat.numel() == unique_bytes < e0.layout.nbytes
    for e in engines.values():
        e.stop_replication()

    # rank 0 "dies"; a fresh engine stands in for the spare taking rank 0 (at generation 1)
    out = {}

    def restore_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=n), r, 1), store)
        if r == 0:
            blank = [(k, torch.zeros_like(t)) for k, t in make(0)]
            eng = SnapshotEngine(blank, num_shared=1, replicate="unique")
            rep = engines[1].replica(0, 3)  # the checksums the holders reported
            want = [*rep.crc, header_digest(rep.header)]
            shared = [engines[2].local_slot(3).crc[0], None, None]
            got = transfer(eng, comm, [], [(1, 0, "unique", want), (2, 2, "shared", shared)], 3)
            out["header"] = eng.install(3, *got)
            out["state"] = [t.clone() for _, t in blank]
        elif r == 1:  # the buddy: rank 0's optimizer shard
            eng = engines[1]
            transfer(engines[1], comm, [(0, "unique", outgoing(eng, "replica", 0, 3, None, None,
                                                                  "unique"))], [], 3)
        else:  # a data-parallel peer: the parameters
            eng = engines[2]
            transfer(eng, comm, [(0, "shared", outgoing(eng, "peer", 0, 3, 3, None, "shared"))],
                         [], 3)
        return comm

    comms += run_threads(restore_fn, n)
    for got, (_, want) in zip(out["state"], states[0]):
        assert torch.equal(got, want)
    assert out["header"]["who"] == 0  # the header travels with the unique region
    for c in comms:
        c.park()


def test_64_bit_digests_survive_the_int64_wire_format():
    from deadpool.snapshot.wire import _from_i64, _meta, _to_i64
    for h in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert _from_i64(int(torch.tensor([_to_i64(h)], dtype=torch.int64)[0])) == h
    m = _meta(3, 10, ((1 << 64) - 2, 5), 7, "unique")
    assert _from_i64(int(m[2])) == (1 << 64) - 2 and _from_i64(int(m[3])) == 5


def test_checksum_sees_a_single_flipped_byte():
    buf = torch.arange(1 << 20, dtype=torch.int32).view(torch.uint8).clone()
    h = checksum(buf)
    buf[12345] ^= 1
    assert checksum(buf) != h


def test_a_step_snapshotted_again_reuses_its_slot():
    """After a restore the step just loaded is snapshotted again: it must replace its own slot,
    not fill the other one (two slots of one step leave none that may be overwritten)."""
    model, opt = make_state(0)
    eng = SnapshotEngine(state_tensors(model, opt), num_local_slots=2)
    eng.snapshot(11, {"step": 11})
    eng.snapshot(12, {"step": 12})
    eng.snapshot(12, {"step": 12})
    assert eng.local_steps() == [11, 12]


def test_two_replicas_reach_both_buddies_and_every_rank_holds_two_wards():
    """``ft.replicas=2`` on one 4-rank node: rank r's snapshot lands on r+1 and r+2, and rank r
    holds the replicas of r-1 and r-2, each byte-equal to its owner's (states differ per rank,
    so a replica routed to the wrong holder or filed under the wrong owner would show)."""
    n, k = 4, 2
    master = master_store()
    engines = {}

    def rank_fn(r):
        comm = Communicator.build(Topology(ParallelDims(dp=n, ranks_per_node=n), r, 0,
                                           replicas=k), client(master.port))
        model, opt = make_state(seed=r)
        eng = SnapshotEngine(state_tensors(model, opt), chunk_bytes=1 << 16)
        engines[r] = eng
        eng.snapshot(0, {"step": 0, "who": r})
        eng.drain()
        eng.start_replication(comm, lambda: client(master.port), first_step=0)
        for step in (1, 2):
            train_one_step(model, opt, 10 * step + r)
            eng.wait_copy()
            eng.snapshot(step, {"step": step, "who": r})
        deadline = time.time() + 60
        while eng.done_step < 2 or any(2 not in eng.replica_steps().get(w, [])
                                       for w in comm.topo.wards()):
            assert time.time() < deadline, eng.replica_steps()
            time.sleep(0.01)
        return comm

    comms = run_threads(rank_fn, n)
    for r in range(n):
        assert sorted(engines[r].replica_steps()) == sorted({(r - 1) % n, (r - 2) % n})
        for ward in ((r - 1) % n, (r - 2) % n):
            assert torch.equal(engines[r].replica(ward, 2).flat, engines[ward].local_slot(2).flat)
        assert engines[r].replicated_bytes == 2 * engines[r].layout.nbytes
        # the receive buffers of two wards are never shared
        held = [rep.flat for reps in engines[r].replicas.values() for rep in reps]
        assert len({b.data_ptr() for b in held}) == len(held)
    for c in comms:
        c.park()
    for e in engines.values():
        e.stop_replication()


def test_a_replica_dropped_by_eager_verification_leaves_its_step_unprotected(monkeypatch):
    """Rank 0's replica of step 1 reaches its buddy (rank 1) with a checksum that does not
    match (a corrupted transfer); under ``verify="eager"`` rank 1 drops it. Step 1 must then not
    count as protected on any rank (rank 1 holds no copy of rank 0 at step 1: protecting it
    would let every rank drop its older replicas); step 2, replicated cleanly, is protected."""
    from deadpool.snapshot import replication
    from deadpool.snapshot.layout import decode_header

    real = replication.post_sends

    def corrupting(out, dst, step, region, header, crc, *a, **k):
        if step == 1 and decode_header(header)["who"] == 0:
            crc = (crc[0], crc[1] ^ 1)
        return real(out, dst, step, region, header, crc, *a, **k)
    monkeypatch.setattr(replication, "post_sends", corrupting)
    n = 3
    master = master_store()
    engines = {}

    def snapshot_and_replicate(eng, model, opt, r, step):
        train_one_step(model, opt, 10 * step + r)
        eng.wait_copy()
        eng.snapshot(step, {"step": step, "who": r})
        deadline = time.monotonic() + 30
        while eng.done_step < step:
            assert time.monotonic() < deadline, (r, step, eng.done_step)
            time.sleep(0.01)

    def rank_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=n), r, 0), store)
        model, opt = make_state(seed=r)
        eng = SnapshotEngine(state_tensors(model, opt), chunk_bytes=1 << 16, verify="eager")
        engines[r] = eng
        eng.snapshot(0, {"step": 0, "who": r})
        eng.drain()
        eng.start_replication(comm, lambda: client(master.port), first_step=0)
        snapshot_and_replicate(eng, model, opt, r, 1)
        return comm, model, opt

    states = run_threads(rank_fn, n)
    assert engines[1].replica_steps()[0] == [0]  # the corrupt step-1 replica was dropped
    assert engines[2].replica_steps()[1] == [0, 1]
    time.sleep(0.2)  # (every rank's count of step 1 is in)
    assert [engines[r]._is_protected(1) for r in range(n)] == [False] * n
    assert all(engines[r].protected_floor() < 1 for r in range(n))
    run_threads(lambda r: snapshot_and_replicate(engines[r], states[r][1], states[r][2], r, 2), n)
    deadline = time.monotonic() + 30
    while not all(engines[r]._is_protected(2) for r in range(n)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert engines[1].replica_steps()[0][-1] == 2
    for c, _, _ in states:
        c.park()
    for e in engines.values():
        e.stop_replication()


def test_two_snapshots_of_one_state_hold_the_same_bytes_whatever_the_allocator_had(monkeypatch):
    """The alignment padding between and after the tensors holds no state, and a new buffer holds
    whatever memory the allocator hands back: a snapshot buffer has it zeroed, so two snapshots
    of one state are equal byte for byte (a test comparing them failed once in a full run)."""
    tensors = [("a", torch.arange(5, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.int16)),
               ("step", torch.tensor(4.0))]
    layout = StateLayout(tensors)
    assert layout.gaps() == [(20, 64), (70, 128), (132, 192)] and layout.nbytes == 192
    real_empty = torch.empty

    def dirty(*a, **k):  # memory handed back with what its last user left
        return real_empty(*a, **k).fill_(0xAB)

    monkeypatch.setattr(torch, "empty", dirty)
    eng = SnapshotEngine(tensors, num_local_slots=3)
    for step in (1, 2):
        eng.snapshot(step, {"step": step})
    a, b = eng.local_slot(1).flat, eng.local_slot(2).flat
    assert torch.equal(a, b) and int(a[20:64].sum()) == 0
    eng.close()
