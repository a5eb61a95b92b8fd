"""Spike rules, skipped data positions and the integrity verdicts, without processes
(deadpool/recovery/spike.py, deadpool/recovery/integrity.py). The real-process runs are in
tests/integration/test_integrity.py."""

from __future__ import annotations

import math

import pytest
import torch

from deadpool.recovery.integrity import flip_param_bit, judge
from deadpool.recovery.rollback import capped
from deadpool.recovery.spike import SpikeRule, add_skip, position
from deadpool.store.protocol import RankStatus


def test_positions_skip_exactly_the_listed_batches():
    skips = add_skip(add_skip([], 5), 2)
    assert skips == [2, 5] and add_skip(skips, 5) == [2, 5]
    read = [position(t, skips) for t in range(8)]
    assert read == [0, 1, 3, 4, 6, 7, 8, 9]  # every position once, none of 2 and 5
    assert [position(t, []) for t in range(4)] == [0, 1, 2, 3]
    # a skip added later (a spike at step 5, positions so far unskipped) changes only steps >= 5
    assert [position(t, [5]) for t in range(7)] == [0, 1, 2, 3, 4, 6, 7]


def test_the_nonfinite_rule_flags_inf_and_nan_loss_or_norm():
    rule = SpikeRule("nonfinite")
    assert rule.bad(2.5, 1.0) is None and rule.bad(None, None) is None
    assert "loss" in rule.bad(float("nan"), 1.0)
    assert "grad_norm" in rule.bad(2.0, math.inf)
    assert SpikeRule("off").bad(float("nan"), None) is None
    with pytest.raises(ValueError):
        SpikeRule("sometimes")


def test_the_zscore_rule_flags_an_outlier_only_once_its_window_is_full():
    rule = SpikeRule("zscore", threshold=4.0, window=5)
    assert rule.bad(100.0, None) is None  # window not full: never an outlier
    rule.reset()
    for loss in (3.0, 3.1, 2.9, 3.05, 2.95):
        assert rule.bad(loss, None) is None
    assert rule.bad(3.2, None) is None          # ordinary jitter
    assert "sd above" in rule.bad(9.0, None)    # far out
    assert len(rule.history) == 5 and 9.0 not in rule.history  # a spike never joins the window
    rule.reset()
    assert rule.bad(9.0, None) is None  # after a rollback the window is re-learnt


def test_a_majority_names_the_differing_ranks_and_two_cannot():
    assert judge([7, 7, 7, 7]) == (True, [])
    assert judge([7, 8, 7, 7]) == (False, [1])
    assert judge([7, None, 7, 9]) == (False, [3])   # an unknown copy is left out
    assert judge([7, 8]) == (False, None)           # dp 2: no majority
    assert judge([7, 7, 8, 8]) == (False, None)     # a tie is none either
    assert judge([5, None]) == (True, [])


def test_a_capped_status_offers_nothing_newer_than_the_cap():
    st = RankStatus(rank=1, slot=1, live_step=9, local_steps=[6, 7, 8], replicas={2: [7, 8]})
    c = capped(st, 7)
    assert c.live_step is None and c.local_steps == [6, 7] and c.replicas == {2: [7]}
    assert capped(st, 9).live_step == 9 and st.local_steps == [6, 7, 8]  # the input is kept


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_the_injected_flip_is_one_bit_outside_the_ranks_own_shard(dp_rank):
    from deadpool.parallel.data.zero import ZeroOptimizer
    params = [torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(5))]
    opt = ZeroOptimizer(params, dp_size=2, dp_rank=dp_rank, lr=1e-3, weight_decay=0.0)
    before = opt.flat_params.clone()
    flip_param_bit(opt)
    diff = (before.view(torch.int32) ^ opt.flat_params.view(torch.int32)).nonzero().flatten()
    assert diff.numel() == 1
    i = int(diff[0])
    lo, hi = opt.shard_range
    assert not lo <= i < hi and i < opt.numel  # a peer's shard: the all-gather would not spread it
    assert int(before.view(torch.int32)[i] ^ opt.flat_params.view(torch.int32)[i]) == 1


def test_corrupt_in_the_step_flips_a_parameter_elsewhere_replicas_and_spike_the_loss():
    from deadpool.rank.faults import FaultInjector
    events = [{"rank": 0, "step": 2, "phase": p, "kind": k} for p, k in
              (("optimizer", "corrupt"), ("replication", "corrupt"), ("status", "corrupt"),
               ("backward", "spike"))]
    calls = []
    inj = FaultInjector(events, slot=0, on_corrupt=lambda: calls.append("replicas"))
    inj.on_flip, inj.on_spike = (lambda: calls.append("flip")), (lambda: calls.append("spike"))
    inj.set_rank(0)
    for phase in ("optimizer", "replication", "status", "backward"):
        inj.fire(1, phase)  # before the step: nothing
        inj.fire(2, phase)
    assert calls == ["flip", "replicas", "replicas", "spike"]
