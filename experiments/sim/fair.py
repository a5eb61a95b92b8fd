"""The fairness table (experiments/results/sim/fair/NOTE.md): every strategy at 16,384 and
131,072 GPUs with the new defaults, and with one change at a time reverted to its old value
(leave-one-out: how much each change moves each strategy).

    python experiments/sim/fair.py [--seeds 5] [--out experiments/results/sim/fair]

Writes aggregate.csv (columns ``variant``, ``num_gpus``, per strategy) and table.md. The old
defaults themselves come from the old code (see NOTE.md for the command).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from points import variant_study

HERE = Path(__file__).resolve().parent
STRATS = ("deadpool", "inmem_restart", "checkpoint_restart", "replication", "elastic")
VARIANTS = {
    "new defaults": [],
    "snapshot overhead 0 (old)": ["calibration.snapshot_overhead_frac=0"],
    "detection 5 s for every cause": ["calibration.detect_crash_s=5", "calibration.detect_hang_s=5"],
    "SDC detected at once (no poisoning)": ["calibration.sdc_causes=[]"],
    "checkpoint/restart synchronous (old)": ["strategy.checkpoint_restart.ckpt_mode=sync"],
    "elastic without shard loss (old)": ["strategy.elastic.optimizer_state=replicated",
                                         "strategy.elastic.disk_ckpt_interval_s=10800"],
    "fallback disk every 3 h (old)": [f"strategy.{s}.disk_ckpt_interval_s=10800"
                                      for s in ("deadpool", "inmem_restart", "replication")],
    "replication lag 1 step (old)": ["calibration.replicate_lag_steps=1.0"],
    "full replicas, 25 GB/s NIC": ["calibration.replicate=full", "cluster.nic_gbps_per_node=25"],
    "all of the old values above": ["calibration.snapshot_overhead_frac=0", "calibration.detect_crash_s=5",
                                    "calibration.detect_hang_s=5", "calibration.sdc_causes=[]",
                                    "strategy.checkpoint_restart.ckpt_mode=sync",
                                    "strategy.elastic.optimizer_state=replicated",
                                    "strategy.elastic.disk_ckpt_interval_s=10800",
                                    "calibration.replicate_lag_steps=1.0"]
                                   + [f"strategy.{s}.disk_ckpt_interval_s=10800"
                                      for s in ("deadpool", "inmem_restart", "replication")],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE.parents[1] / "experiments" / "results" / "sim" / "fair"))
    a = ap.parse_args()
    variant_study(VARIANTS, STRATS, {16384: a.seeds, 131072: a.seeds}, 54, a.out)


if __name__ == "__main__":
    main()
