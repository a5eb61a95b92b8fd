"""ZeRO-1 optimizer: exact AdamW equivalence, state layout, rollback, abort, gradient accumulation.

Gradients are small multiples of 1/16, so their sum over ranks is exact in any order: the
sharded result must then be bit-identical to one process running torch's AdamW on the mean."""

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deadpool.errors import Aborted
from deadpool.parallel.data import ZeroOptimizer, state_nbytes
from deadpool.rank.comm import Communicator
from deadpool.store.protocol import Keys
from deadpool.topology import ParallelDims, Topology
from tests.deadpool.helpers import client, master_store, run_threads

SHAPES = [(3, 5), (7,), (2, 3, 2), (1,)]  # 35 elements: padded to 36 for dp 2 and 3
HP = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
STEPS = 4


def make_params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(-64, 64, s, generator=g).float() / 16 for s in SHAPES]


def reference(n: int, steps: int = STEPS, adamw: str = "fused"):
    """One process, torch.optim.AdamW on the mean gradient, one tensor per parameter."""
    params = make_params()
    impl = dict(fused=True) if adamw == "fused" else dict(foreach=adamw == "foreach")
    opt = torch.optim.AdamW(params, **impl, **HP)
    for s in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.stack([grads(r, s)[i] for r in range(n)]).sum(0) / n
        opt.step()
    return params, opt


def build(n: int, r: int, port: int, generation: int = 0, **kw):
    return Communicator.build(Topology(ParallelDims(dp=n, ranks_per_node=n), r, generation),
                              client(port), **kw)


def train_step(opt, params, comm, r, s, posted=None):
    opt.zero_grad()
    for p, g in zip(params, grads(r, s)):
        p.grad.add_(g)  # accumulate into the view, as autograd does
    opt.reduce_grads(comm, on_posted=posted)
    opt.step(comm)


@pytest.mark.parametrize("n,shard,adamw,bucket", [(2, True, "fused", 1 << 20),
                                                   (3, True, "fused", 20), (3, True, "for_loop", 1 << 20),
                                                   (3, False, "foreach", 20)])
def test_matches_single_process_adamw_and_state_layout(n, shard, adamw, bucket):
    """Grouping elements into one flat tensor, buckets (``bucket`` bytes: one bucket per shard, or
    many small ones crossing parameters) and shards changes no bit with the for-loop and foreach
    kernels. The fused CPU kernel rounds an element differently in its vector body and its scalar
    tail, so where an element falls in its tensor matters: equal to rounding there."""
    master = master_store()

    def rank_fn(r):
        comm = build(n, r, master.port)
        params = make_params()
        opt = ZeroOptimizer(params, dp_size=n, dp_rank=r, shard=shard, adamw=adamw,
                            bucket_bytes=bucket, first_bucket_bytes=bucket, **HP)
        posted = []
        for s in range(STEPS):
            train_step(opt, params, comm, r, s, posted=lambda: posted.append(1))
        assert len(posted) == STEPS
        return [p.detach().clone() for p in params], opt

    results = run_threads(rank_fn, n)
    ref_params, ref_opt = reference(n, adamw=adamw)
    same = torch.equal if adamw != "fused" else (
        lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-7))
    for params, opt in results:
        assert opt.numel == 35 and opt.padded_numel == 36 and opt.shard_numel == 36 // n
        for p, q in zip(params, ref_params):
            assert same(p, q)
        assert torch.all(opt.flat_params[opt.numel:] == 0)  # padding stays zero
        # gloo: each bucket reached its owner by all-to-all (an inbox per owned bucket)
        assert sorted(opt._inbox) == sorted(lo for lo, _ in opt._owned) and bool(opt._owned) == shard
        assert sum(t.numel() for t in opt._inbox.values()) == (opt.padded_numel if shard else 0)

    # state: shared tensors identical on every rank; unique shards tile the reference state
    states = [opt.state_tensors() for _, opt in results]
    assert [(name, sh) for name, _, sh in states[0]] == [("params", True)] + (
        [("master", False)] if shard else []) + [
        ("exp_avg", not shard), ("exp_avg_sq", not shard), ("step", not shard)]
    if shard:  # the fp32 master shard is the owned slice of the parameters, not a copy
        opt = results[0][1]
        assert states[0][1][1].data_ptr() == opt.flat_params[slice(*opt.shard_range)].data_ptr()
    for i, (name, t0, shared) in enumerate(states[0]):
        others = [st[i][1] for st in states[1:]]
        if shared:
            assert all(torch.equal(t0, t) for t in others), name
        elif name != "step":
            assert all(not torch.equal(t0, t) for t in others), name
    for name in ("exp_avg", "exp_avg_sq"):
        want = torch.cat([ref_opt.state[p][name].reshape(-1) for p in ref_params])
        i = [s[0] for s in states[0]].index(name)
        got = states[0][i][1] if not shard else torch.cat([st[i][1] for st in states])
        assert same(got[:35], want), name
    for st in states:
        assert st[-1][1].item() == STEPS == ref_opt.state[ref_params[0]]["step"].item()
    nbytes = results[0][1].state_nbytes()
    assert nbytes == state_nbytes(35, n, shard)
    assert nbytes["shared"] == 36 * 4 * (1 if shard else 3) + (0 if shard else 4)


