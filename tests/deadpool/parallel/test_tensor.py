"""Tensor-parallel pieces against their dense versions (tp=2 ranks as threads)."""

import time

import pytest
import torch
import torch.nn.functional as F

from deadpool.errors import Aborted
from deadpool.model import build_model
from deadpool.parallel.stage import build_stage
from deadpool.parallel.tensor import (ColumnParallelLinear, RowParallelLinear,
                                      VocabParallelEmbedding, copy_to_tp, shard, unshard,
                                      vocab_parallel_cross_entropy)
from deadpool.rank.comm import Communicator
from deadpool.store.protocol import Keys
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads, shorten_timeouts

TP = 2
MHA = dict(vocab_size=16, d_model=8, n_layers=1, n_heads=4, ffn_mult=2, max_seq_len=8)
close = dict(rtol=1e-5, atol=1e-6)

# communicators with an op abandoned in flight, kept referenced (deleting such a group blocks)
KEPT: list = []


def tp_comm(master, r, tp=TP, generation=0, timeout_s=120.0):
    dims = ParallelDims(1, tp, 1, ranks_per_node=tp)
    return Communicator.build(Topology(dims, r, generation), client(master.port), poll_s=0.01,
                              timeout_s=timeout_s)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_column_then_row_parallel_linear_match_dense():
    torch.set_num_threads(1)
    d_in, hidden, d_out = 8, 12, 6
    x, w1, w2 = randn(3, 5, d_in, seed=1), randn(hidden, d_in, seed=2), randn(d_out, hidden, seed=3)
    gy = randn(3, 5, d_out, seed=4)
    # dense reference: y = gelu(x W1^T) W2^T
    xd, w1d, w2d = (t.clone().requires_grad_() for t in (x, w1, w2))
    hd = F.linear(xd, w1d)
    yd = F.linear(F.gelu(hd), w2d)
    (yd * gy).sum().backward()
    master = master_store()

    def rank_fn(r):
        comm = tp_comm(master, r)
        col, row = ColumnParallelLinear(d_in, hidden, TP), RowParallelLinear(hidden, d_out, TP)
        with torch.no_grad():
            col.weight.copy_(w1.chunk(TP, 0)[r])
            row.weight.copy_(w2.chunk(TP, 1)[r])
        xr = x.clone().requires_grad_()
        h = col(copy_to_tp(xr, comm))
        y = row(F.gelu(h), comm)
        (y * gy).sum().backward()
        return h.detach(), y.detach(), xr.grad, col.weight.grad, row.weight.grad

    for r, (h, y, gx, g1, g2) in enumerate(run_threads(rank_fn, TP)):
        torch.testing.assert_close(h, hd.detach().chunk(TP, -1)[r], **close)  # column: a slice
        torch.testing.assert_close(y, yd.detach(), **close)  # row: the full output
        torch.testing.assert_close(gx, xd.grad, **close)  # copy_to_tp all-reduced it
        torch.testing.assert_close(g1, w1d.grad.chunk(TP, 0)[r], **close)
        torch.testing.assert_close(g2, w2d.grad.chunk(TP, 1)[r], **close)


def test_vocab_parallel_embedding_and_cross_entropy_match_dense():
    torch.set_num_threads(1)
    vocab, d, n = 10, 4, 7
    emb, head = randn(vocab, d, seed=5), randn(vocab, d, seed=6)
    idx = torch.tensor([0, 4, 5, 9, 3, 5, 8])
    targets = torch.tensor([9, 0, 4, 5, 5, 1, 7])  # both halves of the vocabulary
    embd, headd = emb.clone().requires_grad_(), head.clone().requires_grad_()
    logits_d = F.linear(F.embedding(idx, embd), headd) * 3  # large logits: the max matters
    loss_d = F.cross_entropy(logits_d, targets)
    loss_d.backward()
    master = master_store()

    def rank_fn(r):
        comm = tp_comm(master, r)
        layer = VocabParallelEmbedding(vocab, d, r, TP)
        w = head.chunk(TP, 0)[r].clone().requires_grad_()
        with torch.no_grad():
            layer.weight.copy_(emb.chunk(TP, 0)[r])
        x = layer(idx, comm)
        logits = F.linear(copy_to_tp(x, comm), w) * 3
        loss = vocab_parallel_cross_entropy(logits, targets, layer.vocab_start, comm).mean()
        loss.backward()
        return x.detach(), loss.detach(), layer.weight.grad, w.grad

    for r, (x, loss, g_emb, g_head) in enumerate(run_threads(rank_fn, TP)):
        torch.testing.assert_close(x, emb[idx], **close)
        torch.testing.assert_close(loss, loss_d.detach(), **close)
        torch.testing.assert_close(g_emb, embd.grad.chunk(TP, 0)[r], **close)
        torch.testing.assert_close(g_head, headd.grad.chunk(TP, 0)[r], **close)


def test_qkv_shard_holds_whole_heads_of_q_k_and_v():
    d, tp = 8, 2  # 4 heads of 2: rank 1 holds heads 2, 3 of each of q, k, v
    full = torch.arange(3 * d).float().unsqueeze(1).expand(3 * d, 3)
    rows = shard("blocks.0.attn.qkv.weight", full, 1, tp, MHA)[:, 0].tolist()
    assert rows == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    assert shard("blocks.0.attn.out.weight", full[:d, :].T, 1, tp).shape == (3, 4)
    assert torch.equal(shard("norm.weight", full, 1, tp), full)


