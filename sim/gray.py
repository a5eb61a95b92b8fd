"""Gray failures at scale: stragglers and silent data corruption, detected only or handed to spares.

The crash model (``sim.cluster``) takes nodes away. Two kinds of trouble take nothing away:

- **Silent data corruption (SDC)**: nothing fails; the state is wrong. Detect-only (every
  strategy of ``sim.strategies`` today: ``detect_sdc_s`` in the calibration, a loss spike or a
  validation run notices it) loses the work since the last clean disk checkpoint plus the time
  until noticed plus a restart::

      lost = detect_sdc_s + U(0, ckpt_interval_s) + restart_s

  With the runtime's checksum comparison (``deadpool/recovery/integrity.py``) the data-parallel
  peers see it at the next snapshot and a spare takes the corrupt rank::

      lost = (snapshot_interval_steps + 1) * step_s + swap_s        (majority, dp >= 3)
      lost = (2 * snapshot_interval_steps + 1) * step_s + 2 * swap_s   (dp 2: a re-run first)

- **Stragglers (fail-slow)**: a rank runs ``slowdown`` times slower for a lognormal duration
  ``d``; a synchronous job runs at its pace. Detect-only (NVIDIA's resiliency extension reports
  stragglers; nothing acts) the job is slowed for the whole of ``d``; migrating the rank to a
  spare (``ft.straggler``: ``detect_steps`` slow steps, then a planned swap) cuts that to::

      slowed = min(d, detect_steps * slowdown * step_s)  (+ migrate_s if d is longer)

  While slowed for wall time ``w`` the job progresses ``w / slowdown``: it loses
  ``w * (1 - 1 / slowdown)``. Overlapping stragglers slow the job once (the union of the
  slowed intervals counts).

Events of each kind arrive as a Poisson process (the superposition of many nodes' renewal
processes, sim.trace's note) at ``rate`` per 1,000 node-days. Analytic expectation without
overlaps, which ``tests/sim/test_gray.py`` asserts against the simulated mean: a job of ``T``
days on ``N`` nodes sees ``n = rate * N * T / 1000`` events and loses ``n * E[lost]`` seconds;
for a detect-only straggler ``E[lost] = (1 - 1/slowdown) * median * exp(sigma**2 / 2)``.
Goodput here is ``T / (T + lost)`` with only these events (the crash model's losses come on top:
the two are read side by side, not added).

    python -m sim.gray [--config experiments/sim/gray.yaml] [--out experiments/results/sim/gray]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np
import yaml

DAY = 86400.0
ROOT = Path(__file__).resolve().parents[1]


def arrivals(rng, rate_per_1000_node_days: float, nodes: int, days: float) -> np.ndarray:
    """Event times (s) of a Poisson process over the job."""
    n = rng.poisson(rate_per_1000_node_days * nodes * days / 1000.0)
    return np.sort(rng.uniform(0.0, days * DAY, n))


def union_length(starts: np.ndarray, lengths: np.ndarray) -> float:
    """Total length of the union of the intervals ``[start, start + length)``."""
    total, end = 0.0, -math.inf
    for s, e in sorted(zip(starts, starts + lengths)):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def straggler_lost(rng, c: dict, rate: float, policy: str) -> float:
    """Seconds of progress one job loses to stragglers under ``policy`` (detect | migrate)."""
    t = arrivals(rng, rate, c["num_nodes"], c["days"])
    d = rng.lognormal(math.log(c["straggler_median_s"]), c["straggler_sigma"], t.size)
    slow = float(c["slowdown"])
    extra = 0.0
    if policy == "migrate":
        detect = c["detect_steps"] * slow * c["step_s"]
        extra = float(np.sum(d > detect)) * c["migrate_s"]
        d = np.minimum(d, detect)
    return union_length(t, d) * (1.0 - 1.0 / slow) + extra


def sdc_lost(rng, c: dict, rate: float, policy: str) -> float:
    """Seconds of progress one job loses to silent data corruption under ``policy``
    (detect | checksum)."""
    n = rng.poisson(rate * c["num_nodes"] * c["days"] / 1000.0)
    if policy == "detect":
        return float(np.sum(c["detect_sdc_s"] + rng.uniform(0, c["ckpt_interval_s"], n)
                            + c["restart_s"]))
    k = c["snapshot_interval_steps"]
    if c["dp"] >= 3:
        each = (k + 1) * c["step_s"] + c["swap_s"]
    else:
        each = (2 * k + 1) * c["step_s"] + 2 * c["swap_s"]
    return n * each


def run(c: dict) -> list[dict]:
    """One row per (kind, policy, rate): goodput and hours lost, mean and 95 % interval over
    ``seeds`` jobs. Common random numbers: each seed's events are the same for both policies."""
    rows = []
    kinds = {"straggler": (straggler_lost, ("detect", "migrate"), c["straggler_rates"]),
             "sdc": (sdc_lost, ("detect", "checksum"), c["sdc_rates"])}
    T = c["days"] * DAY
    for kind, (fn, policies, rates) in kinds.items():
        for rate in rates:
            for policy in policies:
                lost = np.array([fn(np.random.default_rng([seed, int(rate * 1e6)]), c, rate, policy)
                                 for seed in range(c["seeds"])])
                good = T / (T + lost)
                rows.append({"kind": kind, "policy": policy, "rate_per_1000_node_days": rate,
                             "goodput_mean": float(good.mean()),
                             "goodput_lo": float(np.percentile(good, 2.5)),
                             "goodput_hi": float(np.percentile(good, 97.5)),
                             "lost_h_mean": float(lost.mean() / 3600),
                             "slowdown_x": float((T + lost.mean()) / T)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "experiments" / "sim" / "gray.yaml"))
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "sim" / "gray"))
    a = ap.parse_args(argv)
    c = yaml.safe_load(Path(a.config).read_text())
    rows = run(c)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "aggregate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "config.json").write_text(json.dumps(c, indent=1))
    for r in rows:
        print(f"{r['kind']:9s} {r['policy']:8s} rate {r['rate_per_1000_node_days']:7.4f}: goodput "
              f"{r['goodput_mean']:.4f}  lost {r['lost_h_mean']:7.2f} h  ({r['slowdown_x']:.3f}x)")
    print(f"wrote {out / 'aggregate.csv'}")


if __name__ == "__main__":
    main()
