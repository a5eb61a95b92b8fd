"""A run directory holds one run (``deadpool.launch.run_dir``; issue 36, item 12): another run's
outputs are refused, removed on request, or continued by a resume."""

import json

import pytest

from deadpool import checkpoint
from deadpool.launch import run_dir
from deadpool.launch.job import run_job
from tests.conftest import compose_train

BASE = ["model=tiny", "parallel=dp2", "ft.num_spares=0", "log_every_steps=0",
        "eval_every_steps=2", "eval_batches=1", "ft.persist_interval_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


def _earlier_run(d):
    (d / "metrics").mkdir(parents=True)
    (d / "metrics" / "slot0.jsonl").write_text('{"step": 1}\n')
    (d / "summary.json").write_text("{}")
    (d / ".hydra").mkdir()


def _complete_step(ckpt, step):
    checkpoint.write_meta(ckpt, step, 1, "test")
    (ckpt / f"step_{step}" / "rank_0").mkdir()
    (ckpt / f"step_{step}" / "rank_0" / checkpoint.HEADER_FILE).write_text("{}")


def test_an_empty_or_hydra_only_directory_starts_the_run(tmp_path):
    (tmp_path / ".hydra").mkdir()
    cfg = compose_train(BASE, tmp_path)
    assert run_dir.check(cfg, quiet) == (cfg, [])


def test_another_runs_outputs_are_refused_naming_the_ways_on(tmp_path):
    _earlier_run(tmp_path)
    with pytest.raises(ValueError, match="overwrite_run_dir=true") as e:
        run_dir.check(compose_train(BASE, tmp_path), quiet)
    assert "ft.resume_from=auto" in str(e.value) and "summary.json" in str(e.value)


def test_overwrite_removes_the_earlier_outputs_and_its_checkpoints_but_not_hydras(tmp_path):
    _earlier_run(tmp_path)
    ckpt = tmp_path / "checkpoints"
    _complete_step(ckpt, 4)
    cfg, gone = run_dir.check(compose_train(BASE + ["overwrite_run_dir=true",
                                                    "ft.resume_from=auto"], tmp_path), quiet)
    assert cfg["ft"]["resume_from"] is None  # afresh: not from the checkpoint it removes
    run_dir.clear(gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hydra", "checkpoints"]
    assert not list(ckpt.iterdir())
    with pytest.raises(ValueError, match="would remove ft.resume_from"):
        _complete_step(ckpt, 4)
        run_dir.check(compose_train(BASE + ["overwrite_run_dir=true", f"ft.resume_from={ckpt}"],
                                    tmp_path), quiet)


def test_a_resume_continues_its_own_run_and_an_auto_resume_with_nothing_to_resume_starts_afresh(
        tmp_path):
    _earlier_run(tmp_path)
    ckpt = tmp_path / "checkpoints"
    auto = compose_train(BASE + ["ft.resume_from=auto"], tmp_path)
    cfg, gone = run_dir.check(auto, quiet)  # preempted before its first checkpoint: afresh
    assert cfg is auto and sorted(p.name for p in gone) == ["metrics", "summary.json"]
    _complete_step(ckpt, 6)
    assert run_dir.check(auto, quiet) == (auto, [])  # a requeue: the same run goes on
    explicit = compose_train(BASE + [f"ft.resume_from={ckpt}"], tmp_path)
    assert run_dir.check(explicit, quiet) == (explicit, [])
    other = tmp_path.parent / (tmp_path.name + "-other")
    _complete_step(other, 6)
    with pytest.raises(ValueError, match="another run's outputs"):
        run_dir.check(compose_train(BASE + [f"ft.resume_from={other}"], tmp_path), quiet)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_second_run_in_the_same_directory_never_merges_with_the_first(tmp_path):
    """As a user following the README twice with ``hydra.run.dir=run``: the second run (old
    code: ran, and its metrics and validation losses were merged with the first's) is refused,
    and with ``overwrite_run_dir=true`` holds its own outputs only."""
    run = tmp_path / "run"
    first = run_job(compose_train(BASE + ["num_steps=6"], run), log=quiet)
    assert first["outcome"] == "completed" and set(first["val_loss"]) == {"2", "4", "6"}
    with pytest.raises(ValueError, match="overwrite_run_dir=true"):
        run_job(compose_train(BASE + ["num_steps=4"], run), log=quiet)
    second = run_job(compose_train(BASE + ["num_steps=4", "overwrite_run_dir=true"], run),
                     log=quiet)
    assert second["outcome"] == "completed" and set(second["val_loss"]) == {"2", "4"}
    rows = _rows(run)
    assert max(r["step"] for r in rows) == 4
    seen = [(r["slot"], r["step"]) for r in rows]
    assert len(seen) == len(set(seen)), "a step logged twice: two runs merged"
