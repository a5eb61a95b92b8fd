"""The tensor-parallel side of the corruption check (deadpool/recovery/integrity.py): the norm
weights every tp rank holds whole are compared over tp at each snapshot, judged with the dp
comparison into one report per rank. Ranks here are in-process: each has a real
``ZeroOptimizer`` over a small stage (tp-sharded matrices that differ per tp rank, norms equal on
all), a snapshot engine stand-in whose slots hold real host copies (``StateLayout``), and a
communicator stand-in whose all-reduces the test completes once every rank posted. The
real-process runs are in tests/integration/test_integrity.py."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from deadpool.errors import Aborted
from deadpool.parallel.data.zero import ZeroOptimizer
from deadpool.rank.faults import FaultEvent, FaultInjector
from deadpool.recovery.integrity import (Guard, flip_param_bit, replicated_runs, report_key,
                                         verdict)
from deadpool.snapshot.layout import StateLayout, checksum
from deadpool.store import reports
from deadpool.store.protocol import Seal


class Stage(torch.nn.Module):
    """qkv and ffn are tp-sharded (this tp rank's slice: different bits per tp rank); the norms
    are tp-replicated (the same bits on every rank)."""

    def __init__(self, tp_rank: int):
        super().__init__()
        g = torch.Generator().manual_seed(100 + tp_rank)
        same = torch.Generator().manual_seed(7)
        for name, shape, gen in (("qkv", (4, 4), g), ("attn_norm", (4,), same),
                                 ("ffn", (8, 4), g), ("norm", (4,), same)):
            m = torch.nn.Module()
            m.weight = torch.nn.Parameter(torch.randn(*shape, generator=gen))
            setattr(self, name, m)


class Engine:
    """The snapshot slots of one rank: a real flat host copy per step (``params`` first)."""

    def __init__(self, opt):
        self.tensors = opt.state_tensors()
        self.layout = StateLayout([(n, t) for n, t, _ in self.tensors])
        self.slots = []

    def snapshot(self, step: int) -> None:
        flat = torch.zeros(self.layout.nbytes, dtype=torch.uint8)
        for v, (_, t, _) in zip(self.layout.views(flat), self.tensors):
            v.copy_(t)
        e = self.layout.entries[0]
        done = threading.Event()
        done.set()
        self.slots = [s for s in self.slots if s.step != step][-2:] + [SimpleNamespace(
            step=step, flat=flat, crc=(checksum(flat[e.offset:e.offset + e.nbytes]), 0),
            copied=done)]

    def restore(self, step: int) -> None:
        slot = next(s for s in self.slots if s.step == step)
        for v, (_, t, _) in zip(self.layout.views(slot.flat), self.tensors):
            t.copy_(v)


class World:
    """``dp x tp`` ranks, tp fastest (rank = dp_rank * tp + tp_rank)."""

    def __init__(self, dp: int, tp: int, faults=()):
        self.store, self.seal, self.dp, self.tp = dist.HashStore(), Seal(None), dp, tp
        self.posted: list = []
        self.ranks = []
        for r in range(dp * tp):
            d, t = divmod(r, tp)
            groups = {}
            if dp > 1:
                groups["dp"] = [x * tp + t for x in range(dp)]
            if tp > 1:
                groups["tp"] = [d * tp + x for x in range(tp)]
            stage = Stage(t)
            opt = ZeroOptimizer(list(stage.parameters()), dp_size=dp, dp_rank=d, lr=1e-3,
                                weight_decay=0.0)
            comm = SimpleNamespace(topo=SimpleNamespace(rank=r), group_ranks=groups,
                                   has=groups.__contains__, store=self.store,
                                   # posted; completed once every member posted (``step``)
                                   allreduce=lambda x, g, wait=True, r=r: self.posted.append((r, g, x)),
                                   stream_ordered=False,
                                   raise_if_aborted=self._abort)
            inj = FaultInjector(list(faults), slot=r)
            inj.set_rank(r)
            tr = SimpleNamespace(rank=r, stage=stage, opt=opt, engine=Engine(opt), device="cpu",
                                 generation=0, step=0, progress=SimpleNamespace(set=lambda *a: 0))
            guard = Guard({"ft": {"integrity_check": True}}, inj)
            self.ranks.append(SimpleNamespace(tr=tr, comm=comm, guard=guard, inj=inj))
        self.start(0)

    @staticmethod
    def _abort():
        raise Aborted("the coordinator aborts the generation")

    def start(self, step: int, generation: int = 0) -> None:
        for x in self.ranks:
            if step:
                x.tr.engine.restore(step)
            x.tr.step, x.tr.generation = step, generation
            x.guard.start(x.comm, step)
            x.tr.engine.snapshot(step)
            x.guard.prev = step

    def step(self) -> dict[int, dict]:
        """One step of every rank ending in a snapshot; the reports of this generation."""
        for x in self.ranks:
            x.inj.fire(x.tr.step, "optimizer")
            with torch.no_grad():
                x.tr.opt.flat_params.mul_(1.0625)  # the same update on every rank
            x.guard.post_compare(x.tr, x.comm, True)
        sums: dict = {}
        for r, g, t in self.posted:  # complete the all-reduces every member posted
            key = (g, tuple(self.ranks[r].comm.group_ranks[g]))
            sums[key] = sums.get(key, 0) + t.clone()
        for r, g, t in self.posted:
            t.copy_(sums[(g, tuple(self.ranks[r].comm.group_ranks[g]))])
        self.posted.clear()
        out = {}
        for x in self.ranks:
            x.tr.step += 1
            try:
                x.guard.at_snapshot(x.tr, x.comm)
            except Aborted:
                key = report_key(x.tr.generation, x.tr.rank)
                out[x.tr.rank] = json.loads(reports.read_posted(self.store, self.seal,
                                                                {0: key})[0])
                continue
            x.tr.engine.snapshot(x.tr.step)
        return out


def corrupt(rank: int, step: int, where: str = "tp_replicated") -> dict:
    return {"rank": rank, "step": step, "phase": "optimizer", "kind": "corrupt", "where": where}


def test_the_verdict_joins_dp_and_tp():
    assert verdict({"dp": ([0, 2], [5, 5]), "tp": ([0, 1], [7, 7])}, 4) is None
    # a dp majority alone: resume from the disputed step (the majority's copy)
    assert verdict({"dp": ([0, 2, 4], [5, 6, 5]), "tp": ([2, 3], [7, 7])}, 4)[:2] == ([2], False)
    # a tp majority: named, resumed from the newest agreed snapshot
    culprits, older, why = verdict({"tp": ([0, 1, 2], [7, 7, 8])}, 4)
    assert (culprits, older) == ([2], True) and "tensor-parallel peers [0, 1, 2] differ" in why
    # tp 2: no majority
    culprits, older, why = verdict({"dp": ([1, 3], [5, 5]), "tp": ([2, 3], [7, 8])}, 4)
    assert (culprits, older) == ([], True) and "no majority" in why
    # a rank named by either group is a culprit, one verdict for both
    culprits, older, why = verdict({"dp": ([1, 3, 5], [5, 6, 6]), "tp": ([0, 1], [7, 8])}, 4)
    assert (culprits, older) == ([1], True) and "data-parallel" in why and "tensor-parallel" in why


def test_dp1_tp2_a_flipped_norm_is_disputed_then_the_rank_whose_re_run_differs_names_itself():
    w = World(dp=1, tp=2, faults=[corrupt(1, 1)])
    assert w.step() == {} and w.step() == {}  # 0 -> 1 -> 2 (flipped on rank 1): no false alarm
    got = w.step()  # 3: snapshot 2 compared over tp (there is no dp group)
    assert set(got) == {0, 1}
    for rep in got.values():
        assert rep["culprits"] == [] and rep["cap"] == 1 and rep["step"] == 2
        assert "tensor-parallel peers [0, 1] differ at step 2, no majority" in rep["why"]
    w.start(1, generation=1)  # every rank back at the newest agreed snapshot; the fault is spent
    assert w.step() == {}
    got = w.step()
    assert set(got) == {1} and got[1]["culprits"] == [1] and got[1]["cap"] == 2
    assert "re-run of step 2 differs" in got[1]["why"]


def test_tp3_names_the_rank_off_the_majority_and_resumes_from_the_agreed_snapshot():
    w = World(dp=1, tp=3, faults=[corrupt(2, 0)])
    assert w.step() == {}
    got = w.step()
    assert set(got) == {0, 1, 2}
    assert all(r["culprits"] == [2] and r["cap"] == 0 and r["step"] == 1 for r in got.values())


def test_dp3_tp2_a_norm_flip_is_named_by_dp_and_disputed_by_tp_in_one_report_per_rank():
    w = World(dp=3, tp=2, faults=[corrupt(3, 0)])  # rank 3: dp rank 1, tp rank 1
    assert w.step() == {}
    got = w.step()
    assert set(got) == {1, 2, 3, 5}  # its dp group (1, 3, 5) and its tp group (2, 3)
    assert got[1]["culprits"] == got[5]["culprits"] == [3] and got[1]["cap"] == 1  # dp only
    assert got[2]["culprits"] == [] and got[2]["cap"] == 0  # tp 2: no majority
    both = got[3]
    assert both["culprits"] == [3] and both["cap"] == 0
    assert "data-parallel peers [1, 3, 5]" in both["why"]
    assert "tensor-parallel peers [2, 3]" in both["why"]


def test_a_shard_copy_flip_under_dp2_tp2_is_left_to_dp():
    w = World(dp=2, tp=2, faults=[corrupt(1, 0, where="shard_copy")])
    assert w.step() == {}
    got = w.step()
    assert set(got) == {1, 3}
    assert all("data-parallel peers [1, 3]" in r["why"] and "tensor" not in r["why"]
               for r in got.values())


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_the_tp_replicated_flip_is_one_bit_of_a_norm_outside_the_own_shard(dp_rank):
    stage = Stage(0)
    opt = ZeroOptimizer(list(stage.parameters()), dp_size=2, dp_rank=dp_rank, lr=1e-3,
                        weight_decay=0.0)
    runs = replicated_runs(stage, opt)
    assert runs == [(16, 20), (52, 56)]  # attn_norm after qkv (16), norm after ffn (32)
    before = opt.flat_params.clone()
    flip_param_bit(opt, "tp_replicated", runs)
    diff = (before.view(torch.int32) ^ opt.flat_params.view(torch.int32)).nonzero().flatten()
    assert diff.numel() == 1
    i = int(diff[0])
    lo, hi = opt.shard_range
    assert any(a <= i < b for a, b in runs) and not lo <= i < hi


def test_the_where_of_a_corrupt_fault_is_parsed_and_checked():
    assert FaultEvent.from_cfg(corrupt(0, 1)).where == "tp_replicated"
    assert FaultEvent.from_cfg(dict(corrupt(0, 1), where=None)).where == ""
    with pytest.raises(ValueError):
        FaultEvent.from_cfg(corrupt(0, 1, where="optimizer_state"))
