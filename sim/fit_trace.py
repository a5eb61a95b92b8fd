"""A failure generator fitted on the real half-trace: ``python -m sim.fit_trace``.

    python -m sim.fit_trace [--out experiments/results/sim/validation]

Fits, on the InfiniteHBD trace's days 0-174 only (``sim.infinitehbd``), every part of the
generator that ``sim.predict_trace`` samples from, and tests each against the data:

- **rate**: fault starts per 1,000 server-days over the 400 servers (and per 1,000 days *up*:
  a server that is down cannot start a fault, so the generator's rate is per up-time);
- **over-dispersion across servers**: per-server counts (the 241 servers that never failed
  included) against a Poisson (one rate for all) and a negative binomial (a gamma-distributed
  rate per server: shape ``nb_shape``, mean the fleet rate), by likelihood ratio and by the
  zero count; the negative binomial's posterior gives each of the same 400 servers its rate;
- **bursts**: faults that start at the same instant on several servers (one event touching a
  batch of servers): the batch-size distribution (empirical) and the dispersion index of daily
  counts (variance / mean; 1 for a Poisson stream). Bursts also cluster within days, so the
  generator resamples whole days' patterns (``day_patterns``), not single bursts;
- **time between failures** of a server (start to start): exponential vs Weibull by maximum
  likelihood (AIC, a likelihood-ratio test) and a Kolmogorov-Smirnov test of each;
- **repair time** (``fault_end - fault_start``, clipped at the trace's 1e-4-day resolution):
  lognormal vs Weibull (AIC, Kolmogorov-Smirnov);
- **class mix**: counts by simulator cause (``sim.infinitehbd.CAUSES``);
- **trend**: the Laplace test on the fault-start times over [0, 174) (z ~ N(0, 1) under a
  constant rate; z > 0: a rising rate) and the counts in each half.

The Kolmogorov-Smirnov p-values use parameters fitted on the same data, so they are optimistic
(a rejection is still a rejection). Writes ``fit_days_0_174.json`` (parameters and statistics)
and ``fit_curves.csv`` (tidy curves: ``panel, series, x, y`` for
``paper_figures/fig15_trace_fit.py``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from scipy import optimize, special, stats

from sim import infinitehbd
from sim.infinitehbd import Episode

RESOLUTION_D = 1e-4  # the trace's time resolution (days)
OUT = infinitehbd.DATA_DIR.parents[2] / "experiments" / "results" / "sim" / "validation"


@dataclasses.dataclass(frozen=True)
class Fit:
    """The fitted generator (what ``sim.predict_trace`` samples from)."""

    horizon_d: float
    population: int
    rate_per_server_day: float
    nb_shape: float  # gamma shape of the per-server rate (inf: Poisson)
    counts: tuple[int, ...]  # faults per server (index: ``Episode.server``; zeros padded to the population)
    batch_sizes: tuple[int, ...]  # servers per burst, one entry per burst (empirical)
    repair_shape: float  # Weibull repair time (days): the better fit (the lognormal is rejected)
    repair_scale_d: float
    cause_counts: dict[str, int]
    trend_per_day: float = 0.0  # log-linear intensity exp(a + b t): b (Cox-Lewis maximum likelihood)
    repairs_d: tuple[float, ...] = ()  # the observed repair times: the sampler draws from these (the shape exactly)
    exposure_d: tuple[float, ...] = ()  # each server's up time in the window (a down server cannot start a fault)
    day_patterns: tuple[tuple[tuple[float, int], ...], ...] = ()  # each day with faults: (offset in the day, burst size)

    @property
    def bursts_per_day(self) -> float:
        return len(self.batch_sizes) / self.horizon_d

    def server_rates(self, rng: np.random.Generator | None = None) -> np.ndarray:
        """Each server's rate per day: the gamma posterior mean (or a draw from it) given its count."""
        a = self.nb_shape
        n = np.asarray(self.counts, dtype=float)
        if not math.isfinite(a):
            return np.full(len(n), self.rate_per_server_day)
        b = a / self.rate_per_server_day  # prior Gamma(a, rate b): mean a / b = the fleet rate
        exposure = np.asarray(self.exposure_d) if len(self.exposure_d) else np.full(len(n), self.horizon_d)
        shape, rate = a + n, b + exposure
        return rng.gamma(shape, 1.0 / rate) if rng is not None else shape / rate


