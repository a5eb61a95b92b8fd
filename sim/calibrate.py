"""Fit the simulator's hot-swap parameters from the runtime's run directories.

    python -m sim.calibrate RUN_DIR|RESULTS_DIR [...] [--name measured] [--out PATH]

A directory without a ``summary.json`` stands for every run directory below it. Reads each run's ``summary.json`` (and ``metrics.jsonl`` when present) as written by the
runtime, fits the parameters below and writes a calibration YAML (default:
sim/conf/calibration/<name>.yaml, selected with ``calibration=<name>``) with a comment on
every line saying where the value came from. Parameters the runs say nothing about are
copied from the base calibration (``--base``, default ``default``) and say so.

Fits (scipy):
- ``rebuild_base_s + rebuild_per_log2_gpus_s * log2(world_size)`` ~ ``rebuild_s``:
  ``curve_fit`` with non-negative bounds when >= 2 world sizes are present, else the base
  slope is kept and only the intercept is fitted (median).
- ``transfer_latency_s + bytes / (transfer_gbps_per_node * 1e9)`` ~ ``transfer_s``: non-negative
  linear least squares (``lsq_linear``) when >= 2 distinct sizes, else the base latency is
  kept and the bandwidth is the median of ``bytes / (transfer_s - latency)``.
- ``detect_crash_s``, ``plan_s``: medians of the recoveries' ``detect_s``, ``plan_s`` (the runtime's
  recoveries are kills: crashes). Hang and corruption detection are copied from the base.
- ``warmup_steps``: median of ``(first_step_s - step_time_s) / step_time_s``, >= 0.
- ``snapshot_overhead_frac``: from an in-run A/B run (snapshots in alternate blocks of steps) when
  one is given: median step time after a snapshot / without - 1. Otherwise median per-step
  ``snapshot_blocked_s`` / median ``step_time_s`` (a lower bound: it misses contention).
- checkpoint/restart's relaunch, from recoveries that relaunched the whole job (``ft=checkpoint_
  restart``, or a fallback): ``requeue_s`` = median ``teardown_s`` (kill everything, free the
  slots); ``launch_base_s + launch_per_log2_nodes_s * log2(world_size)`` ~ ``start_s + rebuild_s +
  first_step_s`` (processes started, torch imported, model built, groups up, first step):
  ``+ launch_per_node_s * world_size`` too when >= 3 world sizes (non-negative ``lsq_linear``),
  ``curve_fit`` of the log term alone over 2; ``ckpt_latency_s`` = median ``load_s`` (a small model's
  load is latency). Elastic shrinks and regrows relaunch the same way and join this fit, at the
  width they relaunch at. Hot-swap fits use hot-swapped recoveries only, snapshot fits ft=deadpool
  runs only (``summary.json``'s ``strategy``).
- ``width_step_time_ratio``, ``width_scaling_exponent``: from runs that continued at a reduced
  data-parallel width w of W (elastic, global batch kept): per reduced generation the ratio of its
  mean step time to generation 0's; the table holds the median ratio at each width fraction w/W
  (``sim.costs.WidthScaling`` interpolates it), the exponent the median of ``log(1/ratio) /
  log(w/W)`` (the power law beyond the table's narrowest point).
- ``replicate_lag_steps``, ``snapshot_interval_steps``: from the runtime's per-step record when the
  runs have it (``protection_lag_steps``, ``snapshot_interval`` in metrics.jsonl: the interval the
  snapshot schedule chose, and the lag beyond the snapshot step, the median of the job's lag
  minus half an interval); else ``snapshot.replicate_s_median / step_time_s`` and the runs'
  configured ``snapshot.interval_steps`` (must agree).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Iterable

import numpy as np
import yaml
from scipy.optimize import curve_fit, lsq_linear

import sim.config

FITTED = ("detect_crash_s", "plan_s", "rebuild_base_s", "rebuild_per_log2_gpus_s", "transfer_latency_s",
          "transfer_gbps_per_node", "warmup_steps", "snapshot_overhead_frac",
          "snapshot_interval_steps", "replicate_lag_steps", "requeue_s", "launch_base_s",
          "launch_per_log2_nodes_s", "launch_per_node_s", "ckpt_latency_s", "width_scaling_exponent",
          "width_step_time_ratio")
RELAUNCHED = ("restart", "shrink", "grow")  # a recovery record's "fallback": the job relaunched


class CalibrationError(ValueError):
    """A run directory that cannot be used; the message names it."""


def load_run(run_dir: str | Path) -> dict:
    """``summary.json`` plus per-step medians from ``metrics.jsonl`` (if present)."""
    d = Path(run_dir)
    p = d / "summary.json"
    if not p.exists():
        raise CalibrationError(f"{d}: no summary.json")
    try:
        s = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{p}: not JSON ({e})") from None
    for key in ("world_size", "step_time_s", "recoveries", "snapshot"):
        if key not in s:
            raise CalibrationError(f"{p}: missing key {key!r}")
    s["_dir"] = str(d)
    if "strategy" not in s and (d / "job.json").exists():  # runs written before summary named it
        s["strategy"] = json.loads((d / "job.json").read_text()).get("ft", {}).get("strategy", "deadpool")
    m = d / "metrics.jsonl"
    if m.exists():
        blocked, steps, rows = [], [], []
        with open(m) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    raise CalibrationError(f"{m}:{lineno}: not JSON") from None
                steps.append(float(r["step_time_s"]))
                blocked.append(float(r.get("snapshot_blocked_s", 0.0)))
                rows.append(r)
        if steps:
            s["_metrics_step_median"] = statistics.median(steps)
            s["_metrics_blocked_median"] = statistics.median(blocked)
        ab = _ab_overhead(rows)
        if ab is not None:
            s["_ab_overhead"] = ab
        lag = _protection(rows)
        if lag is not None:
            s["_protection_lag"], s["_interval"] = lag
        s["_width_ratios"] = _width_ratios(rows)
    return s


def run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Each path that holds a ``summary.json``, and for any other directory every run directory
    below it (``summary.json``, ``metrics.jsonl`` and ``job.json``, as the runtime writes them)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "summary.json").exists() or not p.is_dir():
            out.append(p)
            continue
        found = sorted(q.parent for q in p.rglob("summary.json")
                       if (q.parent / "metrics.jsonl").exists() and (q.parent / "job.json").exists())
        if not found:
            raise CalibrationError(f"{p}: no run directory (summary.json, metrics.jsonl, job.json) below it")
        out += found
    return out


def generations(rows: list[dict]) -> dict[int, tuple[int, list[float]]]:
    """Per generation of a run's metrics.jsonl rows: (its data-parallel width, i.e. ranks that
    reported, and its step times without its first step, which carries the warm-up)."""
    by_gen: dict[int, list[dict]] = {}
    for r in rows:
        by_gen.setdefault(int(r.get("generation", 0)), []).append(r)
    out = {}
    for g, rs in sorted(by_gen.items()):
        first = min(r["step"] for r in rs)
        out[g] = (len({r.get("rank") for r in rs}), [float(r["step_time_s"]) for r in rs if r["step"] > first])
    return out


def _width_ratios(rows: list[dict]) -> list[tuple[float, float]]:
    """``(w / W, step time at w / at W)`` for each generation that ran at a narrower data-parallel
    width w than the first generation's W (the global batch is kept, so a step does the same
    work); step times are means (the time a generation took), without each one's first step."""
    gens = generations(rows)
    if 0 not in gens or len(gens[0][1]) < 3:
        return []
    full, t_full = gens[0][0], statistics.fmean(gens[0][1])
    return [(w / full, statistics.fmean(steps) / t_full)
            for g, (w, steps) in gens.items() if g and 0 < w < full and len(steps) >= 3]


