"""``compile=true`` (deadpool/parallel/compile.py) in one process, through the real trainer: the
loss curve equals the eager one within a stated tolerance, and a warm-up compiles every graph
training needs (what a spare does while warm), so training then compiles nothing.

CPU inductor compiles take tens of seconds on a loaded machine: one trainer run per mode."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.parallel import compile as dp_compile
from tests.deadpool.test_trainer import STEPS, trainer

# compiled vs eager after 6 AdamW steps of the tiny model: fp32 rounding of fused elementwise
# and reduction order (measured: 1e-6 after 5 steps in one process)
LOSS_RTOL = 1e-4


def losses(path):
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_compiled_blocks_match_eager_and_a_warm_up_leaves_nothing_to_compile(tmp_path):
    eager, comm = trainer(tmp_path, "eager", extra=["model.n_kv_heads=2"])
    eager.train(comm)
    torch._dynamo.reset()  # a fresh process's compile state
    dp_compile._kernels = None
    tr, comm = trainer(tmp_path, "compiled", extra=["model.n_kv_heads=2", "compile=true"])
    stage = tr.stage
    assert all(type(b).forward is not b.forward.__func__ for b in stage.blocks.values())
    micro = tr.cfg["batch_size"] // tr.microbatches
    warm = dp_compile.warm_up(stage, micro, tr.cfg["seq_len"])
    assert warm > 0 and dp_compile.warm_compiles() >= warm
    trained_from = dp_compile.compiles()
    tr.train(comm)
    rows = [json.loads(line) for line in (tmp_path / "compiled.jsonl").read_text().splitlines()]
    # every graph training ran was compiled while warm: nothing at any step
    assert [r["compiles"] for r in rows] == [trained_from] * STEPS
    a, b = losses(tmp_path / "eager.jsonl"), losses(tmp_path / "compiled.jsonl")
    for x, y in zip(a, b):
        assert y == pytest.approx(x, rel=LOSS_RTOL)
    # the compiled arithmetic is deterministic: the same run again gives the same bits
    again, comm = trainer(tmp_path, "again", extra=["model.n_kv_heads=2", "compile=true"])
    again.train(comm)
    assert losses(tmp_path / "again.jsonl") == b
    for k, v in again.state_dict().items():
        assert torch.equal(v, tr.state_dict()[k]), k