def batches(episodes: list[Episode]) -> list[int]:
    """Servers per burst: faults starting at the same instant form one burst."""
    return list(collections.Counter(ep.start_d for ep in episodes).values())


def up_time(episodes: list[Episode], population: int, horizon_d: float) -> np.ndarray:
    """Each server's time up in [0, horizon): the exposure of its fault rate."""
    up = np.full(population, float(horizon_d))
    for ep in episodes:
        up[ep.server] -= max(0.0, min(ep.end_d, horizon_d) - ep.start_d)
    return np.maximum(up, RESOLUTION_D)


def day_patterns(episodes: list[Episode]) -> list[tuple[tuple[float, int], ...]]:
    """Each day with faults as its bursts: (time within the day, servers); resampling whole days
    keeps the clustering of bursts within a day (the daily counts' dispersion)."""
    by: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for ep in episodes:
        by[int(ep.start_d)][ep.start_d - int(ep.start_d)] += 1
    return [tuple(sorted(c.items())) for _, c in sorted(by.items())]


def per_server_counts(episodes: list[Episode], population: int) -> np.ndarray:
    c = np.zeros(population, dtype=int)
    for ep in episodes:
        c[ep.server] += 1
    return c


def within_server_gaps(episodes: list[Episode]) -> np.ndarray:
    by: dict[int, list[float]] = collections.defaultdict(list)
    for ep in episodes:
        by[ep.server].append(ep.start_d)
    g = [np.diff(sorted(v)) for v in by.values() if len(v) > 1]
    return np.maximum(np.concatenate(g) if g else np.zeros(0), RESOLUTION_D)


def repair_times(episodes: list[Episode]) -> np.ndarray:
    return np.maximum(np.array([ep.repair_d for ep in episodes if not ep.censored]), RESOLUTION_D)


def fit_nb_shape(counts: np.ndarray, exposure_d: float) -> tuple[float, float, float]:
    """Gamma-Poisson (negative binomial) shape by maximum likelihood, the mean fixed at the
    sample's; returns (shape, log-likelihood, Poisson log-likelihood)."""
    m = counts.mean()
    ll_pois = float(stats.poisson.logpmf(counts, m).sum())

    def nll(log_a: float) -> float:
        a = math.exp(log_a)
        p = a / (a + m)
        return -float(stats.nbinom.logpmf(counts, a, p).sum())

    res = optimize.minimize_scalar(nll, bounds=(-8.0, 8.0), method="bounded")
    a = math.exp(res.x)
    return a, -float(res.fun), ll_pois


def laplace_z(times: np.ndarray, horizon: float) -> float:
    """Laplace trend statistic: z = (mean(t) - T/2) / (T sqrt(1 / (12 n)))."""
    n = len(times)
    return float((times.mean() - horizon / 2) / (horizon * math.sqrt(1.0 / (12.0 * n)))) if n else float("nan")


def loglinear_trend(times: np.ndarray, horizon: float) -> float:
    """b of the intensity exp(a + b t) on [0, horizon) by maximum likelihood (Cox-Lewis): solves
    sum(t) / n = horizon e^(bT) / (e^(bT) - 1) - 1 / b."""
    n, mean_t = len(times), float(np.mean(times))

    def g(b: float) -> float:
        if abs(b) < 1e-9:
            return horizon / 2 - mean_t
        return horizon * math.exp(b * horizon) / math.expm1(b * horizon) - 1.0 / b - mean_t

    if n < 2:
        return 0.0
    return float(optimize.brentq(g, -1.0, 1.0))


def compare(sample: np.ndarray, candidates: dict[str, tuple]) -> dict:
    """Each candidate (scipy distribution, fitted params): log-likelihood, AIC and a KS test."""
    out = {}
    for name, (dist, params) in candidates.items():
        ll = float(dist.logpdf(sample, *params).sum())
        k = sum(1 for p in params if p != 0.0)
        ks = stats.kstest(sample, dist.cdf, args=params)
        out[name] = {"params": [float(p) for p in params], "loglik": ll, "aic": 2 * k - 2 * ll,
                     "ks_d": float(ks.statistic), "ks_p": float(ks.pvalue)}
    return out


