"""The headline table of issue 25: every strategy at 16,384 and 131,072 GPUs with the GPU-calibrated
defaults, and with one change at a time reverted to its old value (leave-one-out: what each change
moved), plus all of the old values at once and two rack-failure cases.

    python experiments/sim/headline.py [--seeds 5] [--seeds-131k 2] [--out experiments/results/sim/headline]

Writes aggregate.csv (columns ``variant``, ``num_gpus``, per strategy) and table.md. Replication
is in the table but not in the headline list (its redundancy has no published measurement).
The old code's own numbers: experiments/results/sim/headline/old_code/ (see NOTE.md there).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from points import variant_study

HERE = Path(__file__).resolve().parent
STRATS = ("deadpool", "inmem_restart", "checkpoint_restart", "replication", "elastic", "elastic_hsdp")
OLD_STORAGE = ["calibration.storage_share_frac=1.0", "calibration.ckpt_storage_duty_max=null",
               "calibration.ckpt_keep_last=0", "calibration.ckpt_load=one_copy"]
OLD_STRATEGY = ["strategy.elastic.shard_loss=restart", "strategy.elastic_hsdp.shard_loss=restart",
                "strategy.elastic.regrow=blocking", "strategy.elastic_hsdp.regrow=blocking",
                "strategy.replication.replace=blocking", "cluster.hbm_gb_per_gpu=null"]
HIGH_PARTS = ["calibration.snapshot_issue_exposed_frac=1.0", "calibration.host_contention_frac=0.03",
              "calibration.snapshot_overlap_frac=0.7", "calibration.host_mem_gbps_per_node=250",
              "calibration.checksum_gbps=10"]
# Llama 3's 35 switch/cable interruptions as if every one took a whole 2-node rack:
# 35 / (1,024 racks x 54 days) = 0.63 per 1,000 rack-days (an upper reading of a published count)
RACKS = ["trace.rack_failures_per_1000_rack_days=0.63"]
VARIANTS = {
    "new defaults (gpu_h100)": [],
    "snapshot overhead = CPU A/B 3.0 % (old)": ["calibration.snapshot_overhead_frac=0.030"],
    "snapshot parts at the high ends of their ranges": HIGH_PARTS,
    "hot swap slower: rebuild 12 s per log2 GPUs (FlashRecovery-like)": ["calibration.rebuild_per_log2_gpus_s=12"],
    "restart faster: requeue + launch x0.5": ["calibration.requeue_s=60", "calibration.launch_base_s=15",
                                              "calibration.launch_per_log2_nodes_s=7.5"],
    "no warm-up after a restart (old)": ["calibration.restart_warmup_steps=0"],
    "storage dedicated, no interval floor, every checkpoint kept, one copy read (old)": OLD_STORAGE,
    "elastic: a lost shard (or a corruption) restarts the job (old)": ["strategy.elastic.shard_loss=restart",
                                                                       "strategy.elastic_hsdp.shard_loss=restart"],
    "elastic: regrow blocks for the state transfer (old)": ["strategy.elastic.regrow=blocking",
                                                            "strategy.elastic_hsdp.regrow=blocking"],
    "elastic_hsdp: 35 GB activations (optimizer sharded over 2 replicas)": ["cluster.activation_gb_per_gpu=35"],
    "replication: replacement blocks (old)": ["strategy.replication.replace=blocking"],
    "rack failures 0.63 / 1,000 rack-days, buddies one rack over (new)": RACKS,
    "rack failures 0.63 / 1,000 rack-days, buddies in the rack (old placement)": RACKS + [
        "calibration.buddy_placement=adjacent"],
    "all of the old values (calibration=default, old strategy knobs)": ["calibration=default"] + OLD_STRATEGY,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds at 16,384 GPUs")
    ap.add_argument("--seeds-131k", type=int, default=2, help="seeds at 131,072 GPUs")
    ap.add_argument("--days", type=float, default=54)
    ap.add_argument("--out", default=str(HERE.parents[1] / "experiments" / "results" / "sim" / "headline"))
    a = ap.parse_args()
    variant_study(VARIANTS, STRATS, {16384: a.seeds, 131072: a.seeds_131k}, a.days, a.out)


if __name__ == "__main__":
    main()
