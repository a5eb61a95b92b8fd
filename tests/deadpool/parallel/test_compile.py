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


@pytest.mark.slow
def test_compiled_tensor_parallel_stage_matches_eager_with_collectives_outside():
    """tp 2 (ranks as threads): the compiled pieces between the eager TP all-reduces give the
    eager stage's loss and gradients within fp32 rounding."""
    from deadpool.parallel.stage import build_stage
    from tests.deadpool.helpers import master_store, run_threads
    from tests.deadpool.parallel.test_tensor import tp_comm

    cfg = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_mult=2,
               max_seq_len=16)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    master = master_store()

    def rank_fn(r):
        comm = tp_comm(master, r)
        out = []
        for compiled in (False, True):
            stage = build_stage(cfg, 3, pp_rank=0, pp=1, tp_rank=r, tp=2)
            dp_compile.compile_blocks(stage, compiled)
            loss = stage(x, comm, y)
            loss.backward()
            out.append((loss.detach(), {n: p.grad for n, p in stage.named_parameters()}))
        return out

    # without the eager all-reduces between the pieces each rank's loss would be its shard's
    for (eager_loss, eager_grads), (loss, grads) in run_threads(rank_fn, 2, timeout_s=900):
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for n, gr in grads.items():
            torch.testing.assert_close(gr, eager_grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_checkpointed_compiled_blocks_give_the_gradients_of_compiled_blocks():
    """``activation_checkpointing=full|selective`` under ``compile=true``: the compiled block
    recomputed in backward (full), or selective left to inductor's partitioner, gives bitwise the
    gradients of the compiled block without checkpointing."""
    from deadpool.model import build_model

    cfg = dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_mult=4,
               max_seq_len=256)
    x = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(3))
    grads = {}
    for mode in ("none", "full", "selective"):
        m = build_model(cfg, 1, activation_checkpointing=mode)
        dp_compile.compile_blocks(m)
        m(x[:, :-1], x[:, 1:]).backward()
        grads[mode] = {n: p.grad for n, p in m.named_parameters()}
    for mode in ("full", "selective"):
        for n, g in grads["none"].items():
            assert torch.equal(grads[mode][n], g), (mode, n)