def fit(episodes: list[Episode], horizon_d: float = infinitehbd.HORIZON_DAYS,
        population: int = infinitehbd.POPULATION) -> tuple[Fit, dict]:
    """The generator and the report (parameters and test statistics, JSON-ready)."""
    counts = per_server_counts(episodes, population)
    n = int(counts.sum())
    exposure = up_time(episodes, population, horizon_d)
    rate = n / float(exposure.sum())  # per server-day up
    a, ll_nb, ll_pois = fit_nb_shape(counts, horizon_d)
    lr = 2.0 * (ll_nb - ll_pois)
    gaps = within_server_gaps(episodes)
    rep = repair_times(episodes)
    wk, _, wl = stats.weibull_min.fit(gaps, floc=0)
    tbf = compare(gaps, {"exponential": (stats.expon, (0.0, float(gaps.mean()))),
                         "weibull": (stats.weibull_min, (wk, 0.0, wl))})
    tbf_lr = 2.0 * (tbf["weibull"]["loglik"] - tbf["exponential"]["loglik"])
    ls, _, lsc = stats.lognorm.fit(rep, floc=0)
    rk, _, rl = stats.weibull_min.fit(rep, floc=0)
    repair = compare(rep, {"lognormal": (stats.lognorm, (ls, 0.0, lsc)), "weibull": (stats.weibull_min, (rk, 0.0, rl))})
    sizes = batches(episodes)
    starts = np.array([ep.start_d for ep in episodes])
    daily = np.bincount(starts.astype(int), minlength=int(math.ceil(horizon_d)))[: int(horizon_d)]
    causes = collections.Counter(ep.cause for ep in episodes)
    p0 = a / (a + counts.mean())
    model = Fit(horizon_d=horizon_d, population=population, rate_per_server_day=rate, nb_shape=a,
                counts=tuple(int(c) for c in counts), batch_sizes=tuple(sorted(sizes)),
                exposure_d=tuple(float(x) for x in exposure), day_patterns=tuple(day_patterns(episodes)), repair_shape=float(rk),
                repair_scale_d=float(rl), cause_counts=dict(causes.most_common()),
                trend_per_day=loglinear_trend(np.array(sorted(set(starts.tolist()))), horizon_d),
                repairs_d=tuple(float(x) for x in rep))
    report = {
        "fitted_on": f"InfiniteHBD trace, days 0-{horizon_d:g} ({population} servers; sim/data/infinitehbd)",
        "fault_starts": n, "servers_with_faults": int((counts > 0).sum()), "censored_repairs": sum(ep.censored for ep in episodes),
        "rate_per_1000_server_days": 1000.0 * n / (population * horizon_d),
        "rate_per_1000_server_days_up": 1000.0 * rate,
        "per_server_counts": {
            "mean": float(counts.mean()), "variance": float(counts.var(ddof=1)),
            "zeros_observed": int((counts == 0).sum()),
            "zeros_poisson": float(population * math.exp(-counts.mean())),
            "zeros_negative_binomial": float(population * p0 ** a),
            "nb_shape": a, "loglik_negative_binomial": ll_nb, "loglik_poisson": ll_pois,
            "lr_stat": lr, "lr_p": float(stats.chi2.sf(lr, 1)),
        },
        "bursts": {"count": len(sizes), "per_day": len(sizes) / horizon_d,
                   "size_counts": {str(k): v for k, v in sorted(collections.Counter(sizes).items())},
                   "mean_size": float(np.mean(sizes)),
                   "daily_dispersion_index": float(daily.var(ddof=1) / daily.mean())},
        "time_between_failures_d": {"n": len(gaps), "median": float(np.median(gaps)), **tbf,
                                    "lr_weibull_vs_exponential": tbf_lr, "lr_p": float(stats.chi2.sf(tbf_lr, 1))},
        "repair_d": {"n": len(rep), "median": float(np.median(rep)), "mean": float(rep.mean()), **repair},
        "cause_counts": dict(causes.most_common()),
        "trend": {"laplace_z": laplace_z(starts, horizon_d), "bursts_laplace_z": laplace_z(np.array(sorted(set(starts.tolist()))), horizon_d),
                  "loglinear_per_day_bursts": model.trend_per_day, "laplace_p_two_sided": float(2 * stats.norm.sf(abs(laplace_z(starts, horizon_d)))),
                  "first_half": int((starts < horizon_d / 2).sum()), "second_half": int((starts >= horizon_d / 2).sum())},
    }
    return model, report


