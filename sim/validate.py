"""Validation against published fleet outcomes: ``python -m sim.validate --out DIR``.

Configures the simulator from published inputs (scale, duration, failure rate and cause mix,
storage bandwidth, and, where a publication gives them, recovery stalls) with the GPU profile's
costs for everything else, never fitting anything to the outcome it is compared with, and
writes ``DIR/validation.csv`` (columns ``fleet, metric, published, simulated, source``; rates and
ETTRs as fractions, stalls in minutes, counts as counts) and ``DIR/validation.md`` (the same
table with a line on each miss). Fleets:

- ``llama3_16k``: Llama 3 405B pre-training, 16,384 H100, 54 days: 419 unexpected
  interruptions (in-sample: the trace's rate is derived from this count, so it checks the
  generator and the cluster replay) and "> 90 %" effective training time (out of sample: the
  restart and checkpoint costs are the profile's, not fitted). Checkpoint/restart, as Llama 3 ran.
- ``ft_hsdp_100k``: Meta's FT-HSDP at ~100k GPUs (98,304 = 768 replicas of tp8 x pp16):
  synchronous training stalls ~10 min per failure and reaches 44 % ETTR; FT-HSDP stalls ~3 min
  and reaches 80 %. The failure rate is not in the publication: Llama 3's per-node rate is
  used (a borrowed input). Two configurations: (a) the profile's own recovery costs (the stalls
  are then outcomes too); (b) the published stalls as inputs (only the failure model and the
  ETTR accounting are then tested).
- ``byterobust_9600``: ByteRobust, 9,600 GPUs, three months: 97 % ETTR. Restart-based recovery
  onto warm standbys with near-zero-overhead checkpoints: the in-memory-checkpoint-with-restart
  strategy. Failure rate and model are not in the abstract: Llama 3's per-node rate and the
  405B layout are used (borrowed inputs).

Seeds are few (``--seeds``); each simulated value is a mean over them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path
from typing import Callable

import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sim.config
from sim import costs
from sim.layout import Layout
from sim.simulate import run_scenario

LLAMA3 = "Llama 3 herd of models (arXiv 2407.21783): 16,384 H100, 54 days, 419 unexpected interruptions"
FTHSDP = "Meta, Training LLMs with Fault Tolerant HSDP on 100,000 GPUs (arXiv 2602.00277)"
BYTEROBUST = "ByteRobust (arXiv 2509.16293): 97 % ETTR, 3-month job on 9,600 GPUs"
# the published stalls as inputs: every cost but the stall set to zero, the stall put in one place
SYNC_STALL_10MIN = ["calibration.detect_crash_s=0", "calibration.detect_hang_s=0", "calibration.requeue_s=600",
                    "calibration.launch_base_s=0", "calibration.launch_per_log2_nodes_s=0",
                    "calibration.ckpt_latency_s=0", "calibration.storage_read_gbps=1e30",
                    "calibration.restart_warmup_steps=0"]
FT_STALL_3MIN = ["calibration.detect_crash_s=0", "calibration.detect_hang_s=0", "calibration.plan_s=0",
                 "calibration.rebuild_base_s=180", "calibration.rebuild_per_log2_gpus_s=0",
                 "calibration.transfer_latency_s=0", "calibration.transfer_gbps_per_node=1e30",
                 "calibration.warmup_steps=0", "calibration.ckpt_latency_s=0", "calibration.storage_read_gbps=1e30"]


@dataclasses.dataclass
class Metric:
    name: str
    published: float
    simulated: Callable[[list[dict], dict], float]  # (rows, composed config) -> value
    source: str
    note: str = ""
    sample: str = "out"  # "in": the published value was an input (or fitted) to the configuration compared with it
    fitted: str = "nothing fitted to this outcome"  # what was fitted on what


@dataclasses.dataclass
class Run:
    fleet: str
    overrides: list[str]
    metrics: list[Metric]


def compose_cfg(overrides: list[str]) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        return OmegaConf.to_container(compose("sim", overrides=list(overrides)), resolve=True)


def mean_of(strategy: str, key: str = "goodput") -> Callable[[list[dict], dict], float]:
    return lambda rows, cfg: float(np.mean([r[key] for r in rows if r["strategy"] == strategy]))


def sync_stall_min(rows, cfg) -> float:
    """A synchronous job's stall per crash: detection + restart (requeue, relaunch, load, warm-up)."""
    lay, c = Layout.from_cfg(cfg["cluster"]), cfg["calibration"]
    return (costs.detection(c, lay).crash_s + costs.restart_s(lay, c)) / 60.0


