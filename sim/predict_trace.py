"""The prediction for the InfiniteHBD trace's unseen half: ``python -m sim.predict_trace``.

    python -m sim.predict_trace [--replicates 200] [--out experiments/results/sim/validation]

Made from days 0-174 only (``sim.fit_trace``) and written before any comparison with days
174-348, for the same 400 servers, to ``prediction_days_174_348.json``: ``fault_starts``,
``unavailable_server_fraction`` (time-averaged over the window), ``median_repair_days`` (faults
that start in the window and end before day 348, as the trace can show them) and ``ettr`` per
strategy for a job on 368 servers with 32 spares, each ``{"mean", "lo", "hi"}`` with a 90 %
interval (5th-95th percentile over replicates).

Each replicate draws the uncertainty it can name, then one future:
1. parameters: the 400 servers resampled with replacement (their counts refit the negative
   binomial's shape and the rate), the bursts' sizes and the repair times resampled (the
   Weibull repair refit);
2. the trend: the data's Laplace test says the rate rose within days 0-174 while its two halves
   hold 160 and 152 faults; the future rate is the fitted rate times a multiplier drawn
   uniformly between 1 (no trend) and the log-linear trend continued (``exp(b * 174)``);
3. each of the same 400 servers gets a rate from its gamma posterior given its own count (a
   server that failed often keeps failing often), scaled by the multiplier;
4. days with faults arrive as a Poisson stream; each copies the pattern of a resampled day of
   the data (its bursts: faults starting together on several servers, at their times within the
   day), each burst picking that many distinct servers with probability proportional to their
   rates among the servers that are up (a down server cannot start a fault, as in the trace:
   rates are per up-time, the number of days scaled by the servers' up fraction in the data);
   a repair time is drawn from the (resampled) observed ones, so its shape is the data's, not a
   fit's (the Weibull fit passes its KS test but puts the median at 1.0 d against 1.3 d); the 3
   faults still open at day 174 end after a Weibull repair drawn given their elapsed time;
5. the job replays that future (``sim.infinitehbd.to_trace``, placement seed = replicate) for
   every strategy of ``sim.replay_trace``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats

from sim import fit_trace, infinitehbd
from sim.infinitehbd import Episode

T0, T1 = infinitehbd.HORIZON_DAYS, 2 * infinitehbd.HORIZON_DAYS


def resample_fit(model: fit_trace.Fit, episodes: list[Episode], rng: np.random.Generator) -> fit_trace.Fit:
    """Step 1: the parameters of one bootstrap replicate (servers, days' patterns, repairs)."""
    import dataclasses

    counts, expo = np.asarray(model.counts), np.asarray(model.exposure_d)
    idx = rng.integers(0, len(counts), len(counts))
    a, _, _ = fit_trace.fit_nb_shape(counts[idx], model.horizon_d)
    rep = fit_trace.repair_times(episodes)
    rep = rep[rng.integers(0, len(rep), len(rep))]
    k, _, lam = stats.weibull_min.fit(rep, floc=0)
    days = [model.day_patterns[i] for i in rng.integers(0, len(model.day_patterns), len(model.day_patterns))]
    rate = max(counts[idx].sum(), 1) / float(expo[idx].sum())
    return dataclasses.replace(model, rate_per_server_day=rate, nb_shape=a, repair_shape=float(k),
                               repair_scale_d=float(lam), repairs_d=tuple(float(x) for x in rep), day_patterns=tuple(days))


def sample_future(model: fit_trace.Fit, episodes: list[Episode], rng: np.random.Generator,
                  multiplier: float = 1.0, t0: float = T0, t1: float = T1) -> list[Episode]:
    """Steps 3-4: the faults of the same servers in [t0, t1) (open ones carried over)."""
    rates = model.server_rates(rng) * multiplier
    per_day = np.array([sum(n for _, n in d) for d in model.day_patterns], dtype=float)
    up_frac = np.asarray(model.exposure_d) / model.horizon_d  # as in the data: a down server starts nothing
    n_days = rng.poisson((rates * up_frac).sum() * (t1 - t0) / per_day.mean())
    starts = rng.uniform(t0, t1, n_days)
    bursts = sorted((d0 + off, n) for d0, i in zip(starts, rng.integers(0, len(per_day), n_days))
                    for off, n in model.day_patterns[i] if d0 + off < t1)
    causes = list(model.cause_counts)
    w = np.array([model.cause_counts[c] for c in causes], dtype=float)
    k, lam = model.repair_shape, model.repair_scale_d
    repairs = np.asarray(model.repairs_d)
    up_at = np.full(model.population, -np.inf)
    out: list[Episode] = []
    for ep in episodes:  # faults open at t0: the rest of their repair, given the time elapsed
        if ep.censored:
            e = t0 - ep.start_d
            rest = lam * ((e / lam) ** k - math.log(rng.random())) ** (1.0 / k)
            up_at[ep.server] = ep.start_d + rest
            out.append(Episode(ep.server, t0, ep.start_d + rest, "carried", ep.fault_class, ep.desc, False))
    for t, size in bursts:
        up = up_at <= t  # a burst's size counts servers that were up (a down server starts no fault)
        if not up.any():
            continue
        p = rates * up
        servers = rng.choice(model.population, size=min(size, int(up.sum())), replace=False, p=p / p.sum())
        cause = causes[rng.choice(len(causes), p=w / w.sum())]
        for s in servers:
            d = float(repairs[rng.integers(0, len(repairs))]) if len(repairs) else lam * rng.weibull(k)
            up_at[s] = t + d
            out.append(Episode(int(s), float(t), float(t + d), "sampled", cause, cause, False))
    return out


def window_metrics(eps: list[Episode], t0: float = T0, t1: float = T1, population: int = infinitehbd.POPULATION) -> dict:
    starts = [ep for ep in eps if ep.level != "carried" and t0 <= ep.start_d < t1]
    seen = [ep.repair_d for ep in starts if ep.end_d < t1]
    return {"fault_starts": len(starts),
            "unavailable_server_fraction": infinitehbd.unavailable_fraction(eps, t0, t1, population),
            "median_repair_days": float(np.median(seen)) if seen else float("nan")}


def _shifted(eps: list[Episode], t0: float) -> list[Episode]:
    """Episodes as a trace starting at ``t0`` (carried faults start at 0), for the replay."""
    return [Episode(ep.server, ep.start_d - t0, ep.end_d - t0, "sampled", ep.fault_class, ep.desc, False)
            for ep in eps]


def interval(values) -> dict:
    v = np.asarray([x for x in values if math.isfinite(x)], dtype=float)
    return {"mean": float(v.mean()), "lo": float(np.quantile(v, 0.05)), "hi": float(np.quantile(v, 0.95))}


def predict(replicates: int = 200, seed: int = 2024, job_nodes: int = 368, spares: int = 32,
            ettr: bool = True) -> dict:
    from sim.replay_trace import EXTRA, compose_cfg
    from sim.layout import Layout
    from sim.simulate import job_mtbf_s, run_one

    episodes = infinitehbd.load()
    model, report = fit_trace.fit(episodes)
    growth = math.exp(model.trend_per_day * (T1 - T0))
    rng = np.random.default_rng(seed)
    cfg = compose_cfg(["trace=infinitehbd", f"cluster.num_gpus={job_nodes * infinitehbd.GPUS_PER_SERVER}",
                       f"cluster.num_spares={spares}", "+strategy@strategy.deadpool_shrink=deadpool_shrink"])
    layout = Layout.from_cfg(cfg["cluster"])
    names = list(dict.fromkeys(list(cfg["strategies"]) + list(EXTRA)))
    horizon = (T1 - T0) * 86400.0
    metrics: dict[str, list] = {"fault_starts": [], "unavailable_server_fraction": [], "median_repair_days": []}
    ettrs: dict[str, list] = {n: [] for n in names}
    for b in range(replicates):
        m = resample_fit(model, episodes, rng)
        mult = rng.uniform(min(1.0, growth), max(1.0, growth))
        fut = sample_future(m, episodes, rng, mult)
        for k, v in window_metrics(fut).items():
            metrics[k].append(v)
        if ettr:
            # a sampled fault's class is a simulator cause already (cause_of keeps it as its slug)
            tr = infinitehbd.to_trace(_shifted(fut, T0), job_nodes, spares, seed=b, horizon_d=T1 - T0)
            mtbf = job_mtbf_s(cfg["trace"], layout, tr)
            for n in names:
                ettrs[n].append(run_one(n, cfg["strategy"][n], cfg["calibration"], layout, tr, horizon, mtbf)["goodput"])
    return {
        "made": datetime.date.today().isoformat(),
        "made_from": "days 0-174 of the InfiniteHBD trace only (sim/data/infinitehbd); written before any comparison with days 174-348",
        "method": "python -m sim.predict_trace: see its docstring (bootstrap over servers, bursts and repairs; trend multiplier "
                  f"uniform in [1, {growth:.3f}]; per-server gamma posterior rates per up-time; resampled days of bursts; resampled observed repairs)",
        "replicates": replicates, "seed": seed, "interval": "90 % (5th-95th percentile over replicates)",
        "servers": infinitehbd.POPULATION, "window_days": [T0, T1],
        **{k: interval(v) for k, v in metrics.items()},
        "median_repair_days_note": "faults that start in the window and end before day 348",
        "job": {"servers": job_nodes, "spares": spares, "gpus": job_nodes * infinitehbd.GPUS_PER_SERVER,
                "cluster": "h100_405b at 2,944 GPUs (tp8 x pp16, 23 replicas)", "calibration": "gpu_h100"},
        "ettr": {n: interval(v) for n, v in ettrs.items()} if ettr else {},
        "in_sample_days_0_174": {**window_metrics([ep for ep in episodes], 0.0, T0),
                                 "rate_per_1000_server_days": report["rate_per_1000_server_days"]},
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicates", type=int, default=200)
    ap.add_argument("--seed", type=int, default=2024)
    ap.add_argument("--out", default=str(fit_trace.OUT))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    pred = predict(a.replicates, a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prediction_days_174_348.json").write_text(json.dumps(pred, indent=1) + "\n")
    print(json.dumps({k: pred[k] for k in ("fault_starts", "unavailable_server_fraction", "median_repair_days")}, indent=1))
    print({k: round(v["mean"], 4) for k, v in pred["ettr"].items()}, f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return pred


if __name__ == "__main__":
    main()
