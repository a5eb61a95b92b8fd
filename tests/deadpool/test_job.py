"""deadpool/launch/job.py's validation of values a new user types wrong: each refused before any
process starts, with a message naming the field (the command-line exit is tested in
tests/integration/test_hotswap.py)."""

from __future__ import annotations

import pytest

from deadpool.launch.job import validate
from tests.conftest import compose_train


@pytest.mark.parametrize("override,msg", [
    ("lr=abc", "lr must be a number, got 'abc'"),
    ("weight_decay=[0.1]", "weight_decay must be a number"),
    ("num_steps=2.5", "num_steps must be an integer"),
    ("model.d_model=wide", "model.d_model must be a number"),
    ("seq_len=512", "seq_len=512 exceeds model.max_seq_len=256"),
    ("eval_batches=0", "eval_batches >= 1"),
    ("ft.resume_from=/nonexistent/ckpt", "ft.resume_from=/nonexistent/ckpt: no such directory"),
])
def test_bad_values_name_the_field(override, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        validate(compose_train([override, "parallel=dp2"], tmp_path))


def test_a_resume_directory_without_a_complete_checkpoint_is_refused(tmp_path):
    (tmp_path / "ckpt" / "step_4" / "rank_0").mkdir(parents=True)  # meta.json never written
    with pytest.raises(ValueError, match="no complete DeadPool checkpoint"):
        validate(compose_train([f"ft.resume_from={tmp_path / 'ckpt'}", "parallel=dp2"], tmp_path))


@pytest.mark.parametrize("override,msg", [
    ("ft.replicas=2", "ft.replicas=2 needs 3 ranks"),          # dp2 on one node
    ("ft.replicas=0", "ft.replicas must be >= 1, got 0"),
    ("ft.replicas=two", "ft.replicas must be an integer >= 1, got 'two'"),
])
def test_an_impossible_number_of_replicas_is_refused(override, msg, tmp_path):
    with pytest.raises(ValueError, match=msg):
        validate(compose_train([override, "parallel=dp2"], tmp_path))


def test_a_shrink_below_k_plus_one_ranks_keeps_what_replicas_fit_and_a_regrow_restores_k(tmp_path):
    from types import SimpleNamespace

    from deadpool.launch.job import _relaunch_cfg
    from deadpool.store.protocol import RecoveryRecord

    cfg = compose_train(["parallel=dp4", "parallel.ranks_per_node=1", "ft.replicas=3"], tmp_path)
    validate(cfg)
    store = SimpleNamespace(check=lambda keys: False)
    shrunk = _relaunch_cfg(cfg, store, 3, RecoveryRecord(3, fallback="shrink", dp=3), print)
    assert shrunk["parallel"]["dp"] == 3 and shrunk["ft"]["replicas"] == 2  # 3 nodes: 2 others
    grown = _relaunch_cfg(shrunk, store, 5, RecoveryRecord(5, fallback="grow", dp=4), print)
    assert grown["parallel"]["dp"] == 4 and grown["ft"]["replicas"] == 3


def test_a_coordinator_timeout_within_the_node_timeout_is_refused_across_hosts(tmp_path):
    bad = ["ft.coordinator_timeout_s=2", "ft.node_timeout_s=3"]
    with pytest.raises(ValueError, match="coordinator_timeout_s must exceed ft.node_timeout_s"):
        validate(compose_train(["launcher=slurm", *bad], tmp_path))
    validate(compose_train(bad, tmp_path))  # one host: no node is ever cut off
