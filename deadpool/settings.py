"""Settings derived from the resolved config, shared by the job, the coordinator and the ranks."""

from __future__ import annotations

import math


BUBBLE_MAX = 0.1  # the idle share of 1F1B, (pp - 1) / (m + pp - 1), that ``auto`` aims under


def bubble_microbatches(pp: int) -> int:
    """The fewest micro-batches keeping 1F1B's bubble at most ``BUBBLE_MAX``: 9 (pp - 1)."""
    return math.ceil((pp - 1) * (1 - BUBBLE_MAX) / BUBBLE_MAX - 1e-9)


def num_microbatches(cfg: dict) -> int:
    """``parallel.microbatches``; ``auto`` (or null): 1 without pipelining; else the fewest
    micro-batches ``m`` dividing the batch size that keep 1F1B's bubble ``(pp - 1) / (m + pp - 1)``
    at most ``BUBBLE_MAX`` (``m >= 9 (pp - 1)``), or the whole batch, one sequence per
    micro-batch, when no divisor reaches it (1F1B keeps at most ``pp`` micro-batches' activations
    per stage whatever ``m`` is, so more, smaller micro-batches need no more memory)."""
    p = cfg["parallel"]
    mb = p.get("microbatches", "auto")
    if mb in (None, "auto"):
        pp, batch = int(p["pp"]), int(cfg["batch_size"])
        if pp == 1:
            return 1
        return next((m for m in range(bubble_microbatches(pp), batch + 1) if batch % m == 0),
                    batch)
    return int(mb)


def microbatch_note(cfg: dict) -> str | None:
    """The line a job prints when it chose the micro-batches itself (pipelined, ``auto``)."""
    p = cfg["parallel"]
    pp = int(p["pp"])
    if pp == 1 or p.get("microbatches", "auto") not in (None, "auto"):
        return None
    m = num_microbatches(cfg)
    bubble = (pp - 1) / (m + pp - 1)
    short = (f" (over {BUBBLE_MAX:.0%}: batch_size >= {bubble_microbatches(pp)} would keep it "
             f"within {BUBBLE_MAX:.0%})") if bubble > BUBBLE_MAX + 1e-9 else ""
    return (f"[deadpool] parallel.microbatches=auto: {m} per step at pp {pp} (batch_size "
            f"{cfg['batch_size']}): 1F1B bubble {bubble:.1%}{short}")
