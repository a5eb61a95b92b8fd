"""Interleaved 1F1B (``parallel.virtual_stages``): its order, its groups, its arithmetic.

The schedule is checked three ways: a simulation of every rank's op order (each receive waits
for its sender's op, each group delivers in send order) that must run to the end without a
cycle; ranks as threads, whose losses and gradients must be bitwise those of plain 1F1B on the
same micro-batches (same blocks in the same order per micro-batch, gradients accumulated in
micro-batch order); and the layout plumbing (chunks, wrap-around groups, checkpoints re-laid out
between v = 2 and v = 1).
"""

from __future__ import annotations

import pytest
import torch

from deadpool.parallel.pipeline.interleaved import order
from deadpool.parallel.pipeline.schedule import run_1f1b, run_forward
from deadpool.parallel.stage import build_stage
from deadpool.rank.comm import Communicator
from deadpool.rank.groups import all_groups, rank_groups
from deadpool.settings import microbatch_note, num_microbatches
from deadpool.topology import ParallelDims, Topology, layer_chunks
from tests.deadpool.helpers import client, master_store, run_threads
from tests.deadpool.parallel.test_pipeline import TINY, batch

SEED = 11


def simulate(pp: int, v: int, m: int) -> list[list[tuple]]:
    """Run every rank's ``order`` against the others: a receive blocks until its message was
    sent, and must find at the head of its group the (chunk, micro-batch) it expects. Returns
    each rank's executed ops; raises on a deadlock or an out-of-order delivery."""
    ops = [order(pp, v, m, s) for s in range(pp)]
    pos = [0] * pp
    chan: dict[tuple, list] = {}  # (direction, from rank, to rank) -> messages in flight

    def virt(s, c):
        return c * pp + s

    def rank_of(vs):  # virtual stage -> (rank, chunk)
        return vs % pp, vs // pp

    done = [[] for _ in range(pp)]
    while any(pos[s] < len(ops[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            while pos[s] < len(ops[s]):
                _, kind, c, i = ops[s][pos[s]]
                vs = virt(s, c)
                if kind == "F" and vs > 0:  # receive the activation of vs - 1
                    src = rank_of(vs - 1)[0]
                    q = chan.get(("F", src, s), [])
                    if not q:
                        break
                    assert q.pop(0) == (vs - 1, i), ("out of order", s, ops[s][pos[s]])
                if kind == "B":
                    assert ("F", c, i) in {(k, cc, ii) for _, k, cc, ii in done[s]}
                    if vs < pp * v - 1:  # receive the gradient of vs + 1
                        src = rank_of(vs + 1)[0]
                        q = chan.get(("B", src, s), [])
                        if not q:
                            break
                        assert q.pop(0) == (vs + 1, i), ("out of order", s, ops[s][pos[s]])
                if kind == "F" and vs < pp * v - 1:
                    chan.setdefault(("F", s, rank_of(vs + 1)[0]), []).append((vs, i))
                if kind == "B" and vs > 0:
                    chan.setdefault(("B", s, rank_of(vs - 1)[0]), []).append((vs, i))
                done[s].append(ops[s][pos[s]])
                pos[s] += 1
                moved = True
        if not moved:
            raise AssertionError(f"deadlock at pp {pp} v {v} m {m}: {pos}")
    assert all(not q for q in chan.values())
    return done


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_every_rank_runs_each_micro_batch_through_each_chunk_without_deadlock(pp, v, groups):
    m = groups * pp
    for s, ops in enumerate(simulate(pp, v, m)):
        assert sorted((k, c, i) for _, k, c, i in ops) == sorted(
            (k, c, i) for k in "FB" for c in range(v) for i in range(m))
        warm = min((pp - s - 1) * 2 + (v - 1) * pp, v * m)
        steady = ["forward", "backward"] * (v * m - warm)
        assert [p for p, *_ in ops] == ["pp_warmup"] * warm + steady + ["pp_cooldown"] * warm
        for c in range(v):  # a chunk's backwards in micro-batch order (1F1B's accumulation order)
            assert [i for _, k, cc, i in ops if k == "B" and cc == c] == list(range(m))


def test_m_not_a_multiple_of_pp_is_refused():
    with pytest.raises(ValueError, match="multiple of pp"):
        order(2, 2, 3, 0)


def test_chunks_follow_megatron_and_the_wrap_groups_pair_last_with_first():
    assert layer_chunks(8, 2, 0, 2) == [range(0, 2), range(4, 6)]
    assert layer_chunks(8, 2, 1, 2) == [range(2, 4), range(6, 8)]
    assert layer_chunks(5, 2, 0) == [range(0, 3)]  # v = 1: today's uneven split
    with pytest.raises(ValueError, match="divisible by parallel.pp"):
        layer_chunks(6, 2, 0, 2)
    for v in (1, 2):
        dims = ParallelDims(2, 1, 3, ranks_per_node=6, virtual_stages=v)
        every = all_groups(dims, "ring_over_nodes")
        mine = {}
        for r in range(dims.world_size):
            for name, key, ranks, repl in rank_groups(Topology(dims, r, 0)):
                if not repl:
                    assert every[key] == ranks
                    mine.setdefault(name, set()).add(key)
        wraps = {k: rs for k, rs in every.items() if k.startswith("ppw")}
        if v == 1:
            assert not wraps and not any("wrap" in n for n in mine)
        else:  # last stage (ranks 4, 5) -> first (0, 1), one pair per data-parallel rank
            assert wraps == {"ppwf/4-0": [4, 0], "ppwb/0-4": [0, 4],
                             "ppwf/5-1": [5, 1], "ppwb/1-5": [1, 5]}
            assert mine["pp_send_wrap_fwd"] == {"ppwf/4-0", "ppwf/5-1"}
            assert mine["pp_recv_wrap_fwd"] == {"ppwf/4-0", "ppwf/5-1"}


def run_layout(tp, pp, v, m, b, forward_only=False):
    """One step on every rank (threads); per rank (coords, loss, {name: grad})."""
    torch.set_num_threads(1)
    dims = ParallelDims(1, tp, pp, ranks_per_node=tp * pp, virtual_stages=v)
    master = master_store()
    model = dict(TINY, n_layers=8)

    def rank_fn(r):
        comm = Communicator.build(Topology(dims, r, 0), client(master.port), poll_s=0.01)
        c = comm.topo.coords
        stage = build_stage(model, SEED, pp_rank=c["pp"], pp=pp, tp_rank=c["tp"], tp=tp,
                            virtual_stages=v)
        x, y = batch(b)
        if forward_only:
            with torch.no_grad():
                return c, run_forward(stage, comm, x, y, m), {}
        loss = run_1f1b(stage, comm, x, y, m)
        return c, loss, {n: p.grad.clone() for n, p in stage.named_parameters()}

    return run_threads(rank_fn, dims.world_size)


@pytest.mark.parametrize("tp,pp,v,m", [(1, 2, 2, 4), (2, 2, 2, 2), (1, 2, 4, 4), (1, 4, 2, 4)])
def test_interleaved_losses_and_gradients_are_bitwise_1f1b(tp, pp, v, m):
    """Each rank holds other layers than under 1F1B, so gradients are compared by (tp rank,
    parameter name) over the whole pipeline, and the last stage's loss by value."""
    def by_name(results):
        grads = {(c["tp"], n): g for c, _, gs in results for n, g in gs.items()}
        losses = {c["tp"]: loss for c, loss, _ in results if loss is not None}
        return grads, losses

    plain_grads, plain_losses = by_name(run_layout(tp, pp, 1, m, 8))
    grads, losses = by_name(run_layout(tp, pp, v, m, 8))
    assert grads.keys() == plain_grads.keys()
    assert losses.keys() == plain_losses.keys() == set(range(tp))
    assert all(torch.equal(losses[k], plain_losses[k]) for k in losses)
    assert all(torch.equal(grads[k], plain_grads[k]) for k in grads)
    evals = {c["tp"]: loss for c, loss, _ in run_layout(tp, pp, v, m, 8, forward_only=True)
             if loss is not None}
    assert evals == {k: loss.item() for k, loss in plain_losses.items()}


def test_settings_refuse_what_interleaving_cannot_run_and_print_the_bubble():
    def cfg(pp=2, v=2, mb="auto", batch=8, n_layers=4):
        return {"parallel": {"pp": pp, "virtual_stages": v, "microbatches": mb},
                "batch_size": batch, "model": {"n_layers": n_layers}}

    with pytest.raises(ValueError, match="not divisible by pp \\* virtual_stages = 4"):
        num_microbatches(cfg(n_layers=6))
    with pytest.raises(ValueError, match="must be a multiple of pp=2"):
        num_microbatches(cfg(mb=3, batch=6))
    with pytest.raises(ValueError, match="needs parallel.pp >= 2"):
        num_microbatches(cfg(pp=1))
    with pytest.raises(ValueError, match="needs parallel.pp >= 2"):
        ParallelDims(2, 1, 1, virtual_stages=2)
    # auto: the fewest multiples of pp dividing the batch with (pp-1)/(v m + pp-1) <= 10 %
    # (v m >= 9 (pp - 1)), else the largest such divisor
    assert num_microbatches(cfg(batch=8)) == 8     # m >= 4.5: 2 and 4 too few
    assert num_microbatches(cfg(batch=12)) == 6    # 2 * 6 = 12 >= 9; 4 gives 8 < 9
    assert num_microbatches(cfg(pp=4, v=3, batch=16, n_layers=12)) == 16  # m >= 9: 4, 8 too few
    assert num_microbatches(cfg(pp=4, v=4, batch=16, n_layers=16)) == 8   # 4 * 8 = 32 >= 27
    assert num_microbatches(cfg(batch=4, n_layers=4)) == 4  # none reaches it: the largest
    with pytest.raises(ValueError, match="no micro-batch count divides batch_size=3"):
        num_microbatches(cfg(batch=3))
    note = microbatch_note(cfg(batch=12))
    assert "interleaved 1F1B over 2 virtual stages" in note and "bubble 7.7%" in note
    assert "(pp-1)/(v m) = 8.3%" in note
    assert num_microbatches(cfg(v=1, batch=18)) == 9  # v = 1: unchanged
    assert "virtual" not in microbatch_note(cfg(v=1, batch=18))


def test_a_checkpoint_written_interleaved_resumes_at_another_v_and_pp(tmp_path):
    """Written at dp2 x pp2 with v = 2 (rank pp 0 holds layers 0 and 2), re-laid out for v = 1
    (layers 0 and 1: same sizes, other tensors, so reading the files as they are would be
    silently wrong) and for pp 4, each rank gets what that layout would have written; and the
    other way round. The reference cuts the whole tensors itself (``_rank_state``)."""
    from deadpool import checkpoint
    from deadpool.checkpoint.relayout import relayout_state, stage_params
    from deadpool.checkpoint.unique import unique_part
    from deadpool.parallel.tensor.layers import shard
    from tests.deadpool.checkpoint.test_relayout import MODEL, _full

    def rank_state(full, dims, rank):
        c = dims.coords(rank)
        names = [n for n, _ in stage_params(MODEL, c["pp"], dims.pp, c["tp"], dims.tp,
                                            dims.virtual_stages)]
        out = {}
        for kind, by_name in full.items():
            flat = torch.cat([shard(n, by_name[n], c["tp"], dims.tp, model_cfg=MODEL).reshape(-1)
                              for n in names])
            padded = torch.zeros(-(-flat.numel() // dims.dp) * dims.dp, dtype=flat.dtype)
            padded[:flat.numel()] = flat
            n = padded.numel() // dims.dp
            out[kind] = padded if kind == "params" else padded[c["dp"] * n:(c["dp"] + 1) * n]
        out["step"] = torch.tensor(7.0)
        return out

    full = _full(False)
    v2 = ParallelDims(2, 1, 2, ranks_per_node=1, virtual_stages=2)
    for old, new in [(v2, ParallelDims(2, 1, 2, ranks_per_node=1)),
                     (v2, ParallelDims(1, 1, 4, ranks_per_node=1)),
                     (ParallelDims(2, 1, 2, ranks_per_node=1), v2)]:
        root = tmp_path / f"{old.layout}".replace(" ", "")
        for r in range(old.world_size):
            st, hdr = unique_part(rank_state(full, old, r), {"step": 5}, ("params",), old.layout, r)
            checkpoint.save_rank_state(root, 5, r, st, hdr, layout=old.layout,
                                       world_size=old.world_size)
        checkpoint.write_meta(root, 5, old.world_size, "periodic", layout=old.layout)
        assert checkpoint.read_meta(root / "step_5")["layout"] == old.layout
        assert ParallelDims.from_layout(old.layout) == ParallelDims(
            old.dp, old.tp, old.pp, ranks_per_node=old.tp, virtual_stages=old.virtual_stages)
        for r in range(new.world_size):
            got = relayout_state(root / "step_5", old, new, r, MODEL, shard_optimizer=True)
            want = rank_state(full, new, r)
            n = want["params"].numel() // new.dp  # an fp32 ZeRO-1 rank's master: its slice
            want["master"] = want["params"][new.coords(r)["dp"] * n:][:n]
            for k in want:
                assert torch.equal(got[k], want[k]), (old.layout, new.layout, r, k)


@pytest.mark.parametrize("pp,v,m", [(4, 2, 8), (2, 2, 4), (4, 3, 12), (2, 4, 2)])
def test_memory_counts_the_chunks_the_schedule_holds_at_its_peak(pp, v, m):
    """Rank s holds Megatron's warm-up + 1 chunk-sized micro-batches at its peak (capped at all
    v m of them), against 1F1B's pp - s stage-sized ones: rank 0's activations grow by about
    (pp - 1) / (v pp), and the memory estimate follows."""
    from deadpool.launch.memory import stage_activations
    from deadpool.parallel.pipeline.interleaved import in_flight

    for s in range(pp):
        live = in_flight(pp, v, m, s)
        assert sum(live) == min((pp - s - 1) * 2 + (v - 1) * pp + 1, v * m), (s, live)
    model = dict(TINY, n_layers=pp * v * 2)
    kw = dict(micro_bs=1, seq_len=8, microbatches=m, act_bytes=4)
    plain = stage_activations(model, 1, pp, 0, **kw)
    inter = stage_activations(model, 1, pp, 0, **kw, virtual_stages=v)
    assert inter != plain
    if m >= 2 * pp:  # a full warm-up: more than 1F1B's pp micro-batches of the whole stage
        assert inter > plain
