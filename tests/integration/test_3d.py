"""3D parallelism under hot-swap with real processes: dp2 x tp2 x pp2 (8 ranks) + 1 warm spare.

A rank is killed at each position (a tensor-parallel peer, the first and the last pipeline stage,
each data-parallel replica) and in each phase (between steps, forward, backward, the pipeline's
warm-up and cool-down, the ZeRO reduce-scatter and all-gather, the snapshot copier and the
replication thread), and a second process during a recovery (the receiving spare, the peer
sending parameters, a survivor in the group rebuild or before its status). Every rank's state is distinct (its
(pp, tp) shard of the model, its ZeRO-1 optimizer shard), so the final state equals the
failure-free run only if every piece travelled to the right rank.
"""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states, load_final_rank
from deadpool.model import build_model
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp2_tp2_pp2", "num_steps=10", "ft.num_spares=1",
        "ft.replication_chunk_mb=0.5", "log_every_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference3d")
    summary = run_job(compose_train(BASE + ["faults=none"], run_dir), log=quiet)
    assert summary["outcome"] == "completed" and not summary["recoveries"]
    return run_dir, summary


def final_states(run_dir):
    return {r: load_final_rank(run_dir, r) for r in range(8)}


@pytest.mark.slow
def test_every_rank_holds_distinct_state(reference):
    states = final_states(reference[0])
    for a in range(8):
        for b in range(a + 1, 8):
            sa, sb = states[a], states[b]
            assert any(k not in sb or sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k])
                       for k in sa), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("rank,phase", [
    (1, "forward"),       # a tensor-parallel peer of the first stage (dp 0)
    (4, "backward"),      # the last stage, dp 0
    (2, "pp_warmup"),     # the first stage of the second data-parallel replica, in warm-up
    (0, "pp_cooldown"),   # the first stage during the cool-down backwards
    (7, "mid_step"),      # the last stage's tensor-parallel peer of dp 1
    (5, "allreduce"),     # inside the ZeRO-1 gradient reduce-scatter
    (3, "optimizer"),     # before the shard update and parameter all-gather
    (6, "step_start"),    # the last stage of dp 1, between steps
    (0, "param_gather"),  # inside the optimizer step: its shard updated, its peer (2) mid-gather
    (5, "snapshot_copy"), # in its snapshot copier thread, beside the next step
    (2, "replication"),   # in its replication thread, one chunk of the snapshot sent
])
def test_spare_takes_any_position_and_state_matches_failure_free(reference, tmp_path, rank, phase):
    ev = f"faults.events=[{{rank: {rank}, step: 5, phase: {phase}, kind: kill}}]"
    summary = run_job(compose_train(BASE + [ev], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["failed_rank"] == rank and rec["spare_slot"] == 8
    assert rec["outcome"] == "hot-swapped"
    # the interrupted step and, on a loaded host, at most one snapshot still replicating (three
    # local slots: the engine blocks the step rather than fall further behind)
    assert 0 <= rec["steps_recomputed"] <= 2
    assert rec["build_s"] >= 0                 # the spare's build of its rank's stage (0: pre-built)
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


def ranks_lost(summary) -> list[tuple[int, int]]:
    """(rank, slot) of every process lost, over all recoveries."""
    out = []
    for rec in summary["recoveries"]:
        ranks, slots = rec["failed_rank"], rec["failed_slot"]
        out += zip(ranks if isinstance(ranks, list) else [ranks],
                   slots if isinstance(slots, list) else [slots])
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("second", [
    "slot:8,step:0,phase:transfer,kind:kill",  # the spare receiving rank 5 dies mid-transfer
    "rank:7,step:0,phase:transfer,kind:kill",  # 5's data-parallel peer dies sending its parameters
    "rank:2,step:3,phase:rebuild,kind:kill",   # a survivor of another stage, in the group rebuild
    "rank:0,step:0,phase:status,kind:kill",    # a survivor, before it reports what it holds
], ids=["spare-in-transfer", "peer-in-transfer", "survivor-in-rebuild", "survivor-in-status"])
def test_a_failure_during_a_3d_recovery_is_recovered_too(reference, tmp_path, second):
    """ZeRO-1 in 3D with ``ft.replicas=2`` and two spares: rank 5 (last stage, tp 1, dp 0) dies
    mid-step and a second process dies during its recovery. Two processes lost, the job ends
    bitwise equal to the failure-free run (replicas do not change training: same reference)."""
    ev = ("faults.events=[{rank: 5, step: 5, phase: mid_step, kind: kill}, {" + second + "}]")
    summary = run_job(compose_train(BASE + ["ft.num_spares=2", "ft.replicas=2", ev], tmp_path),
                      log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    lost = ranks_lost(summary)
    assert len(set(lost)) == 2 and (5, 5) in lost, lost  # (one recovery may name both)
    assert summary["recoveries"][-1]["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


@pytest.fixture(scope="module")
def reference_gqa(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference3d_gqa")
    summary = run_job(compose_train(BASE + GQA_FULL + ["faults=none"], run_dir), log=quiet)
    assert summary["outcome"] == "completed" and not summary["recoveries"]
    return run_dir


# grouped-query attention (4 query heads, 2 KV heads: one per TP rank) with every block
# checkpointed: recomputation re-runs TP all-reduces inside backward
GQA_FULL = ["model.n_kv_heads=2", "activation_checkpointing=full"]


@pytest.mark.slow
def test_gqa_with_full_checkpointing_hot_swaps_to_the_failure_free_state(reference_gqa, tmp_path):
    """Killed in backward (the last stage, its TP peer waiting in a recomputed all-reduce): the
    spare's run ends bitwise equal to the failure-free run of the same GQA model."""
    from deadpool.model import stage_params

    ev = "faults.events=[{rank: 4, step: 5, phase: backward, kind: kill}]"
    summary = run_job(compose_train(BASE + GQA_FULL + [ev], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["failed_rank"] == 4 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path, reference_gqa)
    assert equal, why
    # the GQA shapes were trained: rank 0 (first stage, tp 0) holds its shard of them
    n = stage_params(dict(compose_train(BASE, tmp_path)["model"], n_kv_heads=2), 2, 2, 0)
    assert load_final_rank(tmp_path, 0)["params"].numel() == -(-n // 2) * 2


@pytest.mark.slow
def test_a_shard_lost_before_its_first_replica_is_drawn_from_the_seed(reference, tmp_path):
    # killed inside the job's first group build: no replica of anything exists yet
    ev = "faults.events=[{rank: 6, step: 0, phase: rebuild, kind: kill}]"
    summary = run_job(compose_train(BASE + [ev], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    (rec,) = summary["recoveries"]
    assert rec["resume_step"] == 0 and rec["sources"]["6"] == "init from rank 6"
    equal, why = compare_final_states(tmp_path, reference[0])
    assert equal, why


@pytest.mark.slow
@pytest.mark.timeout(900)  # several jobs
def test_swapped_routes_are_caught_by_the_final_state_comparison(reference, tmp_path):
    """Two same-shaped ranks die together and the plan swaps their routes: checksums pass (each
    piece is a valid state of *some* rank), so only the final comparison can tell. It must."""
    summary = run_job(compose_train(BASE + ["faults=kill_3d_two_ranks_swapped",
                                            "ft.num_spares=2"], tmp_path), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    equal, _ = compare_final_states(tmp_path, reference[0])
    assert not equal
    # the same failure without the swap recovers exactly
    right = tmp_path / "right"
    summary = run_job(compose_train(BASE + ["faults=kill_3d_two_ranks_swapped", "ft.num_spares=2",
                                            "faults.swap_routes=null"], right), log=quiet)
    assert summary["outcome"] == "completed", summary["message"]
    equal, why = compare_final_states(right, reference[0])
    assert equal, why


@pytest.mark.slow
def test_loss_curve_matches_the_same_model_trained_in_one_process(reference):
    """dp2 x tp2 x pp2 trains the model ``deadpool.model`` defines in one process, up to float
    rounding: the per-step loss (mean over data-parallel ranks) matches a single-process AdamW
    run on the same global batch, with the same decay groups."""
    from deadpool.data import SyntheticCorpus
    from tests.conftest import compose_train as ct

    cfg = ct(BASE + ["faults=none"], reference[0] / "unused")
    losses: dict[int, list[float]] = {}
    for line in (reference[0] / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["loss"] is not None and r["generation"] == 0:
            losses.setdefault(r["step"], []).append(r["loss"])
    torch.manual_seed(0)
    model = build_model(cfg["model"], cfg["seed"])
    # weight decay on matrices only, as the runtime does (none on the RMSNorm weights)
    opt = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.ndim >= 2]},
         {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg["lr"], weight_decay=cfg["weight_decay"], betas=(0.9, 0.95), foreach=False)
    corpus = SyntheticCorpus(cfg["model"]["vocab_size"], cfg["seed"])
    for s in range(cfg["num_steps"]):
        opt.zero_grad()
        total = 0.0
        for dp in range(2):
            x, y = corpus.batch(s, dp, cfg["batch_size"], cfg["seq_len"])
            loss = model(x, y) / 2
            loss.backward()
            total += loss.item()
        opt.step()
        got = sum(losses[s + 1]) / len(losses[s + 1])  # metrics are logged after the step
        assert abs(got - total) < 1e-4 * max(1.0, abs(total)), (s, got, total)
