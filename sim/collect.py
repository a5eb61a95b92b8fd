"""Gather a multirun's per-job result files into one tidy CSV pair for paper_figures.

    python -m sim.collect MULTIRUN_DIR [MULTIRUN_DIR ...] --out experiments/results/sim/<name>

Concatenates every ``summary.csv`` found below the given directories (one per sweep point)
into ``<out>/summary.csv`` and recomputes ``<out>/aggregate.csv`` (mean and 95% CI per
strategy and scenario).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from sim import report


def collect(dirs: list[str], out: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    files = sorted(p for d in dirs for p in Path(d).rglob("summary.csv"))
    if not files:
        raise FileNotFoundError(f"no summary.csv below {', '.join(dirs)}")
    df = pd.concat([pd.read_csv(f).assign(job=str(f.parent.name)) for f in files], ignore_index=True)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    agg = report.aggregate(df)
    df.to_csv(out / "summary.csv", index=False)
    agg.to_csv(out / "aggregate.csv", index=False)
    return df, agg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sim.collect", description=__doc__.split("\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    df, agg = collect(a.dirs, a.out)
    print(f"[collect] {len(df)} rows from {df['job'].nunique()} jobs -> {a.out}/summary.csv, aggregate.csv",
          file=sys.stderr)


if __name__ == "__main__":
    main()
