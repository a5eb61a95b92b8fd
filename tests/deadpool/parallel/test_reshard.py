"""Re-cutting a data-parallel group's ZeRO state at another width (``parallel/data/reshard.py``):
every rank of the new width gets exactly the state that width would have written."""

import pytest
import torch


@pytest.mark.parametrize("old_dp,new_dp", [(4, 3), (3, 4), (4, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("shard", [True, False])
@pytest.mark.parametrize("bf16", [False, True])
def test_reshard_state_is_the_state_of_the_new_width(old_dp, new_dp, shard, bf16):
    from deadpool.parallel.data.zero import _padded, reshard_state  # (re-exported)

    numel = 103
    g = torch.Generator().manual_seed(0)
    names = ("params", "master", "exp_avg", "exp_avg_sq") if bf16 else ("params", "exp_avg", "exp_avg_sq")
    full = {k: torch.randn(numel, generator=g) for k in names}
    if bf16:
        full["params"] = full["params"].to(torch.bfloat16)

    def states(dp):
        sharded = shard and dp > 1
        out = []
        for r in range(dp):
            n = _padded(numel, dp)
            st = {}
            for k, v in full.items():
                t = torch.zeros(n, dtype=v.dtype)
                t[:numel] = v
                st[k] = t if k == "params" or not sharded else t[r * n // dp:(r + 1) * n // dp].clone()
            if sharded and not bf16:  # an fp32 shard's master: its slice of the parameters
                st["master"] = st["params"][r * n // dp:(r + 1) * n // dp].clone()
            st["step"] = torch.tensor(7.0)
            out.append(st)
        return out

    old, want = states(old_dp), states(new_dp)
    for r in range(new_dp):
        got = reshard_state(old, numel, new_dp, r, shard and new_dp > 1)
        assert got.keys() == want[r].keys()
        for k in want[r]:
            assert got[k].dtype == want[r][k].dtype and torch.equal(got[k], want[r][k]), (r, k)
