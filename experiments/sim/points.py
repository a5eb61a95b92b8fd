"""Run a list of labelled scenario points (Hydra overrides of sim/conf/sim.yaml) in this process
and write one tidy summary.csv / aggregate.csv for paper_figures.

Used by the sensitivity sweep, the correlated-failure sweep and the fairness table; each point
replays the same seeds' traces against every strategy (common random numbers within a point).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pandas as pd  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import sim.config  # noqa: E402
from sim import report  # noqa: E402
from sim.simulate import run_scenario  # noqa: E402


def compose_cfg(overrides: list[str]) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        return OmegaConf.to_container(compose("sim", overrides=list(overrides)), resolve=True)


def run_points(points: list[tuple[dict, list[str]]], base: list[str], out: str | Path,
               keys: tuple[str, ...], keep_summary: bool = False) -> pd.DataFrame:
    """``points``: (label columns, overrides). Rows get the label columns; the aggregate is
    grouped by ``keys`` (label columns) plus the strategy. The per-seed summary.csv is written
    only with ``keep_summary`` (it is large; figures read the aggregate)."""
    rows = []
    t0 = time.perf_counter()
    for i, (label, overrides) in enumerate(points):
        cfg = compose_cfg(base + overrides)
        for r in run_scenario(cfg, progress=False):
            rows.append({**label, "overrides": " ".join(overrides), **r})
        print(f"[points] {i + 1}/{len(points)} {label} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if keep_summary:
        df.to_csv(out / "summary.csv", index=False)
    agg = report.aggregate(df, keys=(*keys, "strategy", "num_gpus"))
    agg.to_csv(out / "aggregate.csv", index=False)
    return agg


def variant_table(agg: pd.DataFrame, variants, strategies: list[str]) -> str:
    """Markdown: per scale, a row per variant, ETTR / fleet goodput (mean of seeds) per
    strategy ("-" where a strategy did not run)."""
    lines = []
    for n, g in agg.groupby("num_gpus"):
        lines += [f"\n### {n:,} GPUs: ETTR / fleet goodput (mean of seeds)\n",
                  "| variant | " + " | ".join(strategies) + " |", "|---|" + "---|" * len(strategies)]
        for v in variants:
            d = g[g.variant == v].set_index("strategy")
            cells = [f"{d.loc[s, 'goodput_mean']:.4f} / {d.loc[s, 'fleet_goodput_mean']:.4f}"
                     if s in d.index else "-" for s in strategies]
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def variant_study(variants: dict[str, list[str]], strategies: list[str],
                  seeds_by_gpus: dict[int, int], days: float, out: str | Path) -> pd.DataFrame:
    """Every variant (label -> overrides) against ``strategies`` at each scale (GPUs -> seeds),
    written as ``out/gpus<N>/aggregate.csv``, ``out/aggregate.csv`` and ``out/table.md``
    (``variant_table``, also printed)."""
    frames = []
    for gpus, seeds in seeds_by_gpus.items():
        points = [({"variant": v}, o) for v, o in variants.items()]
        base = [f"cluster.num_gpus={gpus}", f"duration_days={days:g}", f"seeds={seeds}",
                "progress=false", f"strategies=[{','.join(strategies)}]"]
        frames.append(run_points(points, base, Path(out) / f"gpus{gpus}", keys=("variant",)))
    agg = pd.concat(frames, ignore_index=True)
    agg.to_csv(Path(out) / "aggregate.csv", index=False)
    table = variant_table(agg, variants, strategies)
    (Path(out) / "table.md").write_text(table)
    print(table)
    return agg

