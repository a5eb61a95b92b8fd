"""Settings derived from the resolved config, shared by the job, the coordinator and the ranks."""

from __future__ import annotations


def num_microbatches(cfg: dict) -> int:
    """``parallel.microbatches``; ``auto``: 1 without pipelining, else 2 x pp (1F1B keeps every
    stage busy once there are at least pp micro-batches), at most the batch size."""
    p = cfg["parallel"]
    mb = p.get("microbatches", "auto")
    if mb in (None, "auto"):
        if int(p["pp"]) == 1:
            return 1
        mb = min(int(cfg["batch_size"]), 2 * int(p["pp"]))
        while int(cfg["batch_size"]) % mb:
            mb -= 1
    return int(mb)
