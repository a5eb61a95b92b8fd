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


def _train(tmp_path, name: str, overrides: list[str]):
    run = tmp_path / name
    s = run_job(compose_train(BASE + overrides, run), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    return run, s


def _checkpointed_at(tmp_path, name: str, step: int, overrides: list[str]):
    """A failure-free job stopped at ``step`` with a disk checkpoint of it, written from the live
    state by the training thread (no snapshots); returns that checkpoint's directory."""
    run, _ = _train(tmp_path, name, ["faults=none", "ft.num_spares=0", "ft.snapshot=false",
                                     f"num_steps={step}", f"ft.persist_interval_steps={step}"]
                    + overrides)
    return run / "checkpoints" / f"step_{step}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_shrink_equals_training_at_the_reduced_width_from_the_same_step(tmp_path):
    run, s = _train(tmp_path, "elastic", ["ft=elastic", "faults=kill_mid_step",
                                          "faults.events.0.step=6"])
    (rec,) = s["recoveries"]
    assert rec["outcome"] == "shrunk to dp=3" and rec["dropped_dp"] == [1]
    assert rec["steps_recomputed"] <= 1 and rec["load_s"] >= 0
    assert sorted(_final(run)) == ["rank0.pt", "rank1.pt", "rank2.pt"]
    # the reference, independent of the run under test: a failure-free dp=4 job to the shrink's
    # resume step S, then a fresh dp=3 job with the same global batch from that state (re-cut for
    # three ZeRO-1 shards by the loader)
    S = rec["resume_step"]
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, [])
    ref, _ = _train(tmp_path, "ref", ["parallel.dp=3", "parallel.global_dp=4", "ft.num_spares=0",
                                      f"ft.resume_from={at_S}"])
    equal, why = compare_final_states(run, ref)
    assert equal, why
    # the global batch and its mean are kept: the narrower job trains like the full-width one,
    # to rounding (sums in another order), and unlike a dp=3 job with a smaller global batch
    full, _ = _train(tmp_path, "full", ["faults=none"])
    small, _ = _train(tmp_path, "small", ["parallel.dp=3", f"ft.resume_from={at_S}"])
    for r in range(3):
        name = f"rank{r}.pt"
        p_el, p_full = _final(run)[name]["params"], _final(full)[name]["params"]
        p_small = _final(small)[name]["params"]
        n = min(p_el.numel(), p_full.numel(), p_small.numel())
        d_kept = (p_el[:n] - p_full[:n]).abs().max().item()
        d_other = (p_small[:n] - p_full[:n]).abs().max().item()
        assert d_kept < 1e-4 and d_kept * 50 < d_other, (name, d_kept, d_other)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deadpool_falls_back_to_elastic_then_regrows(tmp_path):
    # one spare, two kills: the first is hot-swapped, the second shrinks; a replacement is
    # available right away and the job regrows to dp=4
    events = ("faults.events=[{rank: 1, step: 3, phase: mid_step, kind: kill},"
              "{rank: 2, step: 6, phase: mid_step, kind: kill}]")
    run, s = _train(tmp_path, "dp", [events, "ft.elastic_regrow_after_s=0.5", "num_steps=16"])
    outcomes = [r["outcome"] for r in s["recoveries"]]
    assert outcomes == ["hot-swapped", "shrunk to dp=3", "regrown to dp=4"], outcomes
    assert sorted(_final(run)) == [f"rank{r}.pt" for r in range(4)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 16
    # the reference, built without the run under test: failure-free at dp=4 to the shrink's step
    # S (the hot swap before it changes nothing), dp=3 with the global batch kept from S to the
    # regrow's step R, then dp=4 again from R to the end; every tensor of every rank must match
    S, R = s["recoveries"][1]["resume_step"], s["recoveries"][2]["resume_step"]
    assert S < R
    at_S = _checkpointed_at(tmp_path, "ref_to_S", S, [])
    at_R = _checkpointed_at(tmp_path, "ref_S_to_R", R, ["parallel.dp=3", "parallel.global_dp=4",
                                                         f"ft.resume_from={at_S}"])
    ref, _ = _train(tmp_path, "ref", ["faults=none", "ft.num_spares=0", "num_steps=16",
                                      f"ft.resume_from={at_R}"])
    equal, why = compare_final_states(run, ref)
    assert equal, why