def test_qkv_shard_under_gqa_keeps_each_query_head_with_its_kv_head():
    # 4 query heads, 2 KV heads of 2 rows each: q rows 0-7, k rows 8-11, v rows 12-15
    gqa = dict(MHA, n_kv_heads=2)
    full = torch.arange(16).float().unsqueeze(1).expand(16, 3)
    rows = [shard("blocks.0.attn.qkv.weight", full, r, 2, gqa)[:, 0].tolist() for r in range(2)]
    assert rows == [[0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 10, 11, 14, 15]]
    with pytest.raises(ValueError, match="grouped-query q/k/v weight .* needs the model config"):
        shard("blocks.0.attn.qkv.weight", full, 0, 2)
    mha = torch.arange(24).float().unsqueeze(1).expand(24, 8)  # [3 d, d]: thirds, config or not
    assert torch.equal(shard("blocks.0.attn.qkv.weight", mha, 1, 2),
                       shard("blocks.0.attn.qkv.weight", mha, 1, 2, MHA))
    with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by tp=4"):
        shard("blocks.0.attn.qkv.weight", full, 0, 4, gqa)


@pytest.mark.parametrize("tp", [2, 4])
def test_unshard_inverts_shard_for_every_parameter(tp):
    cfg = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=8, n_kv_heads=4, ffn_mult=2,
               max_seq_len=8)
    for name, full in build_model(cfg, 0).named_parameters():
        pieces = [shard(name, full.detach(), r, tp, cfg) for r in range(tp)]
        assert torch.equal(unshard(name, pieces, cfg), full), name


GQA_TINY = dict(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_mult=2,
                max_seq_len=8)


def run_tp2_step(model_cfg, activation_checkpointing="none"):
    """One forward/backward of a tp=2 stage per rank (threads): (loss, grads, tp ops posted)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)
    master = master_store()

    def rank_fn(r):
        torch.set_num_threads(1)
        comm = tp_comm(master, r)
        stage = build_stage(model_cfg, 9, pp_rank=0, pp=1, tp_rank=r, tp=TP,
                            activation_checkpointing=activation_checkpointing)
        loss = stage(x, comm, y)
        loss.backward()
        return (loss.detach(), {n: p.grad for n, p in stage.named_parameters()},
                comm.groups["tp"].posted)

    return run_threads(rank_fn, TP), (x, y)


def test_gqa_tp2_matches_the_single_process_model():
    """Query and KV heads split over two ranks reproduce the dense model: forward and every
    gradient within float32 rounding of the differently ordered sums (rtol 1e-5)."""
    results, (x, y) = run_tp2_step(GQA_TINY)
    dense = build_model(GQA_TINY, 9)
    loss = dense(x, y)
    loss.backward()
    for r, (got, grads, _) in enumerate(results):
        torch.testing.assert_close(got, loss.detach(), rtol=1e-6, atol=0)
        for name, p in dense.named_parameters():
            torch.testing.assert_close(grads[name], shard(name, p.grad, r, TP, GQA_TINY),
                                       rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_at_tp2_gives_bitwise_the_same_gradients(mode):
    """``full`` re-runs a block's forward in backward up to its last saved tensor (the MLP's down
    projection input): the attention's all-reduce again, the MLP's not. On both ranks alike (one
    more per block, the same count on each) and with the same sums, so every gradient is bitwise
    the one without checkpointing. ``selective`` recomputes no communication."""
    plain, _ = run_tp2_step(GQA_TINY)
    ckpt, _ = run_tp2_step(GQA_TINY, mode)
    extra = GQA_TINY["n_layers"] if mode == "full" else 0
    for (l0, g0, ops0), (l1, g1, ops1) in zip(plain, ckpt):
        assert torch.equal(l0, l1)
        assert all(torch.equal(g0[n], g1[n]) for n in g0)
        assert ops1 == ops0 + extra
    assert ckpt[0][2] == ckpt[1][2]


def test_a_rank_blocked_in_a_tp_allreduce_leaves_on_abort():
    # rank 1 never joins the forward's all-reduces; the abort key releases rank 0
    torch.set_num_threads(1)
    cfg = dict(vocab_size=16, d_model=8, n_layers=1, n_heads=2, ffn_mult=2, max_seq_len=8)
    master = master_store()

    def rank_fn(r):
        # the abandoned all-reduce stays in flight until the group's timeout (5 s once
        # connected: the process must not wait for it at exit); the group stays referenced, as
        # a parked generation's
        comm = shorten_timeouts(tp_comm(master, r, generation=3), 5.0)
        KEPT.append(comm)
        stage = build_stage(cfg, 0, pp_rank=0, pp=1, tp_rank=r, tp=TP)
        if r == 1:
            time.sleep(0.3)
            comm.store.set(Keys(3).abort, "rank 1 hung")
            return time.time()
        with pytest.raises(Aborted, match="hung"):
            stage(torch.zeros(2, 4, dtype=torch.long), comm, torch.zeros(2, 4, dtype=torch.long))
        return time.time()

    left, aborted_at = run_threads(rank_fn, TP)
    assert left - aborted_at < 5.0 / 2  # at the abort, not at the group's timeout (5 s)
