"""How likely each ranking is: a joint Latin-hypercube sample of every assumed parameter.

    python experiments/sim/ranking.py [--samples 64] [--seed 0] [--out experiments/results/sim/ranking]

Reads experiments/sim/ranking.yaml (parameters, ranges, scales; a parameter with ``choices`` is
categorical: the hypercube's coordinate picks one, and its index is what ``samples.csv`` holds). Draws ``--samples`` points with
``scipy.stats.qmc.LatinHypercube`` over every parameter at once (log-uniform where marked), and
runs each point at every scale with every strategy on one trace (trace seed = sample index, so
the failure draw varies with the parameters; within a point every strategy sees the same trace).
A strategy that refuses a point (its memory does not fit) is left out of that point's ranking.
Writes, into ``--out``:

- ``samples.csv``: one row per sample x scale x strategy: the sampled values, ``goodput``,
  ``fleet_goodput``, ``feasible``;
- ``p_first.csv``: per scale and metric (ETTR, fleet goodput), P(strategy ranks first) with a
  95 % Wilson interval over samples;
- ``margin.csv``: per scale and metric, DeadPool's margin over the best other strategy: mean,
  quantiles and P(margin > 0);
- ``drivers.csv``: Spearman correlation of each parameter with DeadPool's ETTR margin (which
  assumption the ranking hangs on).

paper_figures/fig13_ranking.py draws them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from scipy import stats
from scipy.stats import qmc

from points import compose_cfg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sim.simulate import run_scenario  # noqa: E402

HERE = Path(__file__).resolve().parent
METRICS = {"goodput": "ETTR", "fleet_goodput": "fleet goodput"}


def draw(spec: list[dict], n: int, seed: int) -> np.ndarray:
    """``n`` x len(spec) values: Latin hypercube in [0, 1)^d, mapped to each range."""
    u = qmc.LatinHypercube(d=len(spec), seed=seed).random(n)
    out = np.empty_like(u)
    for j, p in enumerate(spec):
        if "choices" in p:  # a categorical assumption: the index of the choice
            out[:, j] = np.floor(u[:, j] * len(p["choices"]))
            continue
        lo, hi = float(p["low"]), float(p["high"])
        if p.get("log"):
            out[:, j] = np.exp(np.log(lo) + u[:, j] * (np.log(hi) - np.log(lo)))
        else:
            out[:, j] = lo + u[:, j] * (hi - lo)
    return out


def overrides_for(spec: list[dict], values: np.ndarray, defaults: dict) -> list[str]:
    out = []
    for p, v in zip(spec, values):
        for key in p["keys"]:
            if "choices" in p:
                out.append(f"{key}={p['choices'][int(v)]}")
                continue
            val = v * defaults[key] if p.get("scale") else v
            out.append(f"{key}={val:.6g}")
    return out


def lookup(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def run_point(overrides: list[str], strategies: list[str]) -> dict[str, dict | None]:
    """Every strategy at one point; a strategy that refuses (ValueError) maps to None."""
    cfg = compose_cfg(overrides)
    try:
        return {r["strategy"]: r for r in run_scenario(cfg, progress=False)}
    except ValueError:
        res = {}
        for s in strategies:
            try:
                res[s] = run_scenario(compose_cfg(overrides + [f"strategies=[{s}]"]), progress=False)[0]
            except ValueError as e:
                print(f"[ranking] {s} refused: {e}", file=sys.stderr)
                res[s] = None
        return res


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, min(c - h, p)), min(1.0, max(c + h, p))  # p = 0 or 1: no rounding past p


def summarise(df: pd.DataFrame, spec: list[dict], strategies: list[str], out: Path) -> None:
    pf, mg, dr = [], [], []
    names = [p["name"] for p in spec]
    for (gpus, metric), _ in [((g, m), None) for g in sorted(df.num_gpus.unique()) for m in METRICS]:
        w = df[(df.num_gpus == gpus) & df.feasible].pivot_table(index="sample", columns="strategy", values=metric)
        w = w.reindex(columns=[s for s in strategies if s in w.columns])
        n = len(w)
        first = w.idxmax(axis=1)
        for s in w.columns:
            k = int((first == s).sum())
            lo, hi = wilson(k, n)
            pf.append({"num_gpus": gpus, "metric": metric, "strategy": s, "p_first": k / n, "ci95_lo": lo,
                       "ci95_hi": hi, "n_samples": n})
        if "deadpool" in w.columns:
            others = w.drop(columns="deadpool")
            margin = w["deadpool"] - others.max(axis=1)
            q = margin.quantile([0.05, 0.25, 0.5, 0.75, 0.95])
            mg.append({"num_gpus": gpus, "metric": metric, "mean": margin.mean(), "q05": q[0.05], "q25": q[0.25],
                       "median": q[0.5], "q75": q[0.75], "q95": q[0.95], "p_positive": float((margin > 0).mean()),
                       "n_samples": n})
            if metric == "goodput":
                params = df[(df.num_gpus == gpus) & (df.strategy == "deadpool")].set_index("sample")[names]
                for name in names:
                    rho = stats.spearmanr(params.loc[margin.index, name], margin).statistic
                    dr.append({"num_gpus": gpus, "parameter": name, "spearman_rho": rho})
    pd.DataFrame(pf).to_csv(out / "p_first.csv", index=False)
    pd.DataFrame(mg).to_csv(out / "margin.csv", index=False)
    pd.DataFrame(dr).to_csv(out / "drivers.csv", index=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="seed of the Latin hypercube")
    ap.add_argument("--spec", default=str(HERE / "ranking.yaml"))
    ap.add_argument("--out", default=str(HERE.parents[1] / "experiments" / "results" / "sim" / "ranking"))
    ap.add_argument("--days", type=float, default=None, help="override the window (days)")
    ap.add_argument("--summarise-only", action="store_true", help="recompute the summaries from --out/samples.csv")
    a = ap.parse_args()
    spec_all = yaml.safe_load(Path(a.spec).read_text())
    spec, base = spec_all["parameters"], list(spec_all["base"])
    if a.summarise_only:
        df = pd.read_csv(Path(a.out) / "samples.csv")
        summarise(df, spec, [s for s in compose_cfg(base)["strategies"]], Path(a.out))
        return
    if a.days is not None:
        base.append(f"duration_days={a.days:g}")
    base_cfg = compose_cfg(base)
    strategies = list(base_cfg["strategies"])
    defaults = {k: float(lookup(base_cfg, k)) for p in spec if p.get("scale") for k in p["keys"]}
    values = draw(spec, a.samples, a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for i, v in enumerate(values):
        ov = overrides_for(spec, v, defaults)
        for gpus in spec_all["scales"]:
            res = run_point(base + ov + [f"cluster.num_gpus={gpus}", "seeds=1", f"seed_offset={i}", "progress=false"],
                            strategies)
            for s in strategies:
                r = res.get(s)
                rows.append({"sample": i, "num_gpus": gpus, "strategy": s, "feasible": r is not None,
                             "goodput": r["goodput"] if r else float("nan"),
                             "fleet_goodput": r["fleet_goodput"] if r else float("nan"),
                             **{p["name"]: float(x) for p, x in zip(spec, v)}})
        pd.DataFrame(rows).to_csv(out / "samples.csv", index=False)  # a partial run stays usable
        print(f"[ranking] sample {i + 1}/{len(values)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    summarise(df, spec, strategies, out)
    print(pd.read_csv(out / "p_first.csv").to_string(index=False))
    print(pd.read_csv(out / "margin.csv").to_string(index=False))


if __name__ == "__main__":
    main()
