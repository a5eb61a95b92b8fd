"""Result files: tidy per-run rows, aggregates with confidence intervals, a console table.

``summary.csv``: one row per strategy x seed (plus scenario columns).
``aggregate.csv``: per strategy (and scenario), mean, standard deviation and a 95% Student-t
confidence interval over seeds of every numeric metric, as columns ``<metric>_mean``,
``<metric>_ci95_lo``, ``<metric>_ci95_hi``, with ``n_seeds``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
from scipy import stats

METRICS = ("goodput", "fleet_goodput", "failures", "hangs", "corruptions", "planned_maintenance", "swaps", "restarts",
           "stalls", "shrinks", "regrows", "fallbacks", "reloads", "absorbed", "spare_failures")
GROUP_KEYS = ("strategy", "trace", "num_gpus", "num_spares", "unexpected_per_1000_node_days",
              "duration_days")


def aggregate(df: pd.DataFrame, keys: Iterable[str] = GROUP_KEYS) -> pd.DataFrame:
    keys = [k for k in keys if k in df.columns]
    metrics = [m for m in df.columns if m.startswith("badput_")] + [m for m in METRICS if m in df.columns]
    out = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        n = len(g)
        row["n_seeds"] = n
        for m in metrics:
            x = g[m].to_numpy(dtype=float)
            mean = float(x.mean())
            sd = float(x.std(ddof=1)) if n > 1 else 0.0
            half = float(stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n)) if n > 1 else 0.0
            row[f"{m}_mean"], row[f"{m}_sd"] = mean, sd
            row[f"{m}_ci95_lo"], row[f"{m}_ci95_hi"] = mean - half, mean + half
        out.append(row)
    return pd.DataFrame(out)


def write(rows: list[dict], out_dir: str | Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    agg = aggregate(df)
    df.to_csv(out_dir / "summary.csv", index=False)
    agg.to_csv(out_dir / "aggregate.csv", index=False)
    return df, agg


def table(agg: pd.DataFrame) -> str:
    """Console table: ETTR and fleet goodput (mean +- CI half-width) and event counts."""
    lines = [f"{'strategy':<20} {'ETTR (job goodput)':>20} {'fleet goodput':>16} {'failures':>9} "
             f"{'swaps':>7} {'restarts':>8} {'stalls':>7}"]
    for _, r in agg.iterrows():
        def pm(m):
            return f"{r[m + '_mean']:.4f} +- {(r[m + '_ci95_hi'] - r[m + '_ci95_lo']) / 2:.4f}"
        lines.append(f"{r['strategy']:<20} {pm('goodput'):>20} {pm('fleet_goodput'):>16} "
                     f"{r['failures_mean']:>9.1f} {r['swaps_mean']:>7.1f} {r['restarts_mean']:>8.1f} "
                     f"{r['stalls_mean']:>7.1f}")
    return "\n".join(lines)
