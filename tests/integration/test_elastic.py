"""ft=elastic (and DeadPool's fallback when its spares run out) with real processes: a SIGKILL
with no spare left drops the dead rank's data-parallel replica; the job goes on narrower with the
same global batch, and regrows later."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.job import run_job
from deadpool.report import compare_final_states
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp4", "num_steps=14", "log_every_steps=0",
        "ft.persist_interval_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


def _final(run):
    return {f.name: torch.load(f) for f in sorted((run / "final").glob("rank*.pt"))}


def test_elastic_refuses_spares(tmp_path):
    with pytest.raises(ValueError, match="num_spares=0"):
        run_job(compose_train(BASE + ["ft=elastic", "ft.num_spares=1"], tmp_path), log=quiet)
    with pytest.raises(ValueError, match="global_dp"):
        run_job(compose_train(BASE + ["parallel.global_dp=2"], tmp_path), log=quiet)


@pytest.mark.slow
def test_shrink_equals_training_at_the_reduced_width_from_the_same_step(tmp_path):
    run = tmp_path / "elastic"
    s = run_job(compose_train(BASE + ["ft=elastic", "faults=kill_mid_step",
                                      "faults.events.0.step=6"], run), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "shrunk to dp=3" and rec["dropped_dp"] == [1]
    assert rec["steps_recomputed"] <= 1 and rec["load_s"] >= 0
    assert sorted(_final(run)) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    # the reference: a fresh job at dp=3 with the same global batch, from the step-S state the
    # shrink wrote (the dead rank's optimizer shard came from its buddy's replica)
    S = rec["resume_step"]
    ref = tmp_path / "ref"
    r = run_job(compose_train(BASE + ["parallel.dp=3", "parallel.global_dp=4", "ft.num_spares=0",
                                      f"ft.resume_from={run}/checkpoints/step_{S}"], ref), log=quiet)
    assert r["outcome"] == "completed"
    equal, why = compare_final_states(run, ref)
    assert equal, why
    # the global batch and its mean are kept: the narrower job trains like the full-width one,
    # to rounding (sums in another order), and unlike a dp=3 job with a smaller global batch
    full = tmp_path / "full"
    assert run_job(compose_train(BASE + ["faults=none"], full), log=quiet)["outcome"] == "completed"
    small = tmp_path / "small"
    assert run_job(compose_train(BASE + ["parallel.dp=3", "ft.resume_from="
                                         f"{run}/checkpoints/step_{S}"], small),
                   log=quiet)["outcome"] == "completed"
    p_el, p_full = _final(run)["rank0.pt"]["params"], _final(full)["rank0.pt"]["params"]
    p_small = _final(small)["rank0.pt"]["params"]
    n = min(p_el.numel(), p_full.numel(), p_small.numel())
    d_kept = (p_el[:n] - p_full[:n]).abs().max().item()
    d_other = (p_small[:n] - p_full[:n]).abs().max().item()
    assert d_kept < 1e-4 and d_kept * 50 < d_other, (d_kept, d_other)


@pytest.mark.slow
def test_deadpool_falls_back_to_elastic_then_regrows(tmp_path):
    # one spare, two kills: the first is hot-swapped, the second shrinks; a replacement is
    # available right away and the job regrows to dp=4 (bitwise equal to no failure at all is
    # not expected: the narrow steps sum gradients in another order)
    run = tmp_path / "dp"
    events = ("faults.events=[{rank: 1, step: 3, phase: mid_step, kind: kill},"
              "{rank: 2, step: 6, phase: mid_step, kind: kill}]")
    s = run_job(compose_train(BASE + [events, "ft.elastic_regrow_after_s=0.5", "num_steps=16"],
                              run), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    outcomes = [r["outcome"] for r in s["recoveries"]]
    assert outcomes == ["hot-swapped", "shrunk to dp=3", "regrown to dp=4"], outcomes
    assert sorted(_final(run)) == [f"rank{r}.pt" for r in range(4)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 16
