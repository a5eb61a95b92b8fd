"""Any two overlapping failures recover from memory with ``ft.replicas=2``, at every layout, with
real processes: ZeRO-1 (``ft.replicate=unique``), fp32 and bf16, dp4, dp2 x tp2, dp2 x pp2 and
dp2 x tp2 x pp2. At each dp2 layout the two ranks killed together are the two data-parallel
copies of one model shard: no peer holds their parameters, which are rebuilt from the replicas
of the group's ZeRO shards (their master weights). At dp4 two deaths always leave a peer; the
pair is a rank and its first buddy. Every run ends bitwise equal (``torch.equal`` on every
tensor of every rank: parameters, master, moments, step, each rank's its own) to a failure-free
run of the same layout and seed. (The planner is checked for every pair in
``tests/deadpool/recovery/test_plan_overlapping.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train
from tests.integration.test_hotswap import ranks_lost

COMMON = ["model=tiny", "num_steps=8", "ft.num_spares=2", "ft.replicas=2",
          "ft.persist_interval_steps=0", "ft.replication_chunk_mb=0.5", "log_every_steps=0"]
LAYOUTS = {  # name -> (parallel overrides, the two ranks killed together)
    "dp4": (["parallel=dp4"], (1, 2)),
    "dp2xtp2": (["parallel.dp=2", "parallel.tp=2", "parallel.ranks_per_node=4"], (0, 2)),
    "dp2xpp2": (["parallel.dp=2", "parallel.pp=2", "parallel.ranks_per_node=1"], (0, 1)),
    "dp2xtp2xpp2": (["parallel=dp2_tp2_pp2"], (1, 3)),
}
quiet = lambda *a, **k: None  # noqa: E731


def reference(layout: str, precision: str, failure_free) -> Path:
    """The failure-free run of a layout, once per session (tests/conftest.py: test_replicas' 3D
    cases share the fp32 dp2 x tp2 x pp2 one)."""
    return failure_free(COMMON + LAYOUTS[layout][0] + [f"precision={precision}"])[0]


def kills(*evs: str) -> str:
    return "faults.events=[" + ",".join("{" + e + "}" for e in evs) + "]"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_killed_together_end_bitwise_equal(layout, precision, tmp_path, failure_free):
    par, (a, b) = LAYOUTS[layout]
    ev = kills(f"rank:{a},step:5,phase:optimizer,kind:kill",
               f"rank:{b},step:5,phase:optimizer,kind:kill")
    s = run_job(compose_train(COMMON + par + [f"precision={precision}", ev], tmp_path), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    assert ranks_lost(s) == {a, b}
    last = s["recoveries"][-1]["sources"]
    if layout != "dp4":  # both data-parallel copies gone: parameters from the shard replicas
        assert "parameters from the master shards" in last[str(a)], last
    equal, why = compare_final_states(tmp_path, reference(layout, precision, failure_free))
    assert equal, why


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_in_the_parameter_gather_and_its_peer_during_the_recovery(
        tmp_path, failure_free):
    """dp2 x tp2 x pp2: rank 1 dies inside the ZeRO parameter all-gather (its peer 3 is left
    mid-update and rolls back); 3 then dies while it sends 1's parameters to the spare. The
    next plan has neither copy of the (pp 0, tp 1) shard and rebuilds both from the shards'
    replicas."""
    ev = kills("rank:1,step:5,phase:param_gather,kind:kill", "rank:3,step:0,phase:transfer,kind:kill")
    s = run_job(compose_train(COMMON + LAYOUTS["dp2xtp2xpp2"][0] + [ev], tmp_path), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    assert ranks_lost(s) == {1, 3}
    first, last = s["recoveries"][0]["sources"], s["recoveries"][-1]["sources"]
    assert first["1"].endswith("+ parameters from rank 3"), first
    assert "parameters from the master shards" in last["1"], last
    assert "parameters from the master shards" in last["3"], last
    equal, why = compare_final_states(tmp_path, reference("dp2xtp2xpp2", "fp32", failure_free))
    assert equal, why
