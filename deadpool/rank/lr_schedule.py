"""The learning rate as a pure function of the optimizer step.

``lr_at(step, cfg)`` reads only the config and the step index (0 for the first optimizer step),
never a counter that lives in the optimizer: a rank that was rolled back, a spare that received
its state, and a job resumed from disk all get the same rate for the same step, so recovery
stays bitwise. The trainer sets it on the optimizer before every AdamW step.

Schedules (``lr_schedule``), all with a linear warm-up over the first ``warmup_steps`` steps
(``lr * (step + 1) / warmup_steps``: the first step already moves, the last warm-up step is at
``lr``), then from the peak ``lr`` down to ``min_lr = lr * min_lr_ratio``::

    constant  lr for every step after warm-up (min_lr_ratio unused)
    cosine    lr -> min_lr along half a cosine over the steps left after warm-up, reaching
              min_lr at the last step (num_steps - 1)
    wsd       warm-up, stable at lr, then a linear decay to min_lr over the last
              ``wsd_decay_ratio`` of the steps (warmup-stable-decay: the stable phase can be
              extended or branched from without knowing the end in advance)
"""

from __future__ import annotations

import math

__all__ = ["SCHEDULES", "lr_at", "check"]

SCHEDULES = ("constant", "cosine", "wsd")


def _knobs(cfg: dict) -> tuple[str, float, int, float, float, int]:
    return (cfg.get("lr_schedule", "constant"), float(cfg["lr"]), int(cfg.get("warmup_steps", 0)),
            float(cfg.get("min_lr_ratio", 0.0)), float(cfg.get("wsd_decay_ratio", 0.2)),
            int(cfg["num_steps"]))


def lr_at(step: int, cfg: dict) -> float:
    """The learning rate of optimizer step ``step`` (0-based) under ``cfg``'s schedule."""
    kind, peak, warmup, min_ratio, decay_ratio, total = _knobs(cfg)
    if step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    low = peak * min_ratio
    if kind == "cosine":
        span = max(1, total - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "wsd":
        decay = max(1, round(decay_ratio * total))
        start = max(warmup, total - decay)
        if step < start:
            return peak
        progress = min(1.0, (step - start + 1) / max(1, total - start))
        return peak + (low - peak) * progress
    raise ValueError(f"lr_schedule must be one of {list(SCHEDULES)}, got {kind!r}")


def check(cfg: dict) -> None:
    """Raise ``ValueError`` naming the field on a bad schedule config."""
    kind, peak, warmup, min_ratio, decay_ratio, _ = _knobs(cfg)
    if kind not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {list(SCHEDULES)}, got {kind!r}")
    if peak <= 0:
        raise ValueError(f"lr must be > 0, got {peak}")
    if warmup < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup}")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_ratio}")
    if not 0.0 < decay_ratio <= 1.0:
        raise ValueError(f"wsd_decay_ratio must be in (0, 1], got {decay_ratio}")