def _protection(rows: list[dict]) -> tuple[float, float] | None:
    """The job's measured protection lag and snapshot interval (runs whose trainer records
    ``protection_lag_steps``): per step the largest lag over ranks (the newest step every rank
    has replicated), then the median over steps; the interval likewise."""
    lag: dict[int, int] = {}
    interval: dict[int, int] = {}
    for r in rows:
        if r.get("protection_lag_steps") is not None and r.get("snapshot_interval"):
            lag[r["step"]] = max(lag.get(r["step"], 0), int(r["protection_lag_steps"]))
            interval[r["step"]] = int(r["snapshot_interval"])
    if len(lag) < 5:
        return None
    return statistics.median(lag.values()), statistics.median(interval.values())


def _ab_overhead(rows: list[dict]) -> float | None:
    """Overhead from an in-run A/B run (``ft.snapshot_ab_block_steps``): a snapshot taken after
    step n is copied and replicated during step n + 1, so step n + 1 belongs to the arm of n's
    ``snapshot`` flag. Returns median(on) / median(off) - 1, or None without both arms."""
    flag = {(r.get("rank"), r["step"]): r.get("snapshot") for r in rows}
    on, off = [], []
    for r in rows:
        prev = flag.get((r.get("rank"), r["step"] - 1))
        if prev is True:
            on.append(float(r["step_time_s"]))
        elif prev is False:
            off.append(float(r["step_time_s"]))
    if len(on) < 5 or len(off) < 5:
        return None
    return statistics.median(on) / statistics.median(off) - 1.0


