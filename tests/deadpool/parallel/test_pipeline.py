"""1F1B over tp x pp layouts (ranks as threads) against the single-process model."""

import time

import pytest
import torch

from deadpool.errors import Aborted
from deadpool.model import build_model
from deadpool.parallel.pipeline import run_1f1b
from deadpool.parallel.stage import build_stage
from deadpool.parallel.tensor import shard
from deadpool.rank.comm import Communicator
from deadpool.settings import microbatch_note, num_microbatches
from deadpool.store.protocol import Keys
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads, shorten_timeouts

TINY = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, ffn_mult=2, max_seq_len=8)
SEED = 11

# communicators with an op abandoned in flight, kept referenced (deleting such a group blocks)
KEPT: list = []


def batch(b, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, t), generator=g), torch.randint(0, 64, (b, t), generator=g)


def run_layout(tp, pp, m, b, dp=1, flat_grads=False, model=TINY, activation_checkpointing="none"):
    """Run one step on every rank; return per rank (coords, loss, {name: grad}, phases)."""
    torch.set_num_threads(1)
    dims = ParallelDims(dp, tp, pp, ranks_per_node=dp * tp * pp)
    master = master_store()

    def rank_fn(r):
        comm = Communicator.build(Topology(dims, r, 0), client(master.port), poll_s=0.01)
        c = comm.topo.coords
        stage = build_stage(model, SEED, pp_rank=c["pp"], pp=pp, tp_rank=c["tp"], tp=tp,
                            activation_checkpointing=activation_checkpointing)
        params = list(stage.parameters())
        if flat_grads:  # like ZeRO: .grad are views of one flat buffer, zeroed in place
            flat = torch.zeros(sum(p.numel() for p in params))
            views = flat.split([p.numel() for p in params])
            for p, v in zip(params, views):
                p.grad = v.view_as(p)
            ptrs = [p.grad.data_ptr() for p in params]
        x, y = batch(b, seed=c["dp"])
        phases = []
        loss = run_1f1b(stage, comm, x, y, m, hook=phases.append)
        if flat_grads:
            assert [p.grad.data_ptr() for p in params] == ptrs  # accumulated in place
        return c, loss, {n: p.grad.clone() for n, p in stage.named_parameters()}, phases

    return run_threads(rank_fn, dims.world_size)


def check_against_dense(results, tp, b, cfg=TINY):
    model = build_model(cfg, SEED)
    x, y = batch(b)
    loss = model(x, y)
    loss.backward()
    dense = {n: p.grad for n, p in model.named_parameters()}
    covered = set()
    for c, stage_loss, grads, _ in results:
        if stage_loss is not None:
            assert abs(stage_loss - loss.item()) < 1e-5 * abs(loss.item())
        for name, g in grads.items():
            torch.testing.assert_close(g, shard(name, dense[name], c["tp"], tp, cfg), rtol=1e-4,
                                       atol=1e-7, msg=name)
            covered.add(name)
    assert covered == set(dense)


def test_tp2_pp2_matches_the_single_process_model():
    check_against_dense(run_layout(tp=2, pp=2, m=4, b=8), tp=2, b=8)


def test_gqa_tp2_pp2_with_full_checkpointing_is_bitwise_the_run_without():
    """Grouped-query attention (4 query heads, 2 KV heads: one per TP rank) under 1F1B matches
    the single-process model, and checkpointing every block changes no bit of any gradient
    (the recomputations run inside the schedule's backwards, micro-batch by micro-batch)."""
    gqa = dict(TINY, n_kv_heads=2)
    plain = run_layout(tp=2, pp=2, m=4, b=8, model=gqa)
    check_against_dense(plain, tp=2, b=8, cfg=gqa)
    ckpt = run_layout(tp=2, pp=2, m=4, b=8, model=gqa, activation_checkpointing="full")
    for (c0, l0, g0, _), (c1, l1, g1, _) in zip(plain, ckpt):
        assert c0 == c1 and l0 == l1
        assert all(torch.equal(g0[n], g1[n]) for n in g0), c0


@pytest.mark.parametrize("m", [6, 2])  # more micro-batches than stages, and fewer
def test_pp4_1f1b_matches_the_single_process_model(m):
    results = run_layout(tp=1, pp=4, m=m, b=6 if m == 6 else 4)
    check_against_dense(results, tp=1, b=6 if m == 6 else 4)
    for c, _, _, phases in results:
        warmup = min(4 - c["pp"] - 1, m)
        assert phases == (["pp_warmup"] * warmup + ["forward", "backward"] * (m - warmup)
                          + ["pp_cooldown"] * warmup)


