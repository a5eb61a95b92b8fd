"""Run outputs (deadpool/launch/report.py): the bitwise comparison of two runs' final states.

A run's final state is one checkpoint of unique state (``checkpoint.final``): what several
data-parallel replicas hold identically is written once, in parts spread over them, and every
rank's header carries the digest of its whole state. ``compare_final_states`` compares every
tensor written (``torch.equal``) and every rank's digest, so a replica whose unwritten copy
differs is still caught."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from deadpool import checkpoint
from deadpool.checkpoint.final import write_final_state
from deadpool.launch.report import compare_final_states, final_ranks, load_final_rank
from deadpool.topology import ParallelDims

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in state.values():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write(run, ranks: dict[int, dict[str, torch.Tensor]], dp: int = 1, step: int = 5):
    """``ranks``' final states as the job's end writes them (at dp ``dp``, ``params`` shared)."""
    dims = ParallelDims(dp, len(ranks) // dp, 1, ranks_per_node=len(ranks) // dp)
    for r, state in ranks.items():
        write_final_state(run / "final", step, r, state, {"step": step, "digest": digest(state)},
                          shared_names=["params"], layout=dims.layout,
                          world_size=len(ranks), on_progress=lambda: None)
    return run


def state(seed: int, params_seed: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed if params_seed is None else params_seed)
    params = torch.randn(6, generator=g)
    g = torch.Generator().manual_seed(seed + 100)
    return {"params": params, "exp_avg": torch.randn(6, generator=g)}


def test_equal_runs_compare_equal(tmp_path):
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    b = write(tmp_path / "b", {0: state(0), 1: state(1)})
    assert compare_final_states(a, b) == (True, "2 ranks, every parameter and optimizer tensor "
                                                "written bitwise equal, and every rank's "
                                                "whole-state digest")
    assert final_ranks(a) == [0, 1]
    assert all(torch.equal(load_final_rank(a, 1)[k], state(1)[k]) for k in state(1))


def test_one_ulp_in_one_optimizer_tensor_of_one_rank_is_found(tmp_path):
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    bad = state(1)
    bad["exp_avg"][3] = torch.nextafter(bad["exp_avg"][3], torch.tensor(float("inf")))
    b = write(tmp_path / "b", {0: state(0), 1: bad})
    equal, why = compare_final_states(a, b)
    assert not equal and "rank 1: exp_avg differs" in why


def test_two_ranks_with_their_states_swapped_differ(tmp_path):
    # per-rank state is distinct, so a wrong route (rank 0 given rank 1's state) cannot pass
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    b = write(tmp_path / "b", {0: state(1), 1: state(0)})
    assert not compare_final_states(a, b)[0]


def test_a_replica_whose_parameters_differ_only_where_it_does_not_write_them_differs(tmp_path):
    """dp 2: the two replicas share ``params``; rank 0 writes elements 0-2, rank 1 elements 3-5.
    A wrong route gave rank 1 parameters differing from its peer's in element 0 only: every
    written tensor is bitwise equal to the right run's, and the digest of rank 1's whole state
    is not."""
    shared = state(0)["params"]
    right = {r: dict(state(r), params=shared.clone()) for r in range(2)}
    wrong = {r: dict(state(r), params=shared.clone()) for r in range(2)}
    wrong[1]["params"][0] += 1.0
    a = write(tmp_path / "a", right, dp=2)
    b = write(tmp_path / "b", wrong, dp=2)
    for r in range(2):
        sa = checkpoint.read_rank_state(a / "final" / "step_5", r)[0]
        sb = checkpoint.read_rank_state(b / "final" / "step_5", r)[0]
        assert "params" not in sa and all(torch.equal(sa[k], sb[k]) for k in sa)
    equal, why = compare_final_states(a, b)
    assert not equal and "rank 1: the digest of its whole state differs" in why, why
    # (what load_final_rank rebuilds of the wrong run is the written parts: the right state)
    assert torch.equal(load_final_rank(b, 1)["params"], shared)


def test_missing_ranks_or_tensors_differ(tmp_path):
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    assert not compare_final_states(a, write(tmp_path / "b", {0: state(0)}))[0]
    short = state(1)
    del short["exp_avg"]
    equal, why = compare_final_states(a, write(tmp_path / "c", {0: state(0), 1: short}))
    assert not equal and "different state keys" in why
    assert not compare_final_states(a, tmp_path / "nothing")[0]
    # a rank that never wrote its final state: the run has no complete final state
    d = write(tmp_path / "d", {0: state(0), 1: state(1)})
    shutil.rmtree(d / "final" / "step_5" / "rank_1")
    equal, why = compare_final_states(a, d)
    assert not equal and "no complete final state" in why