def _swapped(x: dict) -> bool:
    return x.get("fallback") not in RELAUNCHED and x.get("outcome") != "unrecoverable"


def _recs(runs, key) -> list[tuple[dict, dict]]:
    """(run, recovery) pairs of hot-swap recoveries that measured ``key``."""
    return [(r, x) for r in runs for x in r["recoveries"] if x.get(key) is not None and _swapped(x)]


def _fit_relaunch(runs, vals, src, names) -> None:
    rl = [(r, x) for r in runs for x in r["recoveries"]
          if x.get("fallback") in RELAUNCHED and x.get("start_s") is not None]
    if not rl:
        return
    vals["requeue_s"] = statistics.median(float(x["teardown_s"]) for _, x in rl)
    src["requeue_s"] = f"median teardown_s of {len(rl)} relaunches ({names})"
    vals["ckpt_latency_s"] = statistics.median(float(x["load_s"]) for _, x in rl)
    src["ckpt_latency_s"] = f"median load_s of {len(rl)} relaunches ({names})"
    # an elastic relaunch records the width it relaunched at; a restart keeps the run's
    ws = np.array([float(x.get("dp") or r["dp"]) * r["tp"] * r["pp"] for r, x in rl])
    y = np.array([float(x["start_s"]) + float(x["rebuild_s"]) + float(x["first_step_s"]) for _, x in rl])
    sizes = sorted(set(int(w) for w in ws))
    if len(sizes) >= 3 and len(rl) >= 4:
        res = lsq_linear(np.column_stack([np.ones_like(ws), np.log2(ws), ws]), y, bounds=(0.0, np.inf))
        a, b, c = (float(v) for v in res.x)
        vals["launch_base_s"], vals["launch_per_log2_nodes_s"], vals["launch_per_node_s"] = a, b, c
        src["launch_base_s"] = src["launch_per_log2_nodes_s"] = src["launch_per_node_s"] = (
            f"lsq_linear start_s + rebuild_s + first_step_s ~ a + b*log2(world_size) + c*world_size, "
            f">= 0, on {len(rl)} relaunches, world sizes {sizes} ({names})")
    elif len(sizes) >= 2 and len(rl) >= 3:
        (a, b), _ = curve_fit(lambda w, a, b: a + b * np.log2(w), ws, y,
                              p0=[1.0, 1.0], bounds=([0.0, 0.0], [np.inf, np.inf]))
        vals["launch_base_s"], vals["launch_per_log2_nodes_s"] = float(a), float(b)
        src["launch_base_s"] = src["launch_per_log2_nodes_s"] = (
            f"curve_fit start_s + rebuild_s + first_step_s ~ a + b*log2(world_size) on {len(rl)} "
            f"relaunches, world sizes {sizes} ({names}); per-node term kept from base")
    else:
        b = float(vals["launch_per_log2_nodes_s"])
        c = float(vals.get("launch_per_node_s", 0.0))
        vals["launch_base_s"] = max(0.0, float(np.median(y - b * np.log2(ws) - c * ws)))
        src["launch_base_s"] = (f"median of start_s + rebuild_s + first_step_s - {b}*log2(world_size) - "
                                f"{c}*world_size over {len(rl)} relaunches at one world size ({names}); slopes kept")


def _names(dirs: list[str]) -> str:
    if len(dirs) <= 8:
        return ", ".join("/".join(Path(d).parts[-2:]) for d in dirs)
    root = Path(os.path.commonpath([str(Path(d).resolve()) for d in dirs]))
    try:
        root = root.relative_to(Path.cwd())
    except ValueError:
        pass
    return f"{len(dirs)} runs under {root}"


