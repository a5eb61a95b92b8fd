"""Failure traces: a seeded, vectorised generator of per-node failure and maintenance events.

A trace is the input every strategy replays (common random numbers): one row per event with
the time, the physical node, the kind of event, its cause and how long the node is away. The
generator draws, for every node independently, a renewal process of times between unexpected
failures (exponential or Weibull). Nodes must not all start at age zero: with a Weibull shape
k < 1 that over-counts infant-mortality failures (about 2x at the llama3 scale). Each node's
first failure is therefore drawn from the equilibrium (stationary-excess) distribution, which
for a Weibull(k, lam) renewal process has the closed form ``lam * Gamma(1/k, 1) ** (1/k)``: its
CDF is the regularised incomplete gamma P(1/k, (x/lam)^k). The expected count of failures in
[0, T) is then exactly ``num_nodes * T / node_mttf`` for any shape.

Causes are drawn from a cause mix (the Llama 3 mix by default); causes listed as transient
(software, NCCL watchdog, host maintenance, dependency) recover in place after a short
downtime, all others need the node repaired (lognormal repair time, median ~1 h, mean ~3 h).
Planned maintenance is a Poisson stream over the cluster. Event rows for a node that is
already down are dropped at replay time (see ``sim.cluster``).

Options beyond independent nodes (all off by default):
- racks (correlated failures): nodes ``r*k .. r*k + r-1`` sit behind one rack switch
  (``nodes_per_rack``, from the cluster); each rack has its own Poisson failure process
  (``rack_failures_per_1000_rack_days``) that takes every node of the rack down at once (cause
  ``rack_switch``) for a lognormal rack repair;
- lemon nodes: a fraction ``lemon_node_frac`` of nodes fails ``lemon_rate_multiplier`` times as
  often as the others, with the fleet-wide rate unchanged (repeat offenders concentrate
  failures: each lemon's failures hit the same slot again and again);
- a hardware-RMA repair tail: a fraction ``rma_frac`` of permanent failures waits for a part or
  a replacement (lognormal, median ``rma_median_h``) instead of the usual repair.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

DAY_S = 86400.0
HOUR_S = 3600.0

# Event codes; the CSV stores the names.
FAIL, MAINTENANCE, REMOVE, ADD = 0, 1, 2, 3
EVENT_NAMES = ("fail", "maintenance", "remove", "add")

# Llama 3 405B pre-training, 54 days, 419 unexpected interruptions by cause (2nd-hand, from
# the Llama 3 paper's table as reported by secondary sources).
LLAMA3_CAUSE_MIX: dict[str, int] = {
    "faulty_gpu": 148, "gpu_hbm3": 72, "software_bug": 54, "network_switch_cable": 35,
    "host_maintenance": 32, "gpu_sram": 19, "gpu_system_processor": 17, "nic": 7,
    "nccl_watchdog": 7, "silent_data_corruption": 6, "gpu_thermal": 6, "ssd": 3, "psu": 3,
    "server_chassis": 2, "io_board": 2, "dependency": 2, "cpu": 2, "system_memory": 2,
}
# 95 / 419 = 22.7% transient, inside the published "roughly 20-25%".
LLAMA3_TRANSIENT = ("software_bug", "host_maintenance", "nccl_watchdog", "dependency")


@dataclasses.dataclass(frozen=True)
class TraceSpec:
    """Parameters of the generator (one ``trace=`` preset).

    The rate is per node: ``unexpected_per_1000_node_days`` = 3.79 gives a node MTTF of
    1000 / 3.79 = 264 days, i.e. 419 failures over 2,048 nodes x 54 days.
    """

    name: str
    unexpected_per_1000_node_days: float  # unexpected failures per 1,000 node-days
    tbf_distribution: str = "weibull"  # "exponential" | "weibull": time between failures
    weibull_shape: float = 0.7  # k < 1: decreasing hazard (HPC field data: 0.5-0.9)
    planned_per_1000_node_days: float = 0.0  # planned maintenance events per 1,000 node-days
    maintenance_duration_h: float = 2.0  # node away for planned maintenance
    repair_median_h: float = 1.0  # permanent failure: lognormal repair, median
    repair_mean_h: float = 3.0  # permanent failure: lognormal repair, mean (>= median)
    transient_downtime_median_s: float = 300.0  # transient: node reboots in place
    transient_downtime_sigma: float = 0.5  # lognormal sigma of the transient downtime
    rma_frac: float = 0.0  # permanent failures that need a hardware RMA instead
    rma_median_h: float = 24.0  # RMA repair: lognormal, median
    rma_mean_h: float = 48.0  # ... and mean
    rack_failures_per_1000_rack_days: float = 0.0  # whole-rack (switch/power) failures
    rack_repair_median_h: float = 2.0  # rack repair: lognormal, median
    rack_repair_mean_h: float = 4.0  # ... and mean
    lemon_node_frac: float = 0.0  # fraction of nodes that are repeat offenders
    lemon_rate_multiplier: float = 10.0  # their failure rate relative to the other nodes
    cause_mix: Mapping[str, float] = dataclasses.field(default_factory=lambda: dict(LLAMA3_CAUSE_MIX))
    transient_causes: Sequence[str] = LLAMA3_TRANSIENT

    @property
    def node_mttf_s(self) -> float:
        return 1000.0 / self.unexpected_per_1000_node_days * DAY_S

    @classmethod
    def from_cfg(cls, cfg: Mapping) -> "TraceSpec":
        """Build from the ``trace`` config node; unknown keys (loader options) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: cfg[k] for k in cfg if k in names}
        if "cause_mix" in kwargs:
            kwargs["cause_mix"] = dict(kwargs["cause_mix"])
        if "transient_causes" in kwargs:
            kwargs["transient_causes"] = tuple(kwargs["transient_causes"])
        return cls(**kwargs)


