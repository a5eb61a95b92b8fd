"""Correlated-failure sweep (paper_figures/fig07_correlated.py): whole-rack failures on top of
the independent node failures, with copies placed on the adjacent node or one rack over.

    python experiments/sim/correlated.py [--seeds 20] [--out experiments/results/sim/correlated]

16,384 H100 (2 nodes per rack, 1,024 racks), llama3 node rates, 54 days. A rate of 1 per 1,000
rack-days adds ~55 rack events (110 node losses) to the ~420 independent failures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from points import run_points

HERE = Path(__file__).resolve().parent
RATES = (0.0, 0.5, 1.0, 2.0, 5.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--out", default=str(HERE.parents[1] / "experiments" / "results" / "sim" / "correlated"))
    a = ap.parse_args()
    base = ["cluster.num_gpus=16384", "duration_days=54", f"seeds={a.seeds}", "progress=false"]
    points = [({"rack_rate": r, "placement": p},
               [f"trace.rack_failures_per_1000_rack_days={r}", f"calibration.buddy_placement={p}"])
              for p in ("adjacent", "cross_rack") for r in RATES]
    run_points(points, base, a.out, keys=("rack_rate", "placement"))


if __name__ == "__main__":
    main()