def curves(episodes: list[Episode], model: Fit, report: dict) -> list[dict]:
    """Tidy rows for the figure: empirical and fitted CDFs, count histograms, daily counts."""
    rows = []
    gaps, rep = within_server_gaps(episodes), repair_times(episodes)
    for panel, sample, fits in (("tbf", gaps, report["time_between_failures_d"]), ("repair", rep, report["repair_d"])):
        xs = np.sort(sample)
        rows += [{"panel": panel, "series": "data", "x": float(x), "y": (i + 1) / len(xs)} for i, x in enumerate(xs)]
        grid = np.geomspace(RESOLUTION_D, xs.max() * 1.5, 120)
        for name in ("exponential", "weibull", "lognormal"):
            if name in fits:
                dist = {"exponential": stats.expon, "weibull": stats.weibull_min, "lognormal": stats.lognorm}[name]
                cdf = dist.cdf(grid, *fits[name]["params"])
                rows += [{"panel": panel, "series": name, "x": float(x), "y": float(y)} for x, y in zip(grid, cdf)]
    counts = np.asarray(model.counts)
    m, a = counts.mean(), model.nb_shape
    for k in range(int(counts.max()) + 1):
        rows.append({"panel": "counts", "series": "data", "x": k, "y": int((counts == k).sum())})
        rows.append({"panel": "counts", "series": "poisson", "x": k, "y": float(len(counts) * stats.poisson.pmf(k, m))})
        rows.append({"panel": "counts", "series": "negative binomial",
                     "x": k, "y": float(len(counts) * stats.nbinom.pmf(k, a, a / (a + m)))})
    starts = np.array([ep.start_d for ep in episodes])
    daily = np.bincount(starts.astype(int), minlength=int(model.horizon_d))[: int(model.horizon_d)]
    rows += [{"panel": "daily", "series": "data", "x": d, "y": int(c)} for d, c in enumerate(daily)]
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    eps = infinitehbd.load()
    model, report = fit(eps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fit_days_0_174.json").write_text(json.dumps(report, indent=1) + "\n")
    import csv

    with open(out / "fit_curves.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["panel", "series", "x", "y"])
        w.writeheader()
        w.writerows(curves(eps, model, report))
    pc, tb, rp = report["per_server_counts"], report["time_between_failures_d"], report["repair_d"]
    print(f"rate {report['rate_per_1000_server_days']:.2f} per 1,000 server-days; per-server counts: variance/mean "
          f"{pc['variance'] / pc['mean']:.2f}, zeros {pc['zeros_observed']} (Poisson {pc['zeros_poisson']:.0f}, NB "
          f"{pc['zeros_negative_binomial']:.0f}), NB shape {pc['nb_shape']:.3f}, LR p {pc['lr_p']:.2g}")
    print(f"bursts {report['bursts']['count']} ({report['bursts']['per_day']:.2f}/day), daily dispersion "
          f"{report['bursts']['daily_dispersion_index']:.2f}; TBF Weibull k {tb['weibull']['params'][0]:.2f} "
          f"(KS p {tb['weibull']['ks_p']:.2g}) vs exponential (KS p {tb['exponential']['ks_p']:.2g}); repair lognormal "
          f"sigma {rp['lognormal']['params'][0]:.2f} median {rp['lognormal']['params'][2]:.2f} d (KS p {rp['lognormal']['ks_p']:.2g}), "
          f"Weibull KS p {rp['weibull']['ks_p']:.2g}; Laplace z {report['trend']['laplace_z']:.2f} (bursts "
          f"{report['trend']['bursts_laplace_z']:.2f}), log-linear trend {model.trend_per_day:.4f}/day, halves "
          f"{report['trend']['first_half']}/{report['trend']['second_half']}")
    return report


if __name__ == "__main__":
    main()
