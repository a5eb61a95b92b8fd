"""Helpers shared by the runtime benchmarks in ``experiments/``: run a job quietly, keep its result
files, read its per-rank metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from deadpool.launch.config import compose_config
from deadpool.launch.job import run_job

quiet = lambda *a, **k: None  # noqa: E731


def run(overrides: list[str], run_dir: Path) -> dict:
    """One DeadPool job with Hydra ``overrides``, its output in ``run_dir``; returns the summary."""
    return run_job(compose_config(overrides, run_dir), log=quiet)


def keep(run_dir: Path, out: Path, name: str, files=("summary.json", "metrics.jsonl")) -> None:
    """Copy a run's result files to ``out/name`` (what paper_figures reads)."""
    (out / name).mkdir(parents=True, exist_ok=True)
    for f in files:
        if (run_dir / f).exists():
            shutil.copy(run_dir / f, out / name / f)


def metrics(run_dir: Path) -> list[dict]:
    """The per-rank, per-step records of ``metrics.jsonl``."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