@dataclasses.dataclass
class Trace:
    """Events sorted by time. ``cause`` indexes ``causes``; ``duration_s`` is how long the node
    is away (repair, reboot or maintenance; 0 for add/remove, which pair up instead)."""

    time_s: np.ndarray
    node: np.ndarray
    event: np.ndarray
    cause: np.ndarray
    duration_s: np.ndarray
    causes: tuple[str, ...]
    transient_causes: frozenset[str]
    num_nodes: int
    horizon_s: float
    initially_down: np.ndarray | None = None  # nodes absent at t=0 (add/remove traces)

    def __len__(self) -> int:
        return len(self.time_s)

    @property
    def transient(self) -> np.ndarray:
        """Per row: whether a ``fail`` row recovers in place (no repair needed)."""
        flags = np.array([c in self.transient_causes for c in self.causes], dtype=bool)
        return flags[self.cause] if len(self.causes) else np.zeros(len(self), dtype=bool)

    def count(self, event: int, nodes: int | None = None) -> int:
        """Rows of one event kind, optionally only on nodes ``< nodes`` (the active slots)."""
        mask = self.event == event
        if nodes is not None:
            mask &= self.node < nodes
        return int(mask.sum())


def lognormal_sigma(median: float, mean: float) -> float:
    """sigma of a lognormal with the given median and mean (mean = median * e^(sigma^2/2))."""
    if mean < median:
        raise ValueError(f"lognormal mean {mean} must be >= median {median}")
    return math.sqrt(2.0 * math.log(mean / median)) if mean > median else 0.0


