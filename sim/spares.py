"""Spare sizing: how many hot spares keep the probability that a failure finds the pool empty
below a target, given failure and repair rates.

Nodes leave (fail, reboot, go to maintenance) at total rate ``lam`` and each is away for a
random time with mean ``E[D]``; a returning node refills the pool. The number of nodes away is
then the occupancy of an M/G/infinity queue: Poisson with mean ``a = lam * E[D]`` whatever the
distribution of D (Palm's theorem). A job with ``S`` spares has an empty pool whenever ``S`` or
more nodes are away, and a failure sees the stationary distribution (PASTA), so

    P(stall per failure) = P(N >= S) = 1 - sum_{k<S} e^-a a^k / k!

and the spares needed for a target ``p`` are the smallest ``S`` with ``P(N >= S) <= p``. The
superposition of many nodes' renewal processes is close to Poisson (even with Weibull k < 1),
which ``tests/sim/test_spares.py`` checks against the simulator. Correlated (rack) failures
send several nodes away at once and break the Poisson assumption: not covered here.

    python -m sim.spares --nodes 2048 --target 0.01 [repair=rma_tail ...]
"""

from __future__ import annotations

import argparse
import math
from typing import Mapping

from scipy import stats

from sim.trace import DAY_S, HOUR_S, TraceSpec


def stall_probability(spares: int, load: float) -> float:
    """P(a failure finds the pool empty) with ``spares`` spares and mean ``load`` nodes away."""
    if spares <= 0:
        return 1.0
    return float(stats.poisson.sf(spares - 1, load))


def spares_needed(load: float, target: float) -> int:
    """Smallest S with ``stall_probability(S, load) <= target``."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target must be in (0, 1), got {target}")
    return int(stats.poisson.ppf(1.0 - target, load)) + 1


def mean_away_s(spec: TraceSpec) -> float:
    """Mean time a node is away per unexpected failure (transient reboots and repairs, RMA tail)."""
    w = {c: float(v) for c, v in spec.cause_mix.items()}
    transient = sum(v for c, v in w.items() if c in set(spec.transient_causes)) / sum(w.values())
    reboot = spec.transient_downtime_median_s * math.exp(spec.transient_downtime_sigma ** 2 / 2)
    repair = ((1.0 - spec.rma_frac) * spec.repair_mean_h + spec.rma_frac * spec.rma_mean_h) * HOUR_S
    return transient * reboot + (1.0 - transient) * repair


def offered_load(spec: TraceSpec, num_nodes: int) -> float:
    """Mean number of nodes away among ``num_nodes`` (failures + planned maintenance)."""
    fail = num_nodes / spec.node_mttf_s * mean_away_s(spec)
    maint = num_nodes * spec.planned_per_1000_node_days / 1000.0 / DAY_S * spec.maintenance_duration_h * HOUR_S
    return fail + maint


def size(tcfg: Mapping, num_nodes: int, target: float) -> dict:
    """Spares for ``num_nodes`` active nodes under the trace config ``tcfg`` (spares fail too:
    the load is computed over active + spare nodes, iterated to a fixed point)."""
    spec = TraceSpec.from_cfg(tcfg)
    s = 0
    for _ in range(20):
        load = offered_load(spec, num_nodes + s)
        nxt = spares_needed(load, target)
        if nxt == s:
            break
        s = nxt
    return {"num_nodes": num_nodes, "target": target, "load_nodes_away": load, "spares": s,
            "spare_frac": s / num_nodes, "stall_probability": stall_probability(s, load)}


def main(argv=None) -> None:
    import sim.config  # noqa: F401
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    ap = argparse.ArgumentParser(prog="python -m sim.spares", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--target", type=float, default=0.01)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of sim/conf/sim.yaml, e.g. repair=rma_tail")
    a = ap.parse_args(argv)
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        cfg = OmegaConf.to_container(compose("sim", overrides=a.overrides), resolve=True)
    r = size(cfg["trace"], a.nodes, a.target)
    print(f"{a.nodes} nodes, {r['load_nodes_away']:.1f} away on average: {r['spares']} spares "
          f"({100 * r['spare_frac']:.2f}%) for P(stall per failure) <= {a.target} (got {r['stall_probability']:.4f})")


if __name__ == "__main__":
    main()