def test_rollback_in_place_gives_the_same_result():
    n = 2
    master = master_store()

    def rank_fn(r):
        comm = build(n, r, master.port)
        runs = []
        for detour in (False, True):
            params = make_params()
            opt = ZeroOptimizer(params, dp_size=n, dp_rank=r, **HP)
            objects = [t for _, t, _ in opt.state_tensors()]
            for s in range(STEPS):
                if detour and s == 2:
                    saved = [t.clone() for t in objects]
                    train_step(opt, params, comm, r, s + 17)  # a step that is then rolled back
                    for t, v in zip(objects, saved):
                        t.copy_(v)
                train_step(opt, params, comm, r, s)
                assert all(a is b for a, (_, b, _) in zip(objects, opt.state_tensors()))
            runs.append([t.clone() for t in objects])
        return runs

    for plain, detoured in run_threads(rank_fn, n):
        assert all(torch.equal(a, b) for a, b in zip(plain, detoured))


@pytest.mark.parametrize("where", ["reduce_grads", "step"])
def test_survivors_leave_promptly_when_a_peer_never_posts(where):
    n, gen = 3, 5
    master = master_store()
    left_after = {}

    def rank_fn(r):
        store = client(master.port)
        comm = build(n, r, master.port, generation=gen, poll_s=0.01)
        params = make_params()
        opt = ZeroOptimizer(params, dp_size=n, dp_rank=r, **HP)
        if where == "step":
            opt.reduce_grads(comm)
        if r == 2:  # hangs before the collective; the coordinator then aborts the generation
            time.sleep(0.3)
            store.set(Keys(gen).abort, "rank 2 hung")
            t_abort = time.time()
            time.sleep(1.0)
            return t_abort
        with pytest.raises(Aborted, match="hung"):
            getattr(opt, where)(comm)
        left_after[r] = time.time()
        return comm  # keep the group referenced: an op is still in flight on it

    res = run_threads(rank_fn, n)
    for r in (0, 1):  # left at the abort, not at the group's timeout (120 s)
        assert left_after[r] - res[2] < 120 / 4


