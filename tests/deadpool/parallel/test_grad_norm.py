"""The global gradient norm over dp2 x tp2 x pp2 (ranks as threads) against
``torch.nn.utils.clip_grad_norm_`` on the single-process model, the agreement of every rank
on a non-finite norm, and the job-wide maximum over the same route."""

import math

import pytest
import torch

from deadpool.model import build_model
from deadpool.parallel.data import ZeroOptimizer
from deadpool.parallel.grad_norm import clip_, global_grad_norm, global_max
from deadpool.parallel.pipeline import run_1f1b
from deadpool.parallel.stage import build_stage
from deadpool.parallel.tensor import shard
from deadpool.parallel.tensor.layers import tp_replicated
from deadpool.rank.comm import Communicator
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads
from tests.deadpool.parallel.test_pipeline import SEED, TINY, batch

DP, TP, PP, M, B = 2, 2, 2, 2, 4


def run_ranks(max_norm=None, poison=None, count_replicated_everywhere=False, dtype=torch.float32):
    """One step's gradients on every rank, reduced; returns per rank (coords, norm, the owned
    gradient shard after clipping, the optimizer, the stage)."""
    torch.set_num_threads(1)
    dims = ParallelDims(DP, TP, PP, ranks_per_node=DP * TP * PP)
    master = master_store()

    def rank_fn(r):
        comm = Communicator.build(Topology(dims, r, 0), client(master.port), poll_s=0.01)
        c = comm.topo.coords
        stage = build_stage(TINY, SEED, pp_rank=c["pp"], pp=PP, tp_rank=c["tp"], tp=TP).to(dtype)
        opt = ZeroOptimizer(list(stage.parameters()), dp_size=DP, dp_rank=c["dp"], lr=1e-3,
                            weight_decay=0.0, adamw="for_loop")
        once = {id(p) for n, p in stage.named_parameters() if c["tp"] > 0 and tp_replicated(n)
                and not count_replicated_everywhere}
        runs = opt.owned_runs(lambda p: id(p) not in once)
        opt.begin_step(comm, M)
        x, y = batch(B, seed=c["dp"])
        run_1f1b(stage, comm, x, y, M, act_dtype=dtype)
        opt.reduce_grads(comm)
        if poison is not None and r == poison[0]:
            opt.grad_shard[3] = poison[1]
        norm = global_grad_norm(opt.grad_shard, runs, comm)
        if max_norm is not None:
            clip_(opt.grad_shard, max_norm, norm)
        return c, norm, opt.grad_shard.clone(), opt, stage

    return run_threads(rank_fn, dims.world_size)


def single_process(max_norm, dtype=torch.float32):
    model = build_model(TINY, SEED).to(dtype)
    grads = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for d in range(DP):  # each replica's gradient in the model's dtype, summed in fp32
        x, y = batch(B, seed=d)
        model.zero_grad()
        (model(x, y) / DP).backward()
        for n, p in model.named_parameters():
            grads[n] += p.grad.float()
    params = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads.values()]
    for p, g in zip(params, grads.values()):
        p.grad = g
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm), grads


def test_global_norm_and_clipped_shards_match_clip_grad_norm_on_one_process():
    ref_norm, _ = single_process(float("inf"))
    max_norm = ref_norm / 3  # clipping is active
    ref_norm, ref_grads = single_process(max_norm)
    results = run_ranks(max_norm)
    norms = {norm for _, norm, _, _, _ in results}
    assert len(norms) == 1  # the same bits on every rank
    assert norms.pop() == pytest.approx(ref_norm, rel=1e-5)
    for c, _, got, opt, stage in results:
        want = torch.zeros(opt.padded_numel)
        flat = torch.cat([shard(n, ref_grads[n], c["tp"], TP).reshape(-1)
                          for n, _ in stage.named_parameters()])
        want[:flat.numel()] = flat
        lo, hi = opt.shard_range
        torch.testing.assert_close(got, want[lo:hi], rtol=1e-4, atol=1e-7)


def test_counting_a_replicated_norm_on_every_tp_rank_would_be_caught():
    """The reference comparison can fail: with the RMSNorm weights counted on both tp ranks the
    norm is off by more than the tolerance above."""
    ref_norm, _ = single_process(float("inf"))
    norm = run_ranks(count_replicated_everywhere=True)[0][1]
    assert norm != pytest.approx(ref_norm, rel=1e-5)


def test_bf16_global_norm_matches_the_single_process_bf16_model():
    """In bf16 (gradients folded into fp32 per micro-batch, reduced in fp32) the norm follows
    the single-process bf16 model's; each rounds its bf16 gradients in other places (tensor
    and pipeline splits, micro-batches), hence the tolerance (bf16 has 8 mantissa bits):
    measured 1.5e-3 relative, allowed 1e-2."""
    ref_norm, _ = single_process(float("inf"), torch.bfloat16)
    norm = run_ranks(dtype=torch.bfloat16)[0][1]
    assert norm == pytest.approx(ref_norm, rel=1e-2)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_every_rank_sees_a_non_finite_norm_from_one_rank(bad):
    results = run_ranks(max_norm=1.0, poison=(6, bad))  # rank 6: last stage, dp 1, tp 0
    for _, norm, _, _, _ in results:
        assert not math.isfinite(norm)
        assert math.isnan(norm) == math.isnan(bad)
    # clipping leaves a non-finite step's gradients alone (the trainer skips the update)
    assert all(torch.isfinite(g).all() for c, _, g, _, _ in results if c != {"pp": 1, "dp": 1, "tp": 0})


@pytest.mark.parametrize("top", [0, 5, 7])
def test_every_rank_gets_the_job_wide_maximum_over_dp_tp_and_the_pipeline(top):
    """Each rank proposes a distinct number; the largest sits on one rank (first stage, a middle
    one, the last), so a route that skipped an axis or a direction of the chain would miss it."""
    torch.set_num_threads(1)
    dims = ParallelDims(DP, TP, PP, ranks_per_node=DP * TP * PP)
    master = master_store()

    def rank_fn(r):
        comm = Communicator.build(Topology(dims, r, 0), client(master.port), poll_s=0.01)
        return global_max(100 if r == top else 10 + r, comm)

    assert run_threads(rank_fn, dims.world_size) == [100.0] * dims.world_size
