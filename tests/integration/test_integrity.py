"""Silent data corruption and loss spikes with real processes (deadpool/recovery/integrity.py).

``corrupt`` flips one bit of a parameter a rank holds as a copy of a data-parallel peer's ZeRO
shard, or (``where: tp_replicated``) of a norm weight every tensor-parallel rank holds whole;
nothing fails, so only the peers' snapshot checksums (dp, tp) can see it. ``spike`` makes a rank's
loss non-finite. Each run ends bitwise equal to a failure-free run of the same seed (for a
spike: one given the same skipped batch), with every rank's state distinct (ZeRO on, dp > 1:
the optimizer shards differ), so a state routed to the wrong rank or a corruption left in fails.
No false detection: every failure-free reference here and in the other integration tests
(test_hotswap.py, test_3d.py: ``not summary["recoveries"]``) runs with the check on.
"""

from __future__ import annotations

import json

import pytest

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from tests.conftest import compose_train

quiet = lambda *a, **k: None  # noqa: E731
DP4 = ["model=tiny", "parallel=dp4", "num_steps=8", "ft.num_spares=1", "log_every_steps=0"]
DP2 = ["model=tiny", "parallel=dp2", "num_steps=8", "ft.num_spares=1", "log_every_steps=0"]
D3 = ["model=tiny", "parallel=dp2_tp2_pp2", "num_steps=8", "ft.num_spares=1",
      "ft.replication_chunk_mb=0.5", "log_every_steps=0"]
TP2_PP2 = D3 + ["parallel.dp=1"]  # no data-parallel peer: only the tp comparison can see a flip
TP4 = D3 + ["parallel.dp=1", "parallel.tp=4", "parallel.pp=1", "parallel.ranks_per_node=4"]


def run(args, run_dir):
    summary = run_job(compose_train(args, run_dir), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    return summary


def corrupt(rank: int, step: int, where: str = "shard_copy") -> str:
    return (f"faults.events=[{{rank: {rank}, step: {step}, phase: optimizer, kind: corrupt, "
            f"where: {where}}}]")


@pytest.mark.slow
def test_a_corrupt_rank_is_named_by_the_majority_swapped_and_the_state_matches(tmp_path):
    """dp 4: rank 1's copy of a peer's shard flipped after step 3's all-gather (state 4, which
    is snapshotted); its peers compare snapshot 4's checksums at the next snapshot, name rank 1,
    the spare takes it (optimizer shard from the buddy's replica of step 4, parameters from a
    peer) and every survivor rolls back to its own snapshot of step 4."""
    ref = run(DP4 + ["faults=none"], tmp_path / "ref")
    assert not ref["recoveries"]  # no false detection
    s = run(DP4 + [corrupt(1, 3)], tmp_path / "run")
    (rec,) = s["recoveries"]
    assert rec["detected_by"] == "corruption" and rec["fault"] == "corrupt"
    assert rec["failed_rank"] == 1 and rec["spare_slot"] == 4 and rec["outcome"] == "hot-swapped"
    assert rec["failed_at_step"] == 4 and rec["resume_step"] == 4
    assert rec["steps_recomputed"] >= 1
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why


@pytest.mark.slow
def test_corruption_at_dp2_tp2_pp2_is_found_by_re_running_and_the_state_matches(tmp_path):
    """dp 2 per model shard: no majority. The job rolls back to the newest agreed snapshot
    (no rank lost), both replicas re-run, and the rank whose re-run differs from its own first
    run is swapped for the spare."""
    ref = run(D3 + ["faults=none"], tmp_path / "ref")
    assert not ref["recoveries"]
    s = run(D3 + [corrupt(5, 3)], tmp_path / "run")
    dispute, swap = s["recoveries"]
    assert dispute["detected_by"] == "corruption" and dispute["failed_rank"] == []
    assert dispute["failed_at_step"] == 4 and dispute["resume_step"] < 4
    assert swap["detected_by"] == "corruption" and swap["failed_rank"] == 5
    assert swap["spare_slot"] == 8 and swap["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why


@pytest.mark.slow
def test_a_flipped_norm_at_tp2_pp2_is_found_by_its_tp_peer_re_run_and_the_state_matches(
        tmp_path, failure_free):
    """dp 1 x tp 2 x pp 2: rank 3 (stage 1, tp rank 1) flips a bit of a norm weight, which
    every tp rank holds whole, after step 3 (state 4, snapshotted; at dp 1 it is its master
    weight, so the flip stays). No dp group exists; the tp pair (2, 3) compares the norms of
    snapshot 4 at the next snapshot, has no majority, and both re-run from the newest agreed
    snapshot; rank 3's re-run differs from its first run, it names itself and the spare takes
    its rank from its buddy's replica of the re-run step 4. Every rank's state is its own
    model shard (distinct), so a wrong route or a flip left in fails the comparison."""
    ref_dir, _ = failure_free(TP2_PP2)
    s = run(TP2_PP2 + [corrupt(3, 3, where="tp_replicated")], tmp_path / "run")
    dispute, swap = s["recoveries"]
    assert dispute["detected_by"] == "corruption" and dispute["failed_rank"] == []
    assert dispute["failed_at_step"] == 4 and dispute["resume_step"] < 4
    assert swap["detected_by"] == "corruption" and swap["failed_rank"] == 3
    assert swap["spare_slot"] == 4 and swap["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", ref_dir)
    assert equal, why


@pytest.mark.slow
def test_a_flipped_norm_at_tp4_is_named_by_the_tp_majority_and_resumed_from_the_agreed_step(
        tmp_path, failure_free):
    """dp 1 x tp 4: rank 2's norm weight flipped into state 4; the tp majority names it at the
    next snapshot. Its buddy's replica of step 4 holds the flip (at dp 1 a replica is the whole
    state), so the job resumes from the newest agreed snapshot, 3, the spare from the replica of
    step 3 (resuming at 4 restores the flip: found again, the job stops)."""
    ref_dir, _ = failure_free(TP4)
    s = run(TP4 + [corrupt(2, 3, where="tp_replicated")], tmp_path / "run")
    (rec,) = s["recoveries"]
    assert rec["detected_by"] == "corruption" and rec["failed_rank"] == 2
    assert rec["failed_at_step"] == 4 and rec["resume_step"] == 3
    assert rec["spare_slot"] == 4 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", ref_dir)
    assert equal, why


@pytest.mark.slow
def test_a_spike_rolls_back_and_skips_its_batch_like_a_run_told_to_skip_it(tmp_path):
    """dp 2: rank 1's loss of step 5 made NaN. The job rolls back to snapshot 5 (the state
    before that batch) and reads data position 6 at step 5 from then on; a failure-free run with
    ``ft.spike.skip_batches=[5]`` computes the same bits, one without it does not."""
    ref = run(DP2 + ["faults=none", "ft.spike.skip_batches=[5]"], tmp_path / "ref")
    assert not ref["recoveries"]
    ev = "faults.events=[{rank: 1, step: 5, phase: optimizer, kind: spike}]"
    s = run(DP2 + [ev], tmp_path / "run")
    (rec,) = s["recoveries"]
    assert rec["detected_by"] == "spike" and rec["failed_rank"] == [] and rec["spare_slot"] == []
    assert rec["failed_at_step"] == 5 and rec["resume_step"] == 5 and rec["steps_recomputed"] >= 1
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = max(rows, key=lambda r: (r["generation"], r["step"]))
    assert last["skipped_batches"] == [5]
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why