def test_grads_accumulate_into_the_flat_buffer_and_dp1_matches_adamw():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    ref.load_state_dict(model.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    opt = ZeroOptimizer(list(model.parameters()), dp_size=3, dp_rank=1, **HP)
    assert (opt.numel, opt.padded_numel, opt.shard_range) == (26, 27, (9, 18))
    for p, b in zip(model.parameters(), before):  # moved into the flat buffer, values unchanged
        assert torch.equal(p, b)
        assert p.untyped_storage().data_ptr() == opt.flat_params.untyped_storage().data_ptr()
    grad_objects = [p.grad for p in model.parameters()]
    xs = [torch.randn(4, 5) for _ in range(2)]
    for x in xs:  # two micro-batches, two backward passes
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert torch.equal(opt.flat_grads[:26], want) and opt.flat_grads[26] == 0
    opt.zero_grad()
    assert torch.all(opt.flat_grads == 0)
    for p, g in zip(model.parameters(), grad_objects):
        assert p.grad is g
        assert p.grad.untyped_storage().data_ptr() == opt.flat_grads.untyped_storage().data_ptr()

    # dp = 1: no dp group; reduce_grads is a no-op (the hook still fires), step is plain AdamW
    master = master_store()  # kept referenced: the client connects to it
    comm = Communicator.build(Topology(ParallelDims(dp=1), 0, 0), client(master.port))
    params = make_params()
    opt = ZeroOptimizer(params, dp_size=1, dp_rank=0, shard=False, adamw="for_loop", **HP)
    posted = []
    for s in range(STEPS):
        train_step(opt, params, comm, 0, s, posted=lambda: posted.append(1))
    assert len(posted) == STEPS
    for p, q in zip(params, reference(1, adamw="for_loop")[0]):
        assert torch.equal(p, q)


def test_gloo_reduce_scatter_ignores_the_wait_timeout():
    """Why gradients go to their owner by ``reduce`` or all-to-all (parallel/data/zero.py): a polled wait on
    gloo's reduce-scatter blocks until the op ends (here: until the silent peer's group is gone),
    while a reduce's, an all-to-all's, an all-gather's or a broadcast's polled wait returns after
    the slice. If this starts failing,
    torch made gloo's reduce-scatter pollable. Ordered by events, not by elapsed time: the peer
    stays silent until the first two waits have returned (or 60 s), then leaves."""
    master = master_store()
    polled, left = threading.Event(), {}

    def rank_fn(r):
        comm = build(2, r, master.port)
        pg = comm.groups["dp"]
        if r == 1:
            polled.wait(60)  # never posts; its group is released when the thread ends
            time.sleep(0.2)
            left["t"] = time.monotonic()
            return None
        ended = {}
        opts = dist.ReduceOptions()
        opts.rootRank = 1
        bopts = dist.BroadcastOptions()
        bopts.rootRank = 1
        for name, post in [("all_gather", lambda: pg._allgather_base(torch.ones(8), torch.ones(4))),
                           ("reduce", lambda: pg.reduce([torch.ones(8)], opts)),
                           ("broadcast", lambda: pg.broadcast([torch.ones(8)], bopts)),
                           ("to_owner", lambda: pg.alltoall_base(  # a bucket to owner 1 (gloo)
                               torch.ones(0), torch.ones(4), [0, 0], [0, 4],
                               dist.AllToAllOptions())),
                           ("reduce_scatter",
                            lambda: pg._reduce_scatter_base(torch.ones(4), torch.ones(8)))]:
            if name == "reduce_scatter":
                polled.set()
            work = post()
            with pytest.raises(RuntimeError):
                work.wait(timedelta(seconds=0.01))
            ended[name] = time.monotonic()
        return ended

    ended = run_threads(rank_fn, 2)[0]
    assert ended["all_gather"] < left["t"] and ended["reduce"] < left["t"]
    assert ended["broadcast"] < left["t"]  # the overlapped parameter gather's op
    assert ended["to_owner"] < left["t"]  # the gradient buckets' op on gloo
    assert ended["reduce_scatter"] >= left["t"]


def test_buckets_are_reduced_during_the_last_backward_with_the_same_result():
    """Armed buckets are posted from autograd hooks during the last micro-batch's backward (none
    after the first), in the same order on every rank, and give the same bits as reducing
    everything after backward."""
    n, m = 2, 2
    master = master_store()

    def model():  # same values on every rank (threads: no global RNG)
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 4))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        return net

    def rank_fn(r):
        comm = build(n, r, master.port)
        out = []
        for armed in (True, False):
            net = model()
            opt = ZeroOptimizer(list(net.parameters()), dp_size=n, dp_rank=r, bucket_bytes=32,
                                first_bucket_bytes=16, **HP)
            g = torch.Generator().manual_seed(r)
            for _ in range(3):
                if armed:
                    opt.begin_step(comm, m)
                else:
                    opt.zero_grad()
                for i in range(m):
                    net(torch.randn(4, 6, generator=g)).square().mean().backward()
                    if armed and i == 0:
                        assert opt.buckets.works == []
                if armed:
                    assert opt.buckets.posted_in_backward == len(opt.buckets.edges) > 3
                opt.reduce_grads(comm)
                opt.step(comm)
            out.append(opt.flat_params.clone())
        return out

    for armed, plain in run_threads(rank_fn, n):
        assert torch.equal(armed, plain)


