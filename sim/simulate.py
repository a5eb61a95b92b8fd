"""Run scenarios: one trace per seed, replayed against every selected strategy.

``run_one`` replays one trace against one strategy and returns a flat result row;
``run_scenario`` loops over seeds and strategies (common random numbers: every strategy sees
the same trace for a given seed) and reports progress on stderr.

The job runs for a fixed wall-clock window (``duration_days``) and we measure the useful work
done in it; work in progress when the window closes counts as useful (the window is a
measurement interval of a longer run, not the end of training).

Goodput definitions (REFERENCE.md): job goodput (ETTR) = kept progress at nominal speed /
wall time; fleet goodput = job goodput x active GPUs / (active + charged spare + redundant
GPUs), where spares are charged to strategies that reserve them (``uses_spares``).
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Mapping

import simpy

from sim import costs, strategies
from sim.cluster import Cluster
from sim.layout import Layout
from sim.ledger import BUCKETS, COUNTERS, Ledger
from sim.trace import DAY_S, FAIL, HOUR_S, REMOVE, Trace, TraceSpec, generate
from sim.trace_io import load_addremove, load_csv


class CountingEnvironment(simpy.Environment):
    """A SimPy environment that counts processed events (for the events-vs-failures check)."""

    def __init__(self) -> None:
        super().__init__()
        self.events_processed = 0

    def step(self) -> None:
        self.events_processed += 1
        super().step()


def make_trace(tcfg: Mapping, layout: Layout, horizon_s: float, seed: int) -> Trace:
    """The trace for one seed: generated over active + spare nodes, or loaded from a file."""
    source = tcfg.get("source", "generate")
    if source == "generate":
        return generate(TraceSpec.from_cfg(tcfg), layout.num_nodes + layout.num_spares, horizon_s, seed,
                        nodes_per_rack=layout.nodes_per_rack)
    if source == "csv":
        return load_csv(tcfg["path"], horizon_s=horizon_s)
    if source == "infinitehbd":  # the real trace shipped in sim/data/infinitehbd (sim.infinitehbd)
        from sim import infinitehbd

        horizon_d = horizon_s / DAY_S
        if horizon_d > infinitehbd.HORIZON_DAYS + 1e-9:
            raise ValueError(f"duration_days={horizon_d:g} is past the shipped trace's {infinitehbd.HORIZON_DAYS:g} days")
        eps = infinitehbd.load(tcfg.get("path") or infinitehbd.HALF_TRACE)
        return infinitehbd.to_trace(eps, layout.num_nodes, layout.num_spares, seed, horizon_d)
    if source == "addremove":
        return load_addremove(tcfg["path"], time_unit_s=float(tcfg.get("time_unit_s", 1.0)),
                              horizon_s=horizon_s, num_nodes=layout.num_nodes + layout.num_spares)
    raise ValueError(f"trace.source must be generate, csv, addremove or infinitehbd, got {source!r}")


def job_mtbf_s(tcfg: Mapping, layout: Layout, trace: Trace | None = None) -> float:
    """Mean time between unexpected failures of the job (used for Daly-optimal intervals)."""
    if tcfg.get("source", "generate") == "generate":
        spec = TraceSpec.from_cfg(tcfg)
        racks = -(-layout.num_nodes // max(1, layout.nodes_per_rack))
        rate = layout.num_nodes / spec.node_mttf_s + spec.rack_failures_per_1000_rack_days / 1000.0 / DAY_S * racks
        return 1.0 / rate
    assert trace is not None
    hits = int((((trace.event == FAIL) | (trace.event == REMOVE)) & (trace.node < layout.num_nodes)).sum())
    return trace.horizon_s / hits if hits else float("inf")


def run_one(name: str, scfg: Mapping, calib: Mapping, layout: Layout, trace: Trace,
            horizon_s: float, mtbf_s: float, progress_log: list | None = None) -> dict:
    """Replay ``trace`` against strategy ``name`` for ``horizon_s`` seconds; one result row.
    ``progress_log``: a list that receives the job's (time_s, progress_s) points (a timeline)."""
    t_start = time.perf_counter()
    env = CountingEnvironment()
    ledger = Ledger()
    spares = layout.num_spares if strategies.uses_spares(scfg) else 0
    cluster = Cluster(env, trace, layout.num_nodes, spares, ledger, costs.detection(calib, layout))
    kind = scfg.get("kind", name)
    job = strategies.build(kind, env, cluster, layout, ledger, scfg, calib, mtbf_s)
    job.progress_log = progress_log
    env.run(until=horizon_s)
    job.finalize()
    goodput = job.W / horizon_s
    redundant = strategies.redundant_gpus(kind, scfg, layout.num_gpus)
    charged = layout.num_gpus + spares * layout.gpus_per_node + redundant
    row = {
        "strategy": name,
        "goodput": goodput,
        "fleet_goodput": goodput * layout.num_gpus / charged,
        **ledger.counts,
        "useful_h": job.W / HOUR_S,
        **{f"badput_{b}_h": ledger.badput_s[b] / HOUR_S for b in BUCKETS},
        "accounting_error_s": horizon_s - job.W - sum(ledger.badput_s.values()),
        "charged_spare_nodes": spares,
        "redundant_gpus": redundant,
        "events": env.events_processed,
        "sim_wall_s": time.perf_counter() - t_start,
    }
    return row


