"""Failure-free cost of the per-step snapshot, built from its parts.

A calibration either gives the whole cost as one measured number (``snapshot_overhead_frac``: an
in-run A/B on the hardware it was measured on, e.g. the CPU calibrations) or leaves it ``null``
and gives the parts, each with its own source (the GPU profiles). Per snapshot (every ``k``
steps, ``k`` from ``sim.network``), with ``step`` the step time:

1. **issue**: training-thread time that issues one copy per state tensor
   (``snapshot_issue_s``); only ``snapshot_issue_exposed_frac`` of it shows in the step time,
   because the thread normally runs ahead of queued GPU work (1 for a loop that syncs the host
   every step);
2. **copy not overlapped**: the device-to-host copy (``host_copy.copy_s``: the host link's rate, or the
   node's host memory shared by all its GPUs' copies, checksum reads and replication traffic,
   whichever is slower) may only run while forward+backward do (``snapshot_overlap_frac`` of a
   step: parameters change at the next optimizer step); the rest blocks that step
   (``sim.network`` books it);
3. **host contention**: while the copies run, compute slows by ``host_contention_frac`` (PCIe
   and memory-controller interference with the GPU's own host traffic);
4. **checksum**: each rank's copier thread hashes its snapshot (``checksum_gbps``); when that
   outlasts the interval, ``snapshot()`` waits for a free slot (backpressure), or the interval
   widens (``on_nic_overflow: widen``);
5. **NIC share**: replication against gradient, pipeline-activation and storage traffic
   (``sim.network``).

Analytic expectation (tests/sim/test_overhead.py): with everything overlapped and fitting,
``overhead = (issue_s * exposed + contention * copy_s) / (k * step)``; the measured on/off ratio
of the H100 check (1.0043 at a 0.95 s step with a 0.32 s copy) is reproduced by either end of
the split between issue and contention that ``sim/conf/calibration/gpu_h100.yaml`` documents.

    python -m sim.overhead [calibration=gpu_h100] [cluster.num_gpus=131072 ...]   # the parts, printed
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from sim import network
from sim.host_copy import overlap_window_s
from sim.layout import Layout


@dataclasses.dataclass(frozen=True)
class Parts:
    """Each part as a fraction of step time (``copy_over`` and ``nic`` come from ``sim.network``)."""

    issue: float
    copy_over: float
    contention: float
    checksum: float
    nic: float

    @property
    def total(self) -> float:
        return self.issue + self.copy_over + self.contention + self.checksum + self.nic


def from_parts(c: Mapping) -> bool:
    """True when the calibration builds the overhead from its parts (``snapshot_overhead_frac: null``)."""
    return c.get("snapshot_overhead_frac") is None


def host_side_s(layout: Layout, c: Mapping, copy: float) -> float:
    """Seconds one snapshot costs the step beside the copy overflow and the NIC: exposed issue
    time and the contention while the copy overlaps compute (0 for a measured total)."""
    if not from_parts(c):
        return 0.0
    issue = float(c["snapshot_issue_s"]) * float(c["snapshot_issue_exposed_frac"])
    contention = float(c["host_contention_frac"]) * min(copy, overlap_window_s(layout, c))
    return issue + contention


def parts(layout: Layout, c: Mapping) -> Parts:
    """The overhead of the shared snapshot engine at this layout, by part (fractions of a step)."""
    net = network.plan(layout, c)
    per = net.interval_steps * layout.step_time_s
    if not from_parts(c):
        return Parts(issue=float(c["snapshot_overhead_frac"]), copy_over=net.copy_over_frac, contention=0.0,
                     checksum=net.checksum_frac, nic=net.nic_frac)
    issue = float(c["snapshot_issue_s"]) * float(c["snapshot_issue_exposed_frac"]) / per
    contention = float(c["host_contention_frac"]) * min(net.d2h_s, overlap_window_s(layout, c)) / per
    return Parts(issue=issue, copy_over=net.copy_over_frac, contention=contention, checksum=net.checksum_frac,
                 nic=net.nic_frac)


def overhead_frac(layout: Layout, c: Mapping) -> float:
    """Total failure-free snapshot overhead, fraction of a step (what ``costs.snapshots`` charges)."""
    return parts(layout, c).total


def main(argv: list[str] | None = None) -> None:
    import sys

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import sim.config

    overrides = list(sys.argv[1:] if argv is None else argv)
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        cfg = OmegaConf.to_container(compose("sim", overrides=overrides), resolve=True)
    lay = Layout.from_cfg(cfg["cluster"])
    p = parts(lay, cfg["calibration"])
    print(f"calibration {cfg['calibration'].get('name')}: {lay.num_gpus} GPUs, step {lay.step_time_s:.3f} s, "
          f"state {lay.state_bytes_per_gpu / 1e9:.2f} GB per GPU")
    for f in dataclasses.fields(p):
        print(f"  {f.name:<11} {100 * getattr(p, f.name):8.4f} %")
    print(f"  {'total':<11} {100 * p.total:8.4f} %")
    if not math.isfinite(p.total):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