def _unit_intervals(spec: TraceSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """Times between failures with mean 1 (scaled by each node's MTTF by the caller)."""
    if spec.tbf_distribution == "exponential":
        return rng.exponential(1.0, n)
    k = spec.weibull_shape
    return rng.weibull(k, n) / math.gamma(1.0 + 1.0 / k)


def _intervals(spec: TraceSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    return spec.node_mttf_s * _unit_intervals(spec, rng, n)


def _first_arrivals(spec: TraceSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """Residual life at equilibrium (mean-1 units): each node is at a random age of a
    stationary process."""
    if spec.tbf_distribution == "exponential":
        return rng.exponential(1.0, n)
    if spec.tbf_distribution != "weibull":
        raise ValueError(f"tbf_distribution must be exponential or weibull, got {spec.tbf_distribution!r}")
    k = spec.weibull_shape
    return rng.gamma(1.0 / k, 1.0, n) ** (1.0 / k) / math.gamma(1.0 + 1.0 / k)


def node_mttf_s(spec: TraceSpec, num_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """Per-node MTTF. Lemons fail ``m`` times as often; the others' rate is scaled so that the
    fleet-wide rate stays ``1 / node_mttf_s``: r0 = r / (1 - f + f m)."""
    mttf = np.full(num_nodes, spec.node_mttf_s)
    f = spec.lemon_node_frac
    if f > 0:
        m = spec.lemon_rate_multiplier
        lemons = rng.random(num_nodes) < f
        scale = 1.0 - f + f * m
        mttf = np.where(lemons, spec.node_mttf_s * scale / m, spec.node_mttf_s * scale)
    return mttf


def failure_times(spec: TraceSpec, rng: np.random.Generator, num_nodes: int,
                  horizon_s: float, mttf: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-node renewal processes on [0, horizon_s), vectorised over nodes and failures.

    Returns (times, nodes), unsorted. Each round draws a block of intervals per node that
    is still inside the horizon (sized from the expected count), so a round is one numpy
    call whether there are 2,000 nodes with one failure each or one node with 10^5.
    """
    mttf = np.full(num_nodes, spec.node_mttf_s) if mttf is None else mttf
    t = _first_arrivals(spec, rng, num_nodes) * mttf
    nodes = np.arange(num_nodes)
    expected = horizon_s / float(mttf.min())
    block = int(expected + 6.0 * math.sqrt(expected) + 4)
    inside = t < horizon_s
    out_t, out_n = [t[inside]], [nodes[inside]]
    idx = nodes[inside]
    while len(idx):
        steps = _unit_intervals(spec, rng, len(idx) * block).reshape(len(idx), block) * mttf[idx, None]
        times = t[idx, None] + np.cumsum(steps, axis=1)
        keep = times < horizon_s
        out_t.append(times[keep])
        out_n.append(np.broadcast_to(idx[:, None], times.shape)[keep])
        t[idx] = times[:, -1]
        idx = idx[t[idx] < horizon_s]
    return np.concatenate(out_t), np.concatenate(out_n).astype(np.int64)


def rack_failures(spec: TraceSpec, rng: np.random.Generator, num_nodes: int, nodes_per_rack: int,
                  horizon_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Whole-rack failures: (times, nodes, durations), one row per node of each failed rack."""
    rate = spec.rack_failures_per_1000_rack_days / 1000.0 / DAY_S
    racks = math.ceil(num_nodes / max(1, nodes_per_rack))
    if rate <= 0 or nodes_per_rack < 1:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0)
    n = rng.poisson(rate * racks * horizon_s)
    t = rng.uniform(0.0, horizon_s, n)
    rack = rng.integers(0, racks, n)
    d = rng.lognormal(math.log(spec.rack_repair_median_h * HOUR_S),
                      lognormal_sigma(spec.rack_repair_median_h, spec.rack_repair_mean_h), n)
    members = rack[:, None] * nodes_per_rack + np.arange(nodes_per_rack)[None, :]
    ok = members < num_nodes
    return (np.broadcast_to(t[:, None], members.shape)[ok], members[ok].astype(np.int64),
            np.broadcast_to(d[:, None], members.shape)[ok])


def generate(spec: TraceSpec, num_nodes: int, horizon_s: float, seed: int, nodes_per_rack: int = 1) -> Trace:
    """Draw one trace. Deterministic in (spec, num_nodes, horizon_s, seed, nodes_per_rack); the
    failure, cause, repair, maintenance, lemon, rack and RMA streams are independent children of
    ``seed`` so that changing one (e.g. maintenance rate) leaves the others unchanged."""
    s_fail, s_cause, s_dur, s_maint, s_lemon, s_rack, s_rma = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(7))
    ft, fn = failure_times(spec, s_fail, num_nodes, horizon_s, node_mttf_s(spec, num_nodes, s_lemon))

    causes = tuple(spec.cause_mix) + ("planned", "rack_switch")
    weights = np.array([spec.cause_mix[c] for c in spec.cause_mix], dtype=float)
    fc = s_cause.choice(len(weights), size=len(ft), p=weights / weights.sum())
    transient = np.isin(fc, [causes.index(c) for c in spec.transient_causes if c in causes])
    repair = s_dur.lognormal(math.log(spec.repair_median_h * HOUR_S),
                             lognormal_sigma(spec.repair_median_h, spec.repair_mean_h), len(ft))
    reboot = s_dur.lognormal(math.log(max(spec.transient_downtime_median_s, 1e-300)),
                             spec.transient_downtime_sigma, len(ft))
    if spec.transient_downtime_median_s <= 0:
        reboot[:] = 0.0
    if spec.rma_frac > 0:
        rma = s_rma.lognormal(math.log(spec.rma_median_h * HOUR_S),
                              lognormal_sigma(spec.rma_median_h, spec.rma_mean_h), len(ft))
        repair = np.where(s_rma.random(len(ft)) < spec.rma_frac, rma, repair)
    fd = np.where(transient, reboot, repair)
    rt, rn, rd = rack_failures(spec, s_rack, num_nodes, nodes_per_rack, horizon_s)

    rate = spec.planned_per_1000_node_days / 1000.0 / DAY_S * num_nodes
    n_m = s_maint.poisson(rate * horizon_s) if rate > 0 else 0
    mt = s_maint.uniform(0.0, horizon_s, n_m)
    mn = s_maint.integers(0, num_nodes, n_m)

    time_s = np.concatenate([ft, mt, rt])
    order = np.argsort(time_s, kind="stable")
    return Trace(
        time_s=time_s[order],
        node=np.concatenate([fn, mn, rn]).astype(np.int64)[order],
        event=np.concatenate([np.full(len(ft), FAIL), np.full(n_m, MAINTENANCE),
                              np.full(len(rt), FAIL)]).astype(np.int8)[order],
        cause=np.concatenate([fc, np.full(n_m, len(causes) - 2), np.full(len(rt), len(causes) - 1)]
                             ).astype(np.int16)[order],
        duration_s=np.concatenate([fd, np.full(n_m, spec.maintenance_duration_h * HOUR_S), rd])[order],
        causes=causes,
        transient_causes=frozenset(spec.transient_causes),
        num_nodes=num_nodes,
        horizon_s=float(horizon_s),
    )