def scenario_columns(cfg: Mapping, layout: Layout, mtbf_s: float) -> dict:
    t = cfg["trace"]
    snap = costs.snapshots(layout, cfg["calibration"])
    return {
        "trace": t.get("name", t.get("source", "")),
        "num_gpus": layout.num_gpus,
        "num_nodes": layout.num_nodes,
        "num_spares": layout.num_spares,
        "gpus_per_node": layout.gpus_per_node,
        "unexpected_per_1000_node_days": t.get("unexpected_per_1000_node_days", float("nan")),
        "job_mtbf_h": mtbf_s / HOUR_S,
        "duration_days": float(cfg["duration_days"]),
        "step_time_s": layout.step_time_s,
        # the shared snapshot engine at this scale (sim.network)
        "snapshot_overhead_frac": snap.overhead_frac,
        "snapshot_interval_steps": snap.net.interval_steps,
        "replicate_lag_s": snap.lag_s,
        "nic_util": snap.net.nic_util,
    }


def run_scenario(cfg: Mapping, progress: bool = True, trace_dir=None) -> list[dict]:
    """Every seed x every selected strategy. ``cfg`` is the composed sim/conf/sim.yaml."""
    layout = Layout.from_cfg(cfg["cluster"])
    horizon = float(cfg["duration_days"]) * DAY_S
    names = list(cfg["strategies"])
    for n in names:
        if n not in cfg["strategy"]:
            raise ValueError(f"strategies lists {n!r}, but there is no strategy.{n} config; "
                             f"known: {', '.join(cfg['strategy'])}")
    seeds = range(int(cfg.get("seed_offset", 0)), int(cfg.get("seed_offset", 0)) + int(cfg["seeds"]))
    rows = []
    t0 = time.perf_counter()
    for i, seed in enumerate(seeds):
        trace = make_trace(cfg["trace"], layout, horizon, seed)
        if trace_dir is not None:
            from sim.trace_io import save_csv
            save_csv(trace, f"{trace_dir}/trace_seed{seed}.csv")
        mtbf = job_mtbf_s(cfg["trace"], layout, trace)
        common = scenario_columns(cfg, layout, mtbf)
        for name in names:
            row = run_one(name, cfg["strategy"][name], cfg["calibration"], layout, trace, horizon, mtbf)
            rows.append({"strategy": name, "seed": seed, **common, **row})
        if progress:
            done = i + 1
            print(f"[sim] seed {done}/{len(seeds)} done ({len(trace)} trace events, "
                  f"{time.perf_counter() - t0:.1f}s elapsed)", file=sys.stderr, flush=True)
    return rows


__all__ = ["run_one", "run_scenario", "make_trace", "job_mtbf_s", "COUNTERS"]
