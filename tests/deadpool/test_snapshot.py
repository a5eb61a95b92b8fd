import time

import pytest
import torch

from deadpool.comm import Communicator
from deadpool.model import build_model, build_optimizer
from deadpool.snapshot import SnapshotEngine, StateLayout, checksum, state_tensors
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


def test_backpressure_never_overwrites_a_slot_being_replicated():
    model, opt = make_state(0)
    eng = SnapshotEngine(state_tensors(model, opt), num_local_slots=2)
    eng.snapshot(0, {"step": 0})
    eng.drain()
    slot = eng.local_slot(0)
    with eng._lock:
        slot.replicating = True
    t0 = time.perf_counter()
    import threading
    threading.Timer(0.2, eng._release, args=(slot,)).start()
    eng.snapshot(2, {"step": 2})  # maps to the same slot: must wait for the release
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
        assert rep.crc == checksum(own.flat)
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
    from deadpool.snapshot import CorruptState, encode_header
    master = master_store()
    out = {}

    def rank_fn(r):
        store = client(master.port)
        comm = Communicator.build(Topology(ParallelDims(dp=2), r, 0), store)
        model, opt = make_state(seed=r)  # distinct states: a wrong route would show
        eng = SnapshotEngine(state_tensors(model, opt))
        if r == 0:
            eng.snapshot(5, {"step": 5})
            eng.drain()
            good = eng.outgoing("peer", 0, 5, 5, lambda: {"step": 5})
            eng.transfer(comm, [(1, 0, good)], None, 5)
            bad = (good[0].clone(), good[1], good[2] ^ 1)  # a CRC that does not match
            eng.transfer(comm, [(1, 0, bad)], None, 5)
            out["sent"] = good[0].clone()
        else:
            header = eng.install(5, *eng.transfer(comm, [], (0, 0), 5))
            out["got"] = eng.local_slot(5).flat.clone()
            out["header"] = header
            with pytest.raises(CorruptState) as e:
                eng.transfer(comm, [], (0, 0), 5)
            out["bad"] = (e.value.holder, e.value.owner, e.value.step)
        return comm

    run_threads(rank_fn, 2)
    assert torch.equal(out["sent"], out["got"]) and out["header"] == {"step": 5}
    assert out["bad"] == (0, 0, 5)
    assert encode_header({"step": 5}) == b'{"step": 5}'
