"""The training loop of one rank (deadpool/rank/trainer.py), in-process on a one-rank communicator:
step accounting, metrics, snapshots, and a rollback replayed exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from deadpool.errors import Aborted
from deadpool.rank.comm import Communicator
from deadpool.rank.faults import FaultInjector
from deadpool.rank.trainer import Trainer
from deadpool.store.protocol import Keys
from deadpool.threads import wait_until
from deadpool.topology import ParallelDims, Topology
from tests.conftest import compose_train

STEPS = 6


def trainer(tmp_path, name="m", extra=()):
    cfg = compose_train(["model=tiny", "parallel.dp=1", f"num_steps={STEPS}", "log_every_steps=0",
                         "ft.persist_interval_steps=0", *extra], tmp_path)
    dims = ParallelDims.from_config(cfg["parallel"])
    tr = Trainer(cfg, 0, FaultInjector([], 0), tmp_path / f"{name}.jsonl")
    tr.build(dims, 0)
    tr.rank = 0
    comm = Communicator.build(Topology(dims, 0, 0), dist.HashStore())
    tr.snapshot_now()
    return tr, comm


def test_every_step_is_counted_logged_and_snapshotted(tmp_path):
    tr, comm = trainer(tmp_path)
    firsts = []
    tr.train(comm, on_first_step=lambda: firsts.append(tr.step))
    assert tr.step == STEPS and not tr.dirty and firsts == [1]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["snapshot"] and r["loss"] is not None and r["step_time_s"] > 0 for r in rows)
    assert tr.engine.local_steps() == [STEPS - 2, STEPS - 1, STEPS]  # the ring of 3
    assert tr.header()["step"] == STEPS


def test_without_snapshots_the_trainer_holds_no_snapshot_ring(tmp_path):
    tr, comm = trainer(tmp_path, extra=["ft=none"])  # snapshot_now(): as after a recovery
    tr.train(comm)
    assert tr.step == STEPS
    assert sum(s.flat is not None for s in tr.engine.slots) == 1  # the one snapshot_now wrote
    fresh, _ = trainer(tmp_path, "fresh", extra=["ft.snapshot=false"])
    assert fresh.engine.slots[0].flat is not None  # snapshot_now: allocated on use
    assert all(s.flat is None for s in fresh.engine.slots[1:])


def test_a_rollback_to_a_snapshot_replays_to_the_same_bits(tmp_path):
    tr, comm = trainer(tmp_path)
    tr.train(comm)
    final = {k: v.clone() for k, v in tr.state_dict().items()}
    tr.apply_header(tr.engine.restore_local(STEPS - 2))
    assert tr.step == STEPS - 2
    assert any(not torch.equal(final[k], v) for k, v in tr.state_dict().items())
    tr.train(comm)
    assert tr.step == STEPS
    for k, v in tr.state_dict().items():
        assert torch.equal(final[k], v), k


def test_an_aborted_generation_stops_the_loop_before_the_next_step(tmp_path):
    tr, comm = trainer(tmp_path)
    comm.store.set(Keys(0).abort, "rank 1 failed")
    # the generation's abort watcher reads the key (every ft.collective_poll_s)
    assert wait_until(comm.aborted, every_s=0.005, timeout_s=5.0)
    with pytest.raises(Aborted, match="rank 1 failed"):
        tr.train(comm)
    assert tr.step == 0 and not tr.dirty


BF16 = ("precision=bf16", "grad_clip=1.0", "lr_schedule=cosine", "warmup_steps=2")


def test_bf16_rollback_replays_to_the_same_bits_with_schedule_and_clipping(tmp_path):
    from deadpool.rank.lr_schedule import lr_at

    tr, comm = trainer(tmp_path, extra=BF16)
    tr.train(comm)
    final = {k: v.clone() for k, v in tr.state_dict().items()}
    assert final["params"].dtype == torch.bfloat16 and final["master"].dtype == torch.float32
    assert torch.equal(final["params"][:tr.opt.numel],
                       final["master"][:tr.opt.numel].to(torch.bfloat16))
    tr.apply_header(tr.engine.restore_local(STEPS - 2))
    tr.train(comm)
    for k, v in tr.state_dict().items():
        assert torch.equal(final[k], v), k
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows[:STEPS]] == [lr_at(s, tr.cfg) for s in range(STEPS)]
    assert [r["lr"] for r in rows[STEPS:]] == [lr_at(s, tr.cfg) for s in (STEPS - 2, STEPS - 1)]
    assert all(r["grad_norm"] > 0 and r["skipped_steps"] == 0 for r in rows)


def test_a_non_finite_gradient_norm_skips_the_update_and_is_counted(tmp_path, monkeypatch):
    import deadpool.rank.trainer as trainer_mod

    real, calls = trainer_mod.global_grad_norm, []

    def norm(grad_shard, runs, comm):  # step 4's gradient norm is NaN
        calls.append(1)
        return float("nan") if len(calls) == 5 else real(grad_shard, runs, comm)

    monkeypatch.setattr(trainer_mod, "global_grad_norm", norm)
    tr, comm = trainer(tmp_path, extra=BF16)
    tr.train(comm)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 0, 0, 1, 1]
    assert rows[4]["grad_norm"] is None and tr.step == STEPS and tr.header()["skipped_steps"] == 1
    assert dict((n, t) for n, t, _ in tr.opt.state_tensors())["step"].item() == STEPS - 1
    # the skipped step left the state as it was: the snapshots of steps 4 and 5 hold the same
    # bytes (headers aside), and step 6 moved on
    flat = {s: tr.engine.local_slot(s).flat.clone() for s in (4, 5, 6)}
    assert torch.equal(flat[4], flat[5]) and not torch.equal(flat[5], flat[6])


def test_a_bf16_run_resumed_from_disk_ends_with_the_same_bits(tmp_path):
    """The disk checkpoint (written from the snapshots) holds the bf16 parameters, the fp32
    master and the skipped-step count; a fresh trainer loaded from the middle one finishes
    like the run that never stopped."""
    from deadpool.checkpoint import rank_state

    ckpt = tmp_path / "ckpt"
    tr, comm = trainer(tmp_path, extra=BF16 + ("ft.persist_interval_steps=3",
                                              f"ft.checkpoint_dir={ckpt}"))
    tr.train(comm)
    tr.engine.drain()
    tr.engine.persister.wait()
    final = {k: v.clone() for k, v in tr.state_dict().items()}
    fresh, comm2 = trainer(tmp_path, name="fresh", extra=BF16)
    rank_state.load(fresh, fresh.dims, ckpt / "step_3", 0)
    assert fresh.step == 3 and fresh.state_dict()["master"].dtype == torch.float32
    assert not torch.equal(fresh.state_dict()["master"], final["master"])
    fresh.train(comm2)
    for k, v in fresh.state_dict().items():
        assert torch.equal(final[k], v), k


# -- ZeRO-1's parameter all-gather overlapped with the next forward (parallel.overlap_param_gather)

def run_ranks(tmp_path, overlap: bool, layout=("parallel=dp2",), extra=(), injector=None,
              before=None):
    """Train ``STEPS`` steps with every rank of ``layout`` in a thread; returns each rank's
    ``(trainer, state)`` (state: its state tensors' clones) or the exception it raised."""
    from tests.deadpool.helpers import client, master_store

    master = master_store()
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = compose_train(["model=tiny", *layout, f"num_steps={STEPS}", "log_every_steps=0",
                         "ft.persist_interval_steps=0", "ft.snapshot=false",
                         f"parallel.overlap_param_gather={str(overlap).lower()}", *extra],
                        tmp_path)
    dims = ParallelDims.from_config(cfg["parallel"])

    def rank_fn(r):
        tr = Trainer(cfg, r, injector(r) if injector else FaultInjector([], r),
                     tmp_path / f"{'on' if overlap else 'off'}{r}.jsonl")
        tr.build(dims, r)
        tr.rank = r
        comm = Communicator.build(Topology(dims, r, 0), client(master.port), poll_s=0.01)
        if before is not None:
            before(r, tr)
        try:
            tr.train(comm)
        except Aborted as e:
            return tr, e, comm  # comm kept referenced: an op is still in flight on it
        return tr, {n: t.clone() for n, t, _ in tr.opt.state_tensors()}

    from tests.deadpool.helpers import run_threads
    return run_threads(rank_fn, dims.world_size, timeout_s=120)


@pytest.mark.parametrize("layout,extra", [
    (("parallel=dp2",), ()),
    (("parallel=dp2",), ("precision=bf16", "grad_clip=1.0", "parallel.bucket_mb=0.05")),
    (("parallel=dp2", "parallel.pp=2", "parallel.ranks_per_node=4"), ("parallel.microbatches=2",)),
])
def test_overlapped_param_gather_trains_to_the_same_bits(tmp_path, layout, extra):
    """Every parameter and optimizer shard after training with the gather overlapped equals the
    run that waits for it inside the step (torch.equal), and the forward did wait: each
    module's pre-hook found its bucket pending on some step (rank 1 posts 0.2 s late, so a
    forward reading a bucket without waiting would read last step's values)."""
    import time

    waited = []

    def late(r, tr):  # rank 1 posts its buckets late: a forward that does not wait reads stale
        real = tr.opt._post_gathers

        def post(comm, pg):
            if r % 2:  # dp rank 1 (dp is the fastest axis)
                time.sleep(0.2)
            real(comm, pg)
        tr.opt._post_gathers = post
        real_wait = tr.opt.wait_param_gather

        def wait(upto=None):
            waited.append(bool(tr.opt._gathers))
            real_wait(upto)
        tr.opt.wait_param_gather = wait

    off = run_ranks(tmp_path / "off", False, layout, extra)
    on = run_ranks(tmp_path / "on", True, layout, extra, before=late)
    for (_, a), (tr, b) in zip(off, on):
        assert tr.opt.overlap_param_gather and not tr.dirty and tr.step == STEPS
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    assert any(waited)


def test_a_forward_reading_a_bucket_in_flight_is_caught(tmp_path):
    """Without the forward pre-hooks (``hook_forward``) the first layers read the previous
    step's parameters while rank 1's buckets are late: the states then differ from the
    non-overlapped run. This is what the bitwise test above would see if a hook were missing."""
    import time

    def no_hooks(r, tr):
        for m in tr.stage.modules():
            m._forward_pre_hooks.clear()
        real = tr.opt._post_gathers

        def post(comm, pg):
            if r == 1:
                time.sleep(0.2)
            real(comm, pg)
        tr.opt._post_gathers = post

    off = run_ranks(tmp_path / "off", False)
    on = run_ranks(tmp_path / "on", True, before=no_hooks)
    assert any(not torch.equal(a["params"], b["params"]) for (_, a), (_, b) in zip(off, on))


def test_an_abort_during_a_pending_gather_raises_at_the_wait_and_leaves_the_trainer_dirty(
        tmp_path):
    """Rank 1 fails inside its optimizer step of step 2 (phase ``param_gather``: its shard is
    updated, its broadcasts never posted). Rank 0 ends step 2 (its gather only posted) and,
    once the generation is aborted, raises ``Aborted`` from the forward pre-hook's wait in step
    3: its live state (step 3, parameters partly of step 2) is dirty, so recovery restores it
    from a snapshot or a peer rather than resuming from it."""
    import threading
    import traceback

    entered, comms = threading.Event(), {}

    class Fail:
        def __init__(self, r):
            self.r = r

        def fire(self, step, phase):
            if self.r == 1 and (step, phase) == (2, "param_gather"):
                entered.wait(30)  # rank 0 is waiting for this rank's buckets
                comms[1].store.set(Keys(0).abort, "rank 1 failed")
                raise Aborted("rank 1 failed")

    def before(r, tr):
        if r == 0:
            real = tr.opt.wait_param_gather

            def wait(upto=None):
                if tr.opt._gathers and tr.step == 3:
                    entered.set()
                real(upto)
            tr.opt.wait_param_gather = wait

    real_build = Communicator.build

    def build(topo, store, **kw):  # keep each rank's communicator (rank 1 aborts through it)
        comms[topo.rank] = real_build(topo, store, **kw)
        return comms[topo.rank]

    Communicator.build = build
    try:
        (tr0, err0, _), (tr1, err1, _) = run_ranks(tmp_path, True, injector=Fail, before=before)
    finally:
        Communicator.build = real_build
    assert isinstance(err0, Aborted) and "rank 1 failed" in str(err0)
    tb = "".join(traceback.format_tb(err0.__traceback__))
    assert "in wait_param_gather" in tb and "_call_impl" in tb  # from a forward pre-hook
    assert tr0.step == 3 and tr0.dirty and tr0.opt.param_gather_pending
    assert tr1.step == 2 and tr1.dirty  # cut inside its optimizer step
    tr0.opt.abandon_param_gather()  # what loading a snapshot or a peer's state does
    assert not tr0.opt.param_gather_pending
