"""The training loop of one rank (deadpool/trainer.py), in-process on a one-rank communicator:
step accounting, metrics, snapshots, and a rollback replayed exactly."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from deadpool.comm import Communicator
from deadpool.errors import Aborted
from deadpool.faults import FaultInjector
from deadpool.protocol import Keys
from deadpool.threads import wait_until
from deadpool.topology import ParallelDims, Topology
from deadpool.trainer import Trainer
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
    from deadpool.lr_schedule import lr_at

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
    import deadpool.trainer as trainer_mod

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