def test_bucket_edges_cover_the_buffer_from_the_end_and_respect_cuts():
    from deadpool.parallel.data.buckets import bucket_edges
    edges = bucket_edges(100, 4, bucket_bytes=120, first_bucket_bytes=40, cuts=[50])
    assert edges == [(90, 100), (60, 90), (50, 60), (20, 50), (0, 20)]
    assert bucket_edges(7, 4, 1 << 20, 1 << 20, []) == [(0, 7)]


# -- decay groups and bf16 mixed precision ------------------------------------------------------
def matrices(p):
    return p.ndim >= 2


def lr_of(s):
    return 1e-2 * (s + 1) / STEPS  # a rate that changes every step, as a schedule's does


def reference_groups(n, dtype=torch.float32):
    """torch's for-loop AdamW with a decayed and an undecayed group, on fp32 copies of the
    (possibly bf16-rounded) initial parameters, fed the mean gradient; lr set per step."""
    params = [torch.nn.Parameter(p.detach().to(dtype).float()) for p in make_params()]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if matrices(p)]},
         {"params": [p for p in params if not matrices(p)], "weight_decay": 0.0}],
        foreach=False, **HP)
    for s in range(STEPS):
        for i, p in enumerate(params):
            p.grad = torch.stack([grads(r, s)[i] for r in range(n)]).sum(0) / n
        for g in opt.param_groups:
            g["lr"] = lr_of(s)
        opt.step()
    return params, opt


def run_zero(n, dtype, **kw):
    master = master_store()

    def rank_fn(r):
        comm = build(n, r, master.port)
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in make_params()]
        opt = ZeroOptimizer(params, dp_size=n, dp_rank=r, adamw="for_loop", decays=matrices,
                            **kw, **HP)
        gathered = []
        for s in range(STEPS):
            opt.zero_grad()
            for p, g in zip(params, grads(r, s)):
                p.grad.add_(g.to(dtype))  # exact: small multiples of 1/16
            opt.reduce_grads(comm)
            opt.step(comm, lr=lr_of(s))
            gathered.append((opt.flat_params.clone(), opt.master.clone()))
        return opt, gathered

    return run_threads(rank_fn, n)


@pytest.mark.parametrize("n,shard", [(3, True), (2, False)])
def test_decay_groups_over_the_flat_shard_equal_torch_adamw_with_two_groups(n, shard):
    """Norm-like (1-D) parameters undecayed, matrices decayed, the rate changing per step: the
    flat, sharded optimizer gives torch's two-group AdamW bit for bit (for-loop kernel)."""
    ref, _ = reference_groups(n)
    want = torch.cat([p.detach().reshape(-1) for p in ref])
    for opt, _ in run_zero(n, torch.float32, shard=shard):
        assert torch.equal(opt.flat_params[:35], want)
    # the decay is real: without it the matrices end elsewhere
    assert not torch.equal(want, torch.cat([p.detach().reshape(-1) for p in reference(n, adamw="for_loop")[0]]))


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_bf16_parameters_are_the_rounding_of_fp32_master_shards(reduce_dtype):
    """bf16 + ZeRO: each rank keeps an fp32 master shard and fp32 moments (unique state), the
    bf16 parameters (shared) are after every step exactly the bf16 rounding of the concatenated
    updated master shards, the masters equal fp32 AdamW from the bf16-rounded initial values,
    and a second run repeats every bit."""
    n = 3
    runs = [run_zero(n, torch.bfloat16, grad_reduce_dtype=reduce_dtype) for _ in range(2)]
    ref, ref_opt = reference_groups(n, torch.bfloat16)
    results = runs[0]
    for s in range(STEPS):
        masters = torch.cat([g[s][1] for _, g in results])
        for _, g in results:
            assert g[s][0].dtype == torch.bfloat16 and g[s][1].dtype == torch.float32
            assert torch.equal(g[s][0], masters.to(torch.bfloat16))
    masters = torch.cat([opt.master for opt, _ in results])[:35]
    # mean gradients are exact in either reduction dtype here, so the masters are torch's bits
    assert torch.equal(masters, torch.cat([p.detach().reshape(-1) for p in ref]))
    for name in ("exp_avg", "exp_avg_sq"):
        got = torch.cat([dict((k, t) for k, t, _ in opt.state_tensors())[name] for opt, _ in results])
        assert torch.equal(got[:35], torch.cat([ref_opt.state[p][name].reshape(-1) for p in ref]))
    for (a, ga), (b, gb) in zip(*runs):  # bitwise reproducible run to run
        assert all(torch.equal(x, y) for (x, _), (y, _) in zip(ga, gb))
        assert all(torch.equal(x, y) for (_, x, _), (_, y, _) in zip(a.state_tensors(), b.state_tensors()))
    opt = results[0][0]
    layout = [(name, t.dtype, sh) for name, t, sh in opt.state_tensors()]
    assert layout == [("params", torch.bfloat16, True), ("master", torch.float32, False),
                      ("exp_avg", torch.float32, False), ("exp_avg_sq", torch.float32, False),
                      ("step", torch.float32, False)]
    assert opt.state_nbytes() == state_nbytes(35, n, True, precision="bf16") == {
        "shared": 36 * 2, "unique": 3 * 12 * 4 + 4}


