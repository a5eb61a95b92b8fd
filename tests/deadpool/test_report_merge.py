"""Merging the per-process metrics (deadpool/launch/report.py, issue 37): a streaming k-way merge of
``metrics/slot*.jsonl`` whose output and summary equal the old merge's (every row loaded, sorted
in memory), holding about one row per file rather than the run's rows."""

from __future__ import annotations

import json
import random
import statistics
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

from deadpool.checkpoint.final import final_digest
from deadpool.launch import report


def old_merge(run_dir: Path) -> list[dict]:
    """The merge as it was: every row of every file in memory, sorted."""
    rows = []
    for f in sorted((run_dir / "metrics").glob("slot*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: (r["t"], r["rank"] if r["rank"] is not None else -1))
    return rows


def old_aggregates(rows: list[dict], num_steps: int) -> dict:
    def median(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None
    gen0 = [r for r in rows if r["generation"] == 0 and r["step"] > 1]
    at = [r for r in rows if r["step"] == num_steps and r.get("loss") is not None]
    gen = max(r["generation"] for r in at)
    losses = [r["loss"] for r in at if r["generation"] == gen]
    return {"step_time_s": median(r["step_time_s"] for r in gen0),
            "copy_s_median": median(r["snapshot_copy_s"] for r in gen0),
            "final_loss": round(sum(losses) / len(losses), 6),
            "val_loss": {str(r["step"]): r["val_loss"] for r in rows if r.get("val_loss") is not None}}


def write_run(run_dir: Path, slots: int, steps: int, pad: int = 0, seed: int = 0) -> None:
    """Per-slot files as processes write them: each in its own time order; a spare (the last
    slot) takes rank 1 in generation 1 from step 4; equal times across files (ties)."""
    rng = random.Random(seed)
    (run_dir / "metrics").mkdir(parents=True)
    for s in range(slots):
        t = 1000.0
        with open(run_dir / "metrics" / f"slot{s}.jsonl", "w") as f:
            for step in range(1, steps + 1):
                spare = s == slots - 1
                if spare and step < 4:
                    continue
                t += rng.choice([0.25, 0.5, 0.5])  # shared values across files: ties
                rank = 1 if spare else (None if s == 1 and step >= 4 else s)
                rec = {"step": step, "rank": rank, "slot": s, "generation": int(spare),
                       "loss": round(rng.random(), 6) if s % 2 == 0 or spare else None,
                       "step_time_s": rng.choice([None, rng.random()]),
                       "snapshot_copy_s": rng.random(), "replicate_s": None,
                       "snapshot_blocked_s": 0.0,
                       "val_loss": round(rng.random(), 4) if step % 5 == 0 else None,
                       "t": t, "pad": "x" * pad}
                f.write(json.dumps(rec) + "\n")


def test_the_merged_file_and_summary_equal_the_old_merge(tmp_path):
    write_run(tmp_path, slots=5, steps=30)
    want = old_merge(tmp_path)
    merged = report.merge_metrics(tmp_path, num_steps=30)
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == want
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(json.dumps(r) + "\n" for r in want)
    old = old_aggregates(want, 30)
    assert merged.rows == len(want)
    assert merged.median("step_time_s") == old["step_time_s"]
    assert merged.median("snapshot_copy_s") == old["copy_s_median"]
    assert merged.final_loss() == old["final_loss"]
    assert merged.val_loss == old["val_loss"]


def test_more_files_than_may_be_open_at_once_merge_the_same(tmp_path, monkeypatch):
    write_run(tmp_path, slots=9, steps=12, seed=3)
    want = old_merge(tmp_path)
    monkeypatch.setattr(report, "MAX_OPEN_FILES", 2)
    assert report.merge_metrics(tmp_path).rows == len(want)
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == want
    assert sorted(p.name for p in (tmp_path / "metrics").iterdir()) == \
        sorted(f"slot{s}.jsonl" for s in range(9))  # nothing of the merge left behind


def test_the_merge_holds_about_a_row_per_file_not_the_run(tmp_path):
    """4 files x 2,500 rows of ~2 KB (~20 MB of rows): the old merge's peak is above that, the
    streaming merge's a few MB (its per-metric samples, a row per file, buffers)."""
    write_run(tmp_path, slots=4, steps=2500, pad=2000)
    tracemalloc.start()
    try:
        report.merge_metrics(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 * 2**20, f"peak {peak / 2**20:.1f} MiB while merging"


def test_write_outputs_takes_the_final_digest_from_the_ranks_digests(tmp_path):
    write_run(tmp_path, slots=2, steps=6)
    finals = {r: {"digest": f"d{r}", "state_bytes": 10, "model_params": 5} for r in (1, 0)}
    coord = SimpleNamespace(finals=finals, dims=SimpleNamespace(world_size=2), outcome="completed",
                            message="", recoveries=[])
    cfg = {"parallel": {"dp": 2, "tp": 1, "pp": 1}, "num_steps": 6,
           "ft": {"num_spares": 0, "snapshot": True, "snapshot_interval_steps": 1}}
    summary = report.write_outputs(cfg, coord, tmp_path, wall_s=1.0)
    assert summary["final_digest"] == final_digest(finals, 2)
    assert summary["final_loss"] == old_aggregates(old_merge(tmp_path), 6)["final_loss"]
    assert json.loads((tmp_path / "summary.json").read_text())["final_digest"] == \
        final_digest(finals, 2)
