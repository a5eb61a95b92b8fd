"""Spare sizing table (paper_figures/fig08_spare_sizing.py): spares needed for a target
probability that a failure finds the pool empty, by cluster size and repair preset.

    python experiments/sim/spare_sizing.py [--out experiments/results/sim/spare_sizing]

Closed form (sim.spares: M/G/infinity occupancy, Poisson tail) at llama3 failure and maintenance
rates; no simulation. tests/sim/test_spares.py checks the closed form against the simulator.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from points import compose_cfg
from sim import spares

HERE = Path(__file__).resolve().parent
NODES = (64, 128, 512, 2048, 4096, 8192, 16384)
REPAIRS = ("fast", "default", "rma_tail")
TARGETS = (0.01, 0.001)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE.parents[1] / "experiments" / "results" / "sim" / "spare_sizing"))
    a = ap.parse_args()
    rows = []
    for repair in REPAIRS:
        tcfg = compose_cfg([f"repair={repair}"])["trace"]
        for n in NODES:
            for target in TARGETS:
                rows.append({"repair": repair, **spares.size(tcfg, n, target)})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / "spares.csv", index=False)
    print(pd.DataFrame(rows).to_string(index=False))


if __name__ == "__main__":
    main()
