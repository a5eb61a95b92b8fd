"""Run outputs (deadpool/report.py): the bitwise comparison of two runs' final states."""

from __future__ import annotations

import torch

from deadpool.report import compare_final_states


def write(run, ranks: dict[int, dict[str, torch.Tensor]]):
    (run / "final").mkdir(parents=True)
    for r, state in ranks.items():
        torch.save(state, run / "final" / f"rank{r}.pt")
    return run


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"params": torch.randn(6, generator=g), "exp_avg": torch.randn(6, generator=g)}


def test_equal_runs_compare_equal(tmp_path):
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    b = write(tmp_path / "b", {0: state(0), 1: state(1)})
    assert compare_final_states(a, b) == (True, "2 ranks, every parameter and optimizer tensor "
                                                "bitwise equal")


def test_one_ulp_in_one_optimizer_tensor_of_one_rank_is_found(tmp_path):
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    bad = state(1)
    bad["exp_avg"][3] = torch.nextafter(bad["exp_avg"][3], torch.tensor(float("inf")))
    b = write(tmp_path / "b", {0: state(0), 1: bad})
    equal, why = compare_final_states(a, b)
    assert not equal and "rank1.pt: exp_avg differs" in why


def test_two_ranks_with_their_states_swapped_differ(tmp_path):
    # per-rank state is distinct, so a wrong route (rank 0 given rank 1's state) cannot pass
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    b = write(tmp_path / "b", {0: state(1), 1: state(0)})
    assert not compare_final_states(a, b)[0]


def test_missing_ranks_or_tensors_differ(tmp_path):
    a = write(tmp_path / "a", {0: state(0), 1: state(1)})
    assert not compare_final_states(a, write(tmp_path / "b", {0: state(0)}))[0]
    short = state(1)
    del short["exp_avg"]
    equal, why = compare_final_states(a, write(tmp_path / "c", {0: state(0), 1: short}))
    assert not equal and "different state keys" in why
    assert not compare_final_states(a, tmp_path / "nothing")[0]
