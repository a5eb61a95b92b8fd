"""Resume at another layout (issue 37): a checkpoint written at dp2 x tp2 x pp2 gives every rank
of dp4, tp4 or pp4 exactly the state a checkpoint written at that layout from the same model and
optimizer would give it.

The reference is built here independently of ``checkpoint.relayout``: whole tensors of the
single-process model (every element distinct, moments too) cut per layout with ``shard`` in the
stage's order and per data-parallel rank as ZeRO-1 pads and shards. A tensor-parallel piece in the
wrong order, a moment taken from another stage or a wrong shard fails ``torch.equal``."""

from __future__ import annotations

import pytest
import torch

from deadpool import checkpoint
from deadpool.checkpoint.relayout import relayout_state, stage_params
from deadpool.checkpoint.unique import unique_part
from deadpool.model import GPT, model_config
from deadpool.parallel.tensor.layers import shard
from deadpool.topology import ParallelDims

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MODEL = model_config({"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4,
                      "n_kv_heads": 4, "ffn_mult": 4, "max_seq_len": 16})


def _full(mixed: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Whole tensors per kind: distinct values everywhere."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPT(MODEL).named_parameters()}
    g = torch.Generator().manual_seed(3)
    kinds = ("params", "master", "exp_avg", "exp_avg_sq") if mixed else ("params", "exp_avg", "exp_avg_sq")
    out = {k: {n: torch.randn(s, generator=g) for n, s in shapes.items()} for k in kinds}
    if mixed:
        out["params"] = {n: t.to(torch.bfloat16) for n, t in out["master"].items()}
    return out


def _rank_state(full, dims: ParallelDims, rank: int, zero: bool = True) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of ``dims`` holds (ZeroOptimizer.state_tensors names)."""
    c = dims.coords(rank)
    names = [n for n, _ in stage_params(MODEL, c["pp"], dims.pp, c["tp"], dims.tp)]
    out = {}
    for kind, by_name in full.items():
        flat = torch.cat([shard(n, by_name[n], c["tp"], dims.tp, model_cfg=MODEL).reshape(-1)
                          for n in names])
        padded = torch.zeros(-(-flat.numel() // dims.dp) * dims.dp, dtype=flat.dtype)
        padded[:flat.numel()] = flat
        n = padded.numel() // dims.dp
        out[kind] = padded if kind == "params" or not zero else padded[c["dp"] * n:(c["dp"] + 1) * n]
    out["step"] = torch.tensor(7.0)
    return out


def _write(root, full, dims: ParallelDims, step: int = 5) -> None:
    for r in range(dims.world_size):
        st, hdr = unique_part(_rank_state(full, dims, r), {"step": step}, ("params",),
                              dims.layout, r)
        checkpoint.save_rank_state(root, step, r, st, hdr, layout=dims.layout,
                                   world_size=dims.world_size)
    checkpoint.write_meta(root, step, dims.world_size, "periodic", layout=dims.layout)


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("new", [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 1, 4), (1, 2, 1)],
                         ids=["dp4", "tp4", "pp4", "dp2xpp4", "tp2"])
def test_a_rank_of_another_layout_gets_what_that_layout_would_have_written(tmp_path, new, mixed):
    old = ParallelDims(2, 2, 2, ranks_per_node=2)
    new = ParallelDims(*new, ranks_per_node=new[1])
    full = _full(mixed)
    _write(tmp_path, full, old)
    step_dir = checkpoint.latest_step_dir(tmp_path)
    for r in range(new.world_size):
        got = relayout_state(step_dir, old, new, r, MODEL, shard_optimizer=True)
        want = _rank_state(full, new, r)
        if not mixed:  # an fp32 ZeRO-1 rank's master is its own slice of the parameters
            n = want["params"].numel() // new.dp
            want["master"] = want["params"][new.coords(r)["dp"] * n:][:n]
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype, (r, k)
            assert torch.equal(got[k], want[k]), f"rank {r} of {new.layout}: {k} differs"


def test_a_checkpoint_without_zero_relayouts_too(tmp_path):
    """Optimizer state replicated across dp (parallel.zero=false): written by dp rank 0 only."""
    old, new = ParallelDims(2, 2, 2, ranks_per_node=2), ParallelDims(1, 4, 1, ranks_per_node=4)
    full = _full(False)
    for r in range(old.world_size):
        st, hdr = unique_part(_rank_state(full, old, r, zero=False), {"step": 5},
                              ("params", "exp_avg", "exp_avg_sq", "step"), old.layout, r)
        checkpoint.save_rank_state(tmp_path, 5, r, st, hdr, layout=old.layout, world_size=8)
    checkpoint.write_meta(tmp_path, 5, 8, "periodic", layout=old.layout)
    for r in range(new.world_size):
        got = relayout_state(tmp_path / "step_5", old, new, r, MODEL, shard_optimizer=False)
        want = _rank_state(full, new, r, zero=False)
        for k in ("params", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[k], want[k]), (r, k)