def ft_stall_min(rows, cfg) -> float:
    """FT-HSDP's stall per crash: detection + dropping the replica in place (plan + rebuild)."""
    lay, c = Layout.from_cfg(cfg["cluster"]), cfg["calibration"]
    rc = costs.reconfig(lay, c)
    return (costs.detection(c, lay).crash_s + rc.plan_s + rc.rebuild_s) / 60.0


def runs(seeds: int, days_100k: float) -> list[Run]:
    ft = ["cluster.num_gpus=98304", f"duration_days={days_100k:g}", "trace=llama3", f"seeds={seeds}",
          "strategy.checkpoint_restart.restart_in_allocation=false"]  # the published synchronous baseline requeued
    return [
        Run("llama3_16k", ["cluster.num_gpus=16384", "duration_days=54", "trace=llama3",
                           "strategies=[checkpoint_restart]", "strategy.checkpoint_restart.restart_in_allocation=false",
                           f"seeds={seeds}"], [
            Metric("unexpected_interruptions", 419, mean_of("checkpoint_restart", "failures"), LLAMA3,
                   "in-sample: the trace's rate (3.79 per 1,000 node-days) is derived from this count; repaired nodes wait "
                   "in the pool, so slightly fewer failures reach the job than the trace holds",
                   sample="in", fitted="the trace's rate fitted on this count (419 / 2,048 nodes / 54 days)"),
            Metric("ettr", 0.90, mean_of("checkpoint_restart"), LLAMA3 + ', "> 90 % effective training time" (a lower bound)',
                   "out of sample: restart 5.5-6 min and checkpoint costs are the gpu_h100 profile's assumptions"),
        ]),
        Run("ft_hsdp_100k", ft + ["strategies=[checkpoint_restart,elastic_hsdp]"], [
            Metric("recovery_stall_min_synchronous", 10.0, sync_stall_min, FTHSDP,
                   "the profile's detection + requeue + relaunch + load + warm-up at 12,288 nodes"),
            Metric("recovery_stall_min_ft_hsdp", 3.0, ft_stall_min, FTHSDP,
                   "the profile's detection + plan + communicator rebuild (2 + 2 log2 GPUs s)"),
            Metric("ettr_synchronous", 0.44, mean_of("checkpoint_restart"), FTHSDP + "; failure rate: Llama 3's per node",
                   "the profile's costs; failure rate borrowed from Llama 3"),
            Metric("ettr_ft_hsdp", 0.80, mean_of("elastic_hsdp"), FTHSDP + "; failure rate: Llama 3's per node",
                   "elastic with a replicated optimizer, in place; failure rate borrowed from Llama 3"),
        ]),
        Run("ft_hsdp_100k_published_stalls", ft + SYNC_STALL_10MIN + ["strategies=[checkpoint_restart]"], [
            Metric("ettr_synchronous", 0.44, mean_of("checkpoint_restart"), FTHSDP + "; stall 10 min as input",
                   "the published 10 min stall as the restart cost; failure rate borrowed from Llama 3",
                   fitted="the cost profile fitted to Meta's stalls (restart = 10 min); not to the ETTR"),
        ]),
        Run("ft_hsdp_100k_published_stalls", ft + FT_STALL_3MIN + ["strategies=[elastic_hsdp]"], [
            Metric("ettr_ft_hsdp", 0.80, mean_of("elastic_hsdp"), FTHSDP + "; stall 3 min as input",
                   "the published 3 min stall as the reconfiguration cost (shrink and regrow); failure rate from Llama 3",
                   fitted="the cost profile fitted to Meta's stalls (reconfiguration = 3 min); not to the ETTR"),
        ]),
        Run("byterobust_9600", ["cluster.num_gpus=9600", "duration_days=90", "trace=llama3",
                                "strategies=[inmem_restart]", f"seeds={seeds}"], [
            Metric("ettr", 0.97, mean_of("inmem_restart"), BYTEROBUST + "; failure rate and model: Llama 3's (borrowed)",
                   "restart onto warm standbys from in-memory checkpoints (inmem_restart), the profile's restart cost"),
        ]),
    ]