def fit(runs: list[dict], base: dict) -> tuple[dict, dict]:
    """Returns (values, sources) for every key of ``base``."""
    vals = dict(base)
    src = {k: f"copied from base calibration '{base.get('name', 'default')}' (not measured)" for k in base}
    names = _names([r["_dir"] for r in runs])
    _fit_relaunch(runs, vals, src, names)
    recs = [x for r in runs for x in r["recoveries"] if _swapped(x)]
    ratios = [x for r in runs for x in r.get("_width_ratios", [])]
    if ratios:
        vals["width_scaling_exponent"] = statistics.median(math.log(1.0 / q) / math.log(f) for f, q in ratios)
        src["width_scaling_exponent"] = (f"median log(speed)/log(width fraction) over {len(ratios)} reduced-width "
                                         f"generations ({names})")
        by: dict[float, list[float]] = {}
        for f, q in ratios:
            by.setdefault(round(f, 6), []).append(q)
        vals["width_step_time_ratio"] = [[f, round(statistics.median(q), 6)] for f, q in sorted(by.items())]
        src["width_step_time_ratio"] = (f"[width fraction, median step time there / at full width] over "
                                        f"{len(ratios)} reduced-width generations ({names})")
    runs = [r for r in runs if r.get("strategy", "deadpool") == "deadpool"] or runs

    for key, rec_key in (("detect_crash_s", "detect_s"), ("plan_s", "plan_s")):
        xs = [float(x[rec_key]) for x in recs if x.get(rec_key) is not None]
        if xs:
            vals[key] = statistics.median(xs)
            src[key] = f"median {rec_key} of {len(xs)} recoveries ({names})"
            # a base fitted by sim.calibrate_control_plane has N-dependent terms; these runs
            # measure one small world size, so their median replaces the whole term
            for extra in {"detect_crash_s": ("detect_crash_per_rank_s",),
                          "plan_s": ("plan_base_s", "plan_per_rank_s")}[key]:
                vals.pop(extra, None)
                src.pop(extra, None)

    pts = [(float(r["world_size"]), float(x["rebuild_s"])) for r, x in _recs(runs, "rebuild_s")]
    if pts:
        ws = np.array([p[0] for p in pts])
        y = np.array([p[1] for p in pts])
        if len(set(ws.tolist())) >= 2 and len(pts) >= 3:
            (a, b), _ = curve_fit(lambda w, a, b: a + b * np.log2(w), ws, y,
                                  p0=[1.0, 1.0], bounds=([0.0, 0.0], [np.inf, np.inf]))
            vals["rebuild_base_s"], vals["rebuild_per_log2_gpus_s"] = float(a), float(b)
            src["rebuild_base_s"] = src["rebuild_per_log2_gpus_s"] = (
                f"curve_fit rebuild_s ~ a + b*log2(world_size) on {len(pts)} recoveries, "
                f"world sizes {sorted(set(int(w) for w in ws))} ({names})")
        else:
            b = float(base["rebuild_per_log2_gpus_s"])
            vals["rebuild_base_s"] = max(0.0, float(np.median(y - b * np.log2(ws))))
            src["rebuild_base_s"] = (f"median of rebuild_s - {b}*log2(world_size) over {len(pts)} "
                                     f"recoveries at one world size ({names}); slope kept from base")

    tp = [(float(x["bytes_transferred"]), float(x["transfer_s"])) for x in recs
          if x.get("bytes_transferred") is not None and x.get("transfer_s") is not None]
    if tp:
        b = np.array([p[0] for p in tp])
        y = np.array([p[1] for p in tp])
        if len(set(b.tolist())) >= 2:
            res = lsq_linear(np.column_stack([np.ones_like(b), b / 1e9]), y, bounds=(0.0, np.inf))
            lat, inv_bw = res.x
            vals["transfer_latency_s"] = float(lat)
            src["transfer_latency_s"] = f"lsq_linear transfer_s ~ latency + bytes/bw on {len(tp)} recoveries ({names})"
            if inv_bw > 0:
                vals["transfer_gbps_per_node"] = float(1.0 / inv_bw)
                src["transfer_gbps_per_node"] = src["transfer_latency_s"]
        else:
            lat = float(base["transfer_latency_s"])
            bw = [bb / 1e9 / (yy - lat) for bb, yy in tp if yy > lat and bb > 0]
            if bw:
                vals["transfer_gbps_per_node"] = statistics.median(bw)
                src["transfer_gbps_per_node"] = (f"median bytes/(transfer_s - {lat}) over {len(bw)} "
                                                 f"recoveries of one size ({names}); latency kept from base")

    warm = [max(0.0, (float(x["first_step_s"]) - float(r["step_time_s"])) / float(r["step_time_s"]))
            for r, x in _recs(runs, "first_step_s") if float(r["step_time_s"]) > 0]
    if warm:
        vals["warmup_steps"] = statistics.median(warm)
        src["warmup_steps"] = f"median (first_step_s - step_time_s)/step_time_s over {len(warm)} recoveries ({names})"

    snap = [r for r in runs if r["snapshot"].get("enabled")]
    ab = [r["_ab_overhead"] for r in runs if "_ab_overhead" in r]
    if ab:
        vals["snapshot_overhead_frac"] = max(0.0, statistics.median(ab))
        src["snapshot_overhead_frac"] = (f"step time with/without snapshots - 1, from {len(ab)} in-run "
                                         f"A/B run(s) ({names})")
    if snap:
        fr = []
        for r in snap:
            if "_metrics_step_median" in r and r["_metrics_step_median"] > 0:
                fr.append(r["_metrics_blocked_median"] / r["_metrics_step_median"])
            elif float(r["step_time_s"]) > 0:
                fr.append(float(r["snapshot"]["blocked_s_median"]) / float(r["step_time_s"]))
        if not ab:  # main-thread blocked time only: a lower bound (misses CPU/bandwidth contention)
            vals["snapshot_overhead_frac"] = max(0.0, statistics.median(fr))
            src["snapshot_overhead_frac"] = (f"median snapshot_blocked_s / step_time_s over {len(snap)} runs "
                                             f"(metrics.jsonl where present, else summary.json; a lower "
                                             f"bound) ({names})")
        measured = [r for r in snap if "_protection_lag" in r]
        if measured:  # the runtime's own record: lag behind the newest step, interval it chose
            # the lag counts from the newest snapshot step, which is itself up to an interval
            # old; the simulator's lag is the replication delay beyond the snapshot step
            lag = [max(0.0, r["_protection_lag"] - r["_interval"] / 2) for r in measured]
            vals["replicate_lag_steps"] = statistics.median(lag)
            src["replicate_lag_steps"] = (f"median over runs of (protection_lag_steps - interval/2), "
                                          f"from metrics.jsonl of {len(measured)} runs ({names})")
            vals["snapshot_interval_steps"] = statistics.median(r["_interval"] for r in measured)
            src["snapshot_interval_steps"] = (f"median snapshot_interval the runtime chose, from "
                                              f"metrics.jsonl of {len(measured)} runs ({names})")
        else:
            lag = [float(r["snapshot"]["replicate_s_median"]) / float(r["step_time_s"]) for r in snap
                   if float(r["step_time_s"]) > 0]
            vals["replicate_lag_steps"] = statistics.median(lag)
            src["replicate_lag_steps"] = f"median replicate_s_median / step_time_s over {len(lag)} runs ({names})"
            intervals = {int(r["snapshot"]["interval_steps"]) for r in snap}
            if len(intervals) > 1:
                raise CalibrationError(f"runs disagree on snapshot.interval_steps: {sorted(intervals)}")
            vals["snapshot_interval_steps"] = intervals.pop()
            src["snapshot_interval_steps"] = f"snapshot.interval_steps of the runs ({names})"
    return vals, src


