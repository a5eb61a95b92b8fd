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