def trace_rows(replicates: int = 20) -> list[dict]:
    """The InfiniteHBD half-trace against the generator fitted on it (``sim.fit_trace``), in sample:
    medians and counts compared, each row's note giving the distribution test (KS D and p), and
    the generator's own days 0-174 (``sim.predict_trace.sample_future``, no trend, ``replicates``
    draws) for what only a sample shows (bursts, servers never hit)."""
    import math

    from scipy import stats

    from sim import fit_trace, infinitehbd, predict_trace

    eps = infinitehbd.load()
    model, rep = fit_trace.fit(eps)
    rng = np.random.default_rng(0)
    sims = [predict_trace.sample_future(model, [], rng, 1.0, 0.0, infinitehbd.HORIZON_DAYS) for _ in range(replicates)]
    starts = [len(f) for f in sims]
    disp = []
    for f in sims:
        daily = np.bincount(np.array([ep.start_d for ep in f]).astype(int), minlength=174)[:174]
        disp.append(daily.var(ddof=1) / daily.mean())
    src, fit_on = "InfiniteHBD trace, days 0-174 (sim/data/infinitehbd)", "fitted on days 0-174 (the same data)"
    pc, tb, rp = rep["per_server_counts"], rep["time_between_failures_d"], rep["repair_d"]

    def row(m, pub, simv, note):
        return {"fleet": "infinitehbd_400", "metric": m, "published": round(pub, 4), "simulated": round(simv, 4),
                "error": round(simv - pub, 4), "sample": "in", "fitted": fit_on, "source": src, "note": note}

    wk, _, wl = tb["weibull"]["params"]
    rk, _, rl = rp["weibull"]["params"]
    return [
        row("fault_starts", rep["fault_starts"], float(np.mean(starts)),
            f"the generator's days 0-174, {replicates} draws (sd {np.std(starts):.0f}); a down server cannot start a fault"),
        row("servers_without_faults", pc["zeros_observed"], pc["zeros_negative_binomial"],
            f"negative binomial (shape {pc['nb_shape']:.2f}); a Poisson gives {pc['zeros_poisson']:.0f} (LR p {pc['lr_p']:.1g})"),
        row("tbf_median_days", tb["median"], float(stats.weibull_min.median(wk, 0, wl)),
            f"Weibull k {wk:.2f}: KS D {tb['weibull']['ks_d']:.3f} p {tb['weibull']['ks_p']:.2g}; exponential KS p "
            f"{tb['exponential']['ks_p']:.1g} (rejected); p-values optimistic (parameters fitted on the same data)"),
        row("repair_median_days", rp["median"], float(stats.weibull_min.median(rk, 0, rl)),
            f"Weibull k {rk:.2f}: KS D {rp['weibull']['ks_d']:.3f} p {rp['weibull']['ks_p']:.2g}; lognormal KS p "
            f"{rp['lognormal']['ks_p']:.1g} (rejected); the sampler draws the observed repairs"),
        row("daily_dispersion_index", rep["bursts"]["daily_dispersion_index"], float(np.mean(disp)),
            f"variance/mean of faults per day; the generator's bursts (sd {np.std(disp):.1f}); a Poisson stream gives 1"
            + ("" if math.isfinite(np.mean(disp)) else " (undefined)")),
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for validation.csv and validation.md")
    ap.add_argument("--seeds", type=int, default=20, help="seeds per configuration (means are reported)")
    ap.add_argument("--days-100k", type=float, default=30.0, help="window at ~100k GPUs (ETTR is a rate)")
    ap.add_argument("--override", action="append", default=[],
                    help="extra Hydra override for every run (e.g. calibration=default)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = []
    for run in runs(a.seeds, a.days_100k):
        cfg = compose_cfg(run.overrides + ["progress=false"] + a.override)
        rows = run_scenario(cfg, progress=False)
        for m in run.metrics:
            sim_v = m.simulated(rows, cfg)
            table.append({"fleet": run.fleet, "metric": m.name, "published": m.published,
                          "simulated": round(sim_v, 4), "error": round(sim_v - m.published, 4), "sample": m.sample,
                          "fitted": m.fitted, "source": m.source, "note": m.note})
        print(f"[validate] {run.fleet}: done", file=sys.stderr, flush=True)
    table += trace_rows()
    with open(out / "validation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["fleet", "metric", "published", "simulated", "error", "sample", "fitted", "source"],
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(table)
    lines = ["| fleet | metric | published | simulated | error | sample | fitted on | note |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['fleet']} | {r['metric']} | {r['published']:g} | {r['simulated']:g} | {r['error']:+g} | {r['sample']} | "
              f"{r['fitted']} | {r['note']} |" for r in table]
    (out / "validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return table


if __name__ == "__main__":
    main()