def render(vals: dict, src: dict, name: str, run_dirs: Iterable[str]) -> str:
    lines = [f"# Calibration '{name}' fitted by sim.calibrate from runtime runs:"]
    lines += [f"#   {d}" for d in run_dirs]
    lines.append("# Every value says where it came from. Select with calibration=" + name)
    for k, v in vals.items():
        if k == "name":
            lines.append(f"name: {name}")
            continue
        if isinstance(v, float):
            v = float(f"{v:.6g}")
        lines.append(f"{k}: {yaml.safe_dump(v, default_flow_style=True).strip().removesuffix('...').strip()}  # {src[k]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m sim.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("run_dirs", nargs="+", help="runtime run directories (summary.json, metrics.jsonl), "
                    "or directories to search for them")
    ap.add_argument("--name", default="measured", help="calibration name (config group option)")
    ap.add_argument("--out", default=None, help="output YAML (default sim/conf/calibration/<name>.yaml)")
    ap.add_argument("--base", default="default", help="calibration to take unmeasured values from")
    a = ap.parse_args(argv)
    base_path = sim.config.SIM_CONF_DIR / "calibration" / f"{a.base}.yaml"
    base = yaml.safe_load(base_path.read_text())
    dirs = run_dirs(a.run_dirs)
    runs = [load_run(d) for d in dirs]
    vals, src = fit(runs, base)
    out = Path(a.out) if a.out else sim.config.SIM_CONF_DIR / "calibration" / f"{a.name}.yaml"
    out.write_text(render(vals, src, a.name, a.run_dirs))
    print(f"[calibrate] {len(runs)} runs, {sum(len(r['recoveries']) for r in runs)} recoveries -> {out}")
    for k in FITTED:
        if k in vals:  # a base with plan_base_s (sim.calibrate_control_plane) has no plan_s
            print(f"  {k} = {vals[k]}    ({src[k]})")
    return out


if __name__ == "__main__":
    try:
        main()
    except CalibrationError as e:
        sys.exit(f"sim.calibrate: {e}")
