"""Loss and gradient-norm spikes: the rule that calls a step's numbers a spike, and the skipped
batches that make the data order after a rollback a pure function of the state.

A spike rolls the job back to the newest snapshot in memory at or before the step that saw it
(``recovery.integrity``: the rank reports, the coordinator caps the resume step) and the batch of
that step is skipped from then on. The data order stays a pure function of the step: step ``t``
reads data position ``position(t, skips)``, the ``t``-th position not in ``skips`` (sorted data
positions). ``skips`` travels in every snapshot header (``Trainer.header``), so a rank rolled back
or restored from a peer reads the same positions as its peers, and a failure-free run given the
same list (``ft.spike.skip_batches``) computes exactly the same steps.

Rules (``ft.spike.rule``)::

    nonfinite  the loss or the global gradient norm is inf or NaN
    zscore     nonfinite, or the loss is more than ``ft.spike.threshold`` standard deviations
               above the mean of the last ``ft.spike.window`` losses of this rank (checked once
               the window is full; the window is cleared by a rollback, so a replay re-learns it)
    off        never

Only the last pipeline stage sees a loss; the gradient norm (``grad_clip`` set) is the same on
every rank, so any rank may report it (the coordinator takes the first report of a generation).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque

RULES = ("off", "nonfinite", "zscore")


def position(step: int, skips: list[int]) -> int:
    """The data position step ``step`` reads: the ``step``-th position (from 0) not in ``skips``
    (sorted). Without skips it is the step itself."""
    p = step
    for s in skips:  # sorted: each skip at or below the running position pushes it one on
        if s <= p:
            p += 1
        else:
            break
    return p


def add_skip(skips: list[int], pos: int) -> list[int]:
    """``skips`` with ``pos`` added (sorted, no duplicates)."""
    out = sorted(set(skips))
    if pos not in out:
        bisect.insort(out, pos)
    return out


class SpikeRule:
    """``bad(loss, grad_norm) -> str | None``: why this step is a spike, or None."""

    def __init__(self, rule: str = "nonfinite", threshold: float = 6.0, window: int = 20):
        if rule not in RULES:
            raise ValueError(f"ft.spike.rule must be one of {RULES}, got {rule!r}")
        self.rule, self.threshold = rule, float(threshold)
        self.history: deque[float] = deque(maxlen=max(2, int(window)))

    @classmethod
    def from_cfg(cls, spike: dict | None) -> "SpikeRule":
        spike = spike or {}
        return cls(str(spike.get("rule", "nonfinite")), float(spike.get("threshold", 6.0)),
                   int(spike.get("window", 20)))

    def reset(self) -> None:
        """The state was replaced (a rollback): the losses seen belong to another timeline."""
        self.history.clear()

    def bad(self, loss: float | None, grad_norm: float | None) -> str | None:
        if self.rule == "off":
            return None
        for name, v in (("loss", loss), ("grad_norm", grad_norm)):
            if v is not None and not math.isfinite(v):
                return f"non-finite {name} ({v})"
        if loss is None:
            return None
        why = None
        if self.rule == "zscore" and len(self.history) == self.history.maxlen:
            mean, sd = statistics.fmean(self.history), statistics.pstdev(self.history)
            if sd > 0 and (loss - mean) / sd > self.threshold:
                why = f"loss {loss:.4f} is {(loss - mean) / sd:.1f} sd above the last " \
                      f"{len(self.history)} (threshold {self.threshold})"
        if why is None:
            self.history.append(float(loss))
        return why
