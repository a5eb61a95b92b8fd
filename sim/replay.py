"""Replay measured runtime runs in the simulator and compare goodput: does the model hold?

    python -m sim.replay RUN_DIR|RESULTS_DIR [...] [--calibration cpu_strategies] [--out replay.csv]

For each run directory (``summary.json``, ``metrics.jsonl``, ``job.json`` as the runtime writes
them, e.g. those ``experiments/compare_strategies.py`` keeps) the simulator is configured like
the measured run, and nothing else is taken from it:

- layout: the run's first data-parallel width, one rank per node, its warm spares, its state
  bytes per rank; ``step_time_s`` = the run's mean step time at full width (every generation
  at the first one's width, each without its first step: warm-up is a recovery cost; with
  ``--step_time first_generation`` before the first failure only). The per-step cost of a
  strategy (snapshots, synchronous copies) is inside that step time, so the calibration's
  ``snapshot_overhead_frac`` is set to 0 here:
  the replay tests what failures cost, not the failure-free overhead (a separate, in-run A/B
  measurement: ``experiments/bench_overhead.py``);
- trace: one event per killed rank at the measured kill time (``t_kill`` of the run's
  recoveries), relative to the end of step 1. Checkpoint/restart relaunches every process, so
  its killed node is back at once (``fail``, duration 0); the hot-swap and elastic runs never
  get it back (``remove``);
- horizon: the measured window, from the end of step 1 to the end of the last step;
- strategy: runtime ``deadpool`` and ``sync_snapshot`` -> sim ``deadpool``; ``checkpoint_restart``
  -> sim ``checkpoint_restart`` (async, every ``ft.persist_interval_steps`` steps); ``elastic``
  -> sim ``elastic`` with ``optimizer_state: replica`` and ``shrink`` as the run's records say
  (``elastic``: ``in_place``, or ``relaunch``, which records written before in-place shrinks
  existed are; see sim/strategies/elastic.py); ``none`` -> sim ``deadpool`` with no failure (only its
  failure-free runs can be replayed: a failure ends the job);
- every recovery cost (detection, plan, rebuild, transfer, relaunch, load, width scaling) comes
  from the calibration (``sim.calibrate`` fitted on run directories).

Repeats of one run (``<schedule>/rep<k>/<strategy>``, ``experiments/compare_strategies.py
--repeats``) are also compared as a group: mean measured against mean simulated goodput.

Goodput is compared as job goodput: steps done x the run's own step time / window (measured:
``(num_steps - 1) * step_time_s / window``; simulated: ``W / horizon``). Multiplying both by
``step_time_s / t_none`` gives the comparison table's goodput; the relative error is the same.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

import numpy as np
import yaml

import sim.config
from sim.calibrate import CalibrationError, generations, run_dirs
from sim.layout import Layout
from sim.simulate import run_one
from sim.trace import FAIL, REMOVE, Trace

SIM_STRATEGY = {"deadpool": "deadpool", "sync_snapshot": "deadpool", "none": "deadpool",
                "checkpoint_restart": "checkpoint_restart", "elastic": "elastic"}


class ReplayError(ValueError):
    """A run directory that cannot be replayed; the message names it."""


STEP_TIMES = ("full_width", "first_generation")


def load(run_dir: str | Path, step_time: str = "full_width") -> dict:
    """What the replay needs from one run directory (``step_time``: see ``_step_time``)."""
    d = Path(run_dir)
    try:
        s = json.loads((d / "summary.json").read_text())
        job = json.loads((d / "job.json").read_text())
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ReplayError(f"{d}: {e}") from None
    if s.get("outcome") != "completed":
        raise ReplayError(f"{d}: the run did not complete ({s.get('outcome')}); nothing to replay")
    if int(s.get("tp", 1)) * int(s.get("pp", 1)) != 1:
        raise ReplayError(f"{d}: only data-parallel runs are replayed (tp={s.get('tp')}, pp={s.get('pp')})")
    n = int(s["steps"])
    gen0 = [r for r in rows if r["generation"] == 0]
    step1 = [r["t"] for r in gen0 if r["step"] == 1]
    last = [r["t"] for r in rows if r["step"] == n]
    if not step1 or not last:
        raise ReplayError(f"{d}: metrics.jsonl lacks step 1 or step {n}")
    t0 = max(step1)
    kills = []
    for x in s["recoveries"]:
        if x.get("t_kill") is None or x.get("outcome") == "interrupted by another failure":
            continue
        ranks = x.get("failed_slot") if x.get("failed_slot") is not None else x.get("failed_rank")
        for rank in ranks if isinstance(ranks, list) else [ranks]:
            kills.append((float(x["t_kill"]) - t0, int(rank)))
    return {"dir": str(d), "strategy": s.get("strategy", job["ft"].get("strategy", "deadpool")),
            "dp": len({r["rank"] for r in gen0}), "spares": int(s.get("num_spares", 0)),
            "steps": n, "step_time_s": _step_time(rows, step_time),
            "window_s": max(last) - t0, "kills": sorted(kills),
            "params": float(s["model_params"]), "state_bytes_per_rank": float(s["state_bytes_per_rank"]),
            "ckpt_every": int(job["ft"].get("persist_interval_steps") or 0),
            "shrink": "in_place" if any(x.get("elastic") == "in_place" for x in s["recoveries"])
            else "relaunch"}


def _step_time(rows: list[dict], which: str = "full_width") -> float:
    """Mean step time (the time the steps took), each generation without its first step
    (warm-up, a recovery cost): ``full_width``: of every generation that ran at the first one's
    width (a hot swap or a restart keeps it, an elastic shrink does not), so a slower phase after
    a recovery is in the step time, not a recovery cost; ``first_generation``: before the first
    failure only, so the simulator must explain everything after it."""
    if which not in STEP_TIMES:
        raise ReplayError(f"step_time must be one of {STEP_TIMES}, got {which!r}")
    gens = generations(rows)
    width = gens[min(gens)][0]
    if which == "first_generation":
        return statistics.fmean(gens[min(gens)][1])
    return statistics.fmean(t for w, steps in gens.values() if w == width for t in steps)


def configure(run: dict, calib: dict) -> tuple[str, dict, dict, Layout, Trace]:
    """Simulator inputs for one run: (kind, strategy cfg, calibration, layout, trace)."""
    strategy = run["strategy"]
    if strategy not in SIM_STRATEGY:
        raise ReplayError(f"{run['dir']}: no simulator strategy for runtime strategy {strategy!r}")
    if strategy == "none" and run["kills"]:
        raise ReplayError(f"{run['dir']}: ft=none ends at its first failure; only failure-free runs replay")
    dp, step = run["dp"], run["step_time_s"]
    # bytes per parameter such that Layout.state_bytes_per_gpu is the run's state per rank
    bpp = 2.0 + (run["state_bytes_per_rank"] / run["params"] - 2.0) * dp
    layout = Layout(num_gpus=dp, gpus_per_node=1, tp=1, pp=1, num_spares=run["spares"],
                    model_params=run["params"], bytes_per_param_state=bpp,
                    optimizer_sharded_over_dp=True, step_time_s=step)
    kind = SIM_STRATEGY[strategy]
    never = 1e6 * run["window_s"]  # no periodic disk checkpoint within the window
    if kind == "deadpool":
        scfg = {"kind": kind, "uses_spares": True, "on_no_spare": "shrink", "disk_ckpt_mode": "async",
                "disk_ckpt_interval_s": never}
    elif kind == "checkpoint_restart":
        every = run["ckpt_every"]
        if every <= 0:
            raise ReplayError(f"{run['dir']}: checkpoint_restart without a fixed persist interval")
        scfg = {"kind": kind, "uses_spares": False, "ckpt_mode": "async", "ckpt_interval_s": every * step}
    else:
        scfg = {"kind": kind, "uses_spares": False, "optimizer_state": "replica", "shrink": run["shrink"],
                "min_width_frac": 1.0 / dp, "disk_ckpt_mode": "async", "disk_ckpt_interval_s": never}
    calib = {**calib, "snapshot_overhead_frac": 0.0}  # inside the measured step time
    # kills on distinct active nodes (a rank number may be reused after a shrink renumbers)
    used: set[int] = set()
    times, nodes = [], []
    for t, rank in run["kills"]:
        node = rank
        while node in used or node >= dp:
            node = (node + 1) % dp
        used.add(node)
        times.append(max(t, 0.0))
        nodes.append(node)
    event = FAIL if kind == "checkpoint_restart" else REMOVE
    trace = Trace(time_s=np.array(times, dtype=float), node=np.array(nodes, dtype=np.int64),
                  event=np.full(len(times), event, dtype=np.int8), cause=np.zeros(len(times), dtype=np.int64),
                  duration_s=np.zeros(len(times)), causes=("kill",), transient_causes=frozenset(),
                  num_nodes=dp + run["spares"], horizon_s=run["window_s"])
    return kind, scfg, calib, layout, trace


def replay(run_dir: str | Path, calib: dict, step_time: str = "full_width") -> dict:
    """One row: measured and simulated job goodput of the run, and the relative error."""
    run = load(run_dir, step_time)
    kind, scfg, c, layout, trace = configure(run, calib)
    row = run_one(run["strategy"], scfg, c, layout, trace, run["window_s"], mtbf_s=float("inf"))
    measured = (run["steps"] - 1) * run["step_time_s"] / run["window_s"]
    return {"run": run["dir"], "strategy": run["strategy"], "sim_strategy": kind, "dp": run["dp"],
            "spares": run["spares"], "kills": len(run["kills"]), "step_time_s": round(run["step_time_s"], 5),
            "window_s": round(run["window_s"], 3), "measured_goodput": round(measured, 4),
            "simulated_goodput": round(row["goodput"], 4),
            "rel_error": round(row["goodput"] / measured - 1.0, 4),
            "sim_restarts": row.get("restarts", 0), "sim_swaps": row.get("swaps", 0),
            "sim_shrinks": row.get("shrinks", 0)}


def load_calibration(name_or_path: str) -> dict:
    p = Path(name_or_path)
    if not p.suffix:
        p = sim.config.SIM_CONF_DIR / "calibration" / f"{name_or_path}.yaml"
    if not p.exists():
        raise ReplayError(f"no calibration {name_or_path!r} ({p})")
    return yaml.safe_load(p.read_text())


def group_of(run_dir: str | Path) -> str:
    """A run's group: its path without the ``rep<k>`` parts of repeated runs."""
    return str(Path(*(p for p in Path(run_dir).parts if not re.fullmatch(r"rep\d+", p))))


