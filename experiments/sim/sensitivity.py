"""Sensitivity sweep for the tornado plot (paper_figures/fig06_tornado.py).

    python experiments/sim/sensitivity.py [--seeds 5] [--out experiments/results/sim/sensitivity]

Reads experiments/sim/sensitivity.yaml: a base scenario and, per parameter, the overrides of
its low and high ends. Runs the base once and every end once (all strategies, same seeds),
and writes summary.csv / aggregate.csv with columns ``param``, ``level`` (base/low/high) and
``value`` (a label for the end).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from points import run_points

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE.parents[1] / "experiments" / "results" / "sim" / "sensitivity"))
    ap.add_argument("--spec", default=str(HERE / "sensitivity.yaml"))
    a = ap.parse_args()
    spec = yaml.safe_load(Path(a.spec).read_text())
    base = list(spec["base"]) + [f"seeds={a.seeds}", "progress=false"]
    points = [({"param": "base", "level": "base", "value": "defaults"}, [])]
    for p in spec["parameters"]:
        for level in ("low", "high"):
            points.append(({"param": p["name"], "level": level, "value": p[f"{level}_label"],
                            "base_value": p["base_label"]}, list(p[level])))
    run_points(points, base, a.out, keys=("param", "level", "value"))


if __name__ == "__main__":
    main()