def test_pp1_is_a_micro_batch_loop_accumulating_into_existing_grads():
    results = run_layout(tp=1, pp=1, m=3, b=3, flat_grads=True)
    check_against_dense(results, tp=1, b=3)
    assert results[0][3] == ["forward", "backward"] * 3


def test_pipelines_of_several_data_parallel_ranks_pair_up():
    results = run_layout(tp=1, pp=2, m=2, b=2, dp=2)
    dp0 = [res for res in results if res[0]["dp"] == 0]
    check_against_dense(dp0, tp=1, b=2)
    assert all(res[1] is None for res in results if res[0]["pp"] == 0)


def test_a_stage_waiting_for_a_gradient_leaves_on_abort():
    # pp=2: the last stage never posts its first backward; the abort key releases stage 0
    torch.set_num_threads(1)
    dims = ParallelDims(1, 1, 2, ranks_per_node=2)
    master = master_store()


    class Hung(Exception):
        pass

    def rank_fn(r):
        # the abandoned receive stays in flight until the groups' timeout (5 s once connected,
        # so that the process does not wait for it at exit); the groups stay referenced as a
        # parked generation's do (deleting a group with an op in flight blocks)
        comm = shorten_timeouts(Communicator.build(Topology(dims, r, 5), client(master.port),
                                                   poll_s=0.01), 5.0)
        KEPT.append(comm)
        stage = build_stage(TINY, SEED, pp_rank=r, pp=2, tp_rank=0, tp=1)
        x, y = batch(4)
        if r == 1:
            def hook(phase):
                if phase == "backward":
                    time.sleep(0.3)
                    comm.store.set(Keys(5).abort, "last stage hung")
                    raise Hung(time.time())

            with pytest.raises(Hung) as e:
                run_1f1b(stage, comm, x, y, 4, hook=hook)
            return e.value.args[0]
        with pytest.raises(Aborted, match="hung"):
            run_1f1b(stage, comm, x, y, 4)
        return time.time()

    left, aborted_at = run_threads(rank_fn, 2)
    assert left - aborted_at < 5.0 / 2  # at the abort, not at the groups' timeout (5 s)


@pytest.mark.parametrize("tp,pp,m", [(2, 2, 4), (1, 4, 2)])
def test_forward_only_pass_gives_the_single_process_loss_and_no_gradients(tp, pp, m):
    """``run_forward`` (validation) over tp x pp under no_grad: the model's loss on the last
    stage, nothing on the others, no gradient anywhere."""
    from deadpool.parallel.pipeline.schedule import run_forward

    torch.set_num_threads(1)
    dims = ParallelDims(1, tp, pp, ranks_per_node=tp * pp)
    master = master_store()
    x, y = batch(4)

    def rank_fn(r):
        comm = Communicator.build(Topology(dims, r, 0), client(master.port), poll_s=0.01)
        c = comm.topo.coords
        stage = build_stage(TINY, SEED, pp_rank=c["pp"], pp=pp, tp_rank=c["tp"], tp=tp)
        with torch.no_grad():
            loss = run_forward(stage, comm, x, y, m)
        return c, loss, [p.grad for p in stage.parameters()]

    with torch.no_grad():
        ref = build_model(TINY, SEED)(x, y).item()
    for c, loss, grads in run_threads(rank_fn, dims.world_size):
        assert all(g is None for g in grads)
        if c["pp"] == pp - 1:
            assert abs(loss - ref) < 1e-5 * abs(ref)
        else:
            assert loss is None


@pytest.mark.parametrize("pp,batch,want", [(1, 8, 1), (2, 18, 9), (2, 36, 9), (2, 8, 8),
                                           (4, 64, 32), (4, 27, 27), (8, 512, 64), (3, 7, 7)])
def test_auto_micro_batches_keep_the_1f1b_bubble_within_ten_percent_where_the_batch_allows(
        pp, batch, want):
    """``parallel.microbatches=auto``: the fewest dividing the batch with (pp-1)/(m+pp-1) <=
    0.1 (m >= 9 (pp - 1)), else one sequence per micro-batch; the job prints what it chose."""
    cfg = {"parallel": {"pp": pp, "microbatches": "auto"}, "batch_size": batch}
    m = num_microbatches(cfg)
    assert m == want and batch % m == 0
    if m < batch:
        assert (pp - 1) / (m + pp - 1) <= 0.1 + 1e-12
    assert num_microbatches(dict(cfg, parallel={"pp": pp, "microbatches": None})) == m
    assert num_microbatches(dict(cfg, parallel={"pp": pp, "microbatches": 2})) == 2
    note = microbatch_note(cfg)
    assert (note is None) == (pp == 1)
    if note:
        assert f"{m} per step at pp {pp}" in note and ("over 10%" in note) == (m < 9 * (pp - 1))