def test_bf16_unsharded_master_is_shared_and_sized_like_the_estimate():
    (opt, _), _ = run_zero(2, torch.bfloat16, shard=False)
    assert [(name, sh) for name, _, sh in opt.state_tensors()] == [
        ("params", True), ("master", True), ("exp_avg", True), ("exp_avg_sq", True), ("step", True)]
    assert opt.state_nbytes() == state_nbytes(35, 2, False, precision="bf16")
    assert all(a is b for (_, a, _), (_, b, _) in zip(opt.state_tensors(), opt.state_tensors()))
    assert state_nbytes(35, 2, True) == state_nbytes(35, 2, True, precision="fp32")


def test_bf16_micro_batch_gradients_accumulate_in_fp32():
    """With fp32 reduction, autograd's bf16 gradient of each micro-batch is folded into the fp32
    buffer as soon as it lands: the step sees the fp32 sum of the bf16 micro-batch gradients,
    not their bf16 running sum."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4)).to(torch.bfloat16)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4)).to(torch.bfloat16)
    ref.load_state_dict(net.state_dict())
    opt = ZeroOptimizer(list(net.parameters()), dp_size=1, dp_rank=0, shard=False, **HP)
    xs = [torch.randn(8, 16, dtype=torch.bfloat16) for _ in range(4)]
    want = torch.zeros(opt.numel)
    for x in xs:
        net(x).square().sum().backward()
        ref.zero_grad()
        ref(x).square().sum().backward()
        want += torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).float()
    assert torch.equal(opt.main_grads[:opt.numel], want)
    assert torch.all(opt.flat_grads == 0)  # each micro-batch's bf16 gradient moved out


def test_a_single_rank_standing_in_for_several_divides_by_the_global_batch():
    """An elastic job shrunk to dp=1 computes the batches of every original replica
    (``grad_div`` = the original width): its gradient is their mean, as at full width, also
    without a data-parallel group to reduce over (a clipped norm would otherwise double)."""
    master = master_store()  # kept referenced: the client connects to it
    comm = Communicator.build(Topology(ParallelDims(dp=1), 0, 0), client(master.port))
    params = make_params()
    opt = ZeroOptimizer(params, dp_size=1, dp_rank=0, shard=False, adamw="for_loop", **HP)
    opt.grad_div = 2
    opt.zero_grad()
    for p, a, b in zip(params, grads(0, 0), grads(1, 0)):
        p.grad.add_(a + b)
    opt.reduce_grads(comm)
    want = torch.cat([(a + b).reshape(-1) / 2 for a, b in zip(grads(0, 0), grads(1, 0))])
    assert torch.equal(opt.grad_shard[:35], want)
