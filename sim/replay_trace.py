"""Replay the real InfiniteHBD half-trace against every strategy: ``python -m sim.replay_trace``.

    python -m sim.replay_trace [--out experiments/results/sim/replay_infinitehbd] [--seeds 1]
                               [--job-nodes 368] [--spares 32] [override ...]

The job runs on ``--job-nodes`` of the trace's 400 servers (8 GPUs each), ``--spares`` of the
rest form the pool, and the remaining servers are outside the allocation; which server holds
which slot is a seeded shuffle (seed k for k < ``--seeds``). Every fault start takes its server
away until the trace's ``fault_end`` (``sim.infinitehbd``); its class decides how it is detected
(``hang_causes``, ``node_causes`` of the calibration; software faults are transient). Every
strategy of ``sim/conf/sim.yaml``'s ``strategies`` list (plus ``deadpool_shrink``) replays the same
placement. Extra arguments are Hydra overrides of sim/conf/sim.yaml (``calibration=...``).

Writes into ``--out``: ``summary.csv`` (one row per strategy and seed, as ``sim.run``),
``aggregate.csv``, ``timeline.csv`` (seed 0: ``strategy, time_d, progress_d``, the job's kept
progress against wall time; the ideal is the diagonal) and ``servers.csv`` (seed 0: ``slot,
role, start_d, end_d, cause``: every fault of a server in the allocation, ``role`` job or spare
by its slot at t = 0). ``paper_figures/fig14_trace_replay.py`` draws the timeline.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sim.config
from sim import infinitehbd, report
from sim.layout import Layout
from sim.simulate import job_mtbf_s, make_trace, run_one, scenario_columns
from sim.trace import DAY_S

OUT = sim.config.REPO_ROOT / "experiments" / "results" / "sim" / "replay_infinitehbd"
EXTRA = ("deadpool_shrink",)


def compose_cfg(overrides: list[str]) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        return OmegaConf.to_container(compose("sim", overrides=list(overrides)), resolve=True)


def replay(job_nodes: int = 368, spares: int = 32, seeds: int = 1, overrides: list[str] | None = None,
           timeline: bool = True) -> tuple[list[dict], list[dict], list[dict]]:
    """(summary rows, timeline rows, server rows) of every strategy on the half-trace."""
    ov = ["trace=infinitehbd", f"cluster.num_gpus={job_nodes * infinitehbd.GPUS_PER_SERVER}",
          f"cluster.num_spares={spares}", "+strategy@strategy.deadpool_shrink=deadpool_shrink"] + list(overrides or [])
    cfg = compose_cfg(ov)
    layout = Layout.from_cfg(cfg["cluster"])
    horizon = float(cfg["duration_days"]) * DAY_S
    names = list(dict.fromkeys(list(cfg["strategies"]) + list(EXTRA)))
    rows, tl, servers = [], [], []
    for seed in range(seeds):
        trace = make_trace(cfg["trace"], layout, horizon, seed)
        mtbf = job_mtbf_s(cfg["trace"], layout, trace)
        common = scenario_columns(cfg, layout, mtbf)
        for name in names:
            log = [] if (timeline and seed == 0) else None
            r = run_one(name, cfg["strategy"][name], cfg["calibration"], layout, trace, horizon, mtbf, log)
            rows.append({"strategy": name, "seed": seed, **common, **r})
            for t, w in (log or []):
                tl.append({"strategy": name, "time_d": t / DAY_S, "progress_d": w / DAY_S})
        if seed == 0:
            for t, n, d, c in zip(trace.time_s, trace.node, trace.duration_s, trace.cause):
                if n < layout.num_nodes + layout.num_spares:
                    servers.append({"slot": int(n), "role": "job" if n < layout.num_nodes else "spare",
                                    "start_d": t / DAY_S, "end_d": (t + d) / DAY_S, "cause": trace.causes[c]})
    return rows, tl, servers


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--seeds", type=int, default=1, help="server placements (seed k: shuffle k)")
    ap.add_argument("--job-nodes", type=int, default=368)
    ap.add_argument("--spares", type=int, default=32)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of sim/conf/sim.yaml")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows, tl, servers = replay(a.job_nodes, a.spares, a.seeds, a.overrides)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _, agg = report.write(rows, out)
    _write(out / "timeline.csv", tl)
    _write(out / "servers.csv", servers)
    print(f"[replay_trace] InfiniteHBD days 0-{infinitehbd.HORIZON_DAYS:g}: {a.job_nodes} servers + {a.spares} spares, "
          f"{a.seeds} placement(s), {time.perf_counter() - t0:.1f} s -> {out}", file=sys.stderr)
    print(report.table(agg))


if __name__ == "__main__":
    main()
