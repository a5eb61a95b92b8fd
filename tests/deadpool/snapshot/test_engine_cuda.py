"""The CUDA snapshot path: pinned buffers filled on a side stream (skipped without a GPU)."""

import pytest
import torch

from deadpool.model import build_model, build_optimizer
from deadpool.snapshot import SnapshotEngine, state_tensors

TINY = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_mult=2, max_seq_len=16)


@pytest.mark.gpu
def test_side_stream_snapshot_is_consistent_and_restores_exactly():
    model = build_model(TINY, 0, device="cuda")
    opt = build_optimizer(model, 1e-2, 0.0)
    eng = SnapshotEngine(state_tensors(model, opt), device="cuda")
    assert eng.slots[0].flat.is_pinned()
    x = torch.randint(0, 64, (2, 8), device="cuda")
    model(x, x).backward()
    opt.step()
    opt.zero_grad()
    before = {n: t.detach().clone() for n, t in state_tensors(model, opt)}
    eng.snapshot(1, {"step": 1})
    model(x, x).backward()   # overlaps the device-to-host copy
    eng.wait_copy()          # the contract: before the optimizer step
    opt.step()
    eng.drain()
    eng.restore_local(1)
    torch.cuda.synchronize()
    for n, t in state_tensors(model, opt):
        assert torch.equal(before[n], t), n