def by_group(rows: list[dict]) -> list[dict]:
    """Repeats of one run (``group_of``) together: mean measured and simulated goodput and the
    relative error of the means (the noise of one run on a shared host averages out)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(group_of(r["run"]), []).append(r)
    out = []
    for g, rs in groups.items():
        m = statistics.fmean(r["measured_goodput"] for r in rs)
        sg = statistics.fmean(r["simulated_goodput"] for r in rs)
        out.append({"group": g, "strategy": rs[0]["strategy"], "runs": len(rs), "measured_goodput": round(m, 4),
                    "simulated_goodput": round(sg, 4), "rel_error": round(sg / m - 1.0, 4),
                    "worst_run_error": max((r["rel_error"] for r in rs), key=abs)})
    return out


def _print(rows: list[dict], cols: list[str]) -> None:
    w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    print("  ".join(c.ljust(w[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w[c]) for c in cols))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m sim.replay", description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="+", help="run directories, or directories to search for them")
    ap.add_argument("--calibration", default="cpu_strategies", help="name under sim/conf/calibration or a path")
    ap.add_argument("--step_time", default="full_width", choices=STEP_TIMES,
                    help="the simulator's step time: the run's mean at full width (default), or before "
                         "its first failure only (a slowdown after a recovery then counts against the model)")
    ap.add_argument("--out", default=None, help="write the rows as CSV here (and the group means next to it, *_mean.csv)")
    a = ap.parse_args(argv)
    calib = load_calibration(a.calibration)
    try:
        dirs = run_dirs(a.run_dirs)
    except CalibrationError as e:
        raise ReplayError(str(e)) from None
    named = {Path(d) for d in a.run_dirs}
    rows = []
    for d in dirs:
        try:
            rows.append(replay(d, calib, a.step_time))
        except ReplayError as e:
            if d in named:
                raise
            print(f"[replay] skipped {e}")  # found below a directory: e.g. ft=none's failed run
    if not rows:
        raise ReplayError("no run to replay")
    _print(rows, ["strategy", "dp", "spares", "kills", "window_s", "measured_goodput", "simulated_goodput",
                  "rel_error", "run"])
    groups = by_group(rows)
    if len(groups) < len(rows):
        print("\nmeans over repeats:")
        _print(groups, ["strategy", "runs", "measured_goodput", "simulated_goodput", "rel_error",
                        "worst_run_error", "group"])
    print(f"[replay] {len(rows)} runs in {len(groups)} groups; worst |relative error|: "
          f"{max(abs(g['rel_error']) for g in groups):.1%} of a group's mean, "
          f"{max(abs(r['rel_error']) for r in rows):.1%} of one run")
    if a.out:
        out = Path(a.out)
        for path, rs in ((out, rows), (out.with_name(out.stem + "_mean.csv"), groups)):
            with open(path, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(rs[0]))
                wr.writeheader()
                wr.writerows(rs)
    return rows


if __name__ == "__main__":
    try:
        main()
    except ReplayError as e:
        sys.exit(f"sim.replay: {e}")
