"""Trace files: the documented CSV format, and a loader for add/remove node traces.

CSV format (one event per line, header required, ``#`` lines are metadata or comments)::

    # num_nodes=2064
    # horizon_s=4665600
    # transient_causes=software_bug;host_maintenance;nccl_watchdog;dependency
    time_s,node,event,cause,duration_s
    1234.5,17,fail,faulty_gpu,5400.0
    2000.0,3,maintenance,planned,7200.0

- ``time_s``: seconds since the start of the job, non-decreasing.
- ``node``: physical node id, an integer >= 0. Ids below the job's active node count are the
  job's initial slots, the next ``num_spares`` ids are the spare pool.
- ``event``: ``fail`` (unexpected), ``maintenance`` (planned), ``remove`` or ``add``
  (a node leaves or joins, as in spot-instance traces; a removed node is away until its add).
- ``cause``: free text without commas; causes listed in ``transient_causes`` recover in place.
- ``duration_s``: how long the node is away after ``fail``/``maintenance`` (repair, reboot,
  maintenance); 0 for ``add``/``remove``.

Add/remove traces (the shape used by Oobleck/Bamboo spot-instance evaluations): lines of
``time,event,node`` with ``event`` in {add, remove} (also ``+``/``-``), comma or whitespace
separated, optional header, ``#`` comments. ``time`` is multiplied by ``time_unit_s`` (e.g.
0.001 for milliseconds). Node names may be strings; they are numbered in order of first
appearance. A node whose first event is an ``add`` after time 0 is absent until then.

Every malformed line raises ``TraceFormatError`` naming the file and the line number.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from sim.trace import ADD, EVENT_NAMES, FAIL, REMOVE, Trace

CSV_COLUMNS = ("time_s", "node", "event", "cause", "duration_s")


class TraceFormatError(ValueError):
    """A trace file line that cannot be parsed; the message names ``path:line``."""

    def __init__(self, path: str | Path, line: int, msg: str):
        super().__init__(f"{path}:{line}: {msg}")
        self.path, self.line = str(path), line


def save_csv(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in the documented CSV format."""
    with open(path, "w", newline="") as f:
        f.write(f"# num_nodes={trace.num_nodes}\n# horizon_s={trace.horizon_s!r}\n")
        f.write(f"# transient_causes={';'.join(sorted(trace.transient_causes))}\n")
        if trace.initially_down is not None and len(trace.initially_down):
            f.write(f"# initially_down={';'.join(str(int(n)) for n in trace.initially_down)}\n")
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for t, n, e, c, d in zip(trace.time_s, trace.node, trace.event, trace.cause, trace.duration_s):
            w.writerow((repr(float(t)), int(n), EVENT_NAMES[e], trace.causes[c], repr(float(d))))


def _float(path, lineno, text, what, minimum=0.0) -> float:
    try:
        v = float(text)
    except ValueError:
        raise TraceFormatError(path, lineno, f"{what} {text!r} is not a number") from None
    if not math.isfinite(v) or v < minimum:
        raise TraceFormatError(path, lineno, f"{what} {text!r} must be finite and >= {minimum}")
    return v


def load_csv(path: str | Path, horizon_s: float | None = None) -> Trace:
    """Read a trace written by ``save_csv`` (or by hand in the same format)."""
    meta: dict[str, str] = {}
    rows = []
    header_seen = False
    with open(path, newline="") as f:
        for lineno, line in enumerate(f, start=1):
            s = line.strip()
            if not s:
                continue
            if s.startswith("#"):
                if "=" in s:
                    k, v = s[1:].split("=", 1)
                    meta[k.strip()] = v.strip()
                continue
            fields = next(csv.reader([s]))
            if not header_seen:
                if tuple(x.strip() for x in fields) != CSV_COLUMNS:
                    raise TraceFormatError(path, lineno, f"header must be {','.join(CSV_COLUMNS)}, got {s!r}")
                header_seen = True
                continue
            if len(fields) != 5:
                raise TraceFormatError(path, lineno, f"expected 5 fields, got {len(fields)}")
            t = _float(path, lineno, fields[0], "time_s")
            if rows and t < rows[-1][0]:
                raise TraceFormatError(path, lineno, f"time_s {t} goes backwards (previous {rows[-1][0]})")
            try:
                node = int(fields[1])
            except ValueError:
                raise TraceFormatError(path, lineno, f"node {fields[1]!r} is not an integer") from None
            if node < 0:
                raise TraceFormatError(path, lineno, f"node {node} must be >= 0")
            ev = fields[2].strip()
            if ev not in EVENT_NAMES:
                raise TraceFormatError(path, lineno, f"event {ev!r} must be one of {', '.join(EVENT_NAMES)}")
            d = _float(path, lineno, fields[4], "duration_s")
            rows.append((t, node, EVENT_NAMES.index(ev), fields[3].strip(), d))
    if not header_seen:
        raise TraceFormatError(path, 1, "no header line; expected " + ",".join(CSV_COLUMNS))
    causes = tuple(dict.fromkeys(r[3] for r in rows))
    num_nodes = int(meta.get("num_nodes", max((r[1] for r in rows), default=-1) + 1))
    if rows and max(r[1] for r in rows) >= num_nodes:
        raise TraceFormatError(path, 1, f"num_nodes={num_nodes} but a row names node {max(r[1] for r in rows)}")
    horizon = horizon_s if horizon_s is not None else float(meta.get("horizon_s", rows[-1][0] if rows else 0.0))
    down = meta.get("initially_down")
    return Trace(
        time_s=np.array([r[0] for r in rows], dtype=float),
        node=np.array([r[1] for r in rows], dtype=np.int64),
        event=np.array([r[2] for r in rows], dtype=np.int8),
        cause=np.array([causes.index(r[3]) for r in rows], dtype=np.int16),
        duration_s=np.array([r[4] for r in rows], dtype=float),
        causes=causes,
        transient_causes=frozenset(x for x in meta.get("transient_causes", "").split(";") if x),
        num_nodes=num_nodes,
        horizon_s=horizon,
        initially_down=np.array([int(x) for x in down.split(";")], dtype=np.int64) if down else None,
    )


def load_addremove(path: str | Path, time_unit_s: float = 1.0, horizon_s: float | None = None,
                   num_nodes: int | None = None) -> Trace:
    """Read an add/remove node trace into a ``Trace`` of ``remove``/``add`` rows.

    ``num_nodes`` pads the node count (nodes never named in the file are always present).
    """
    ids: dict[str, int] = {}
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            s = line.split("#", 1)[0].strip()
            if not s:
                continue
            fields = [x for x in (s.split(",") if "," in s else s.split()) if x.strip()]
            fields = [x.strip() for x in fields]
            if len(fields) != 3:
                raise TraceFormatError(path, lineno, f"expected 3 fields (time, event, node), got {len(fields)}")
            if not rows and fields[0].lower() in ("time", "time_s", "timestamp"):
                continue  # header
            t = _float(path, lineno, fields[0], "time") * time_unit_s
            if rows and t < rows[-1][0]:
                raise TraceFormatError(path, lineno, f"time {fields[0]} goes backwards")
            ev = {"add": ADD, "+": ADD, "remove": REMOVE, "-": REMOVE}.get(fields[1].lower())
            if ev is None:
                raise TraceFormatError(path, lineno, f"event {fields[1]!r} must be add or remove")
            node = ids.setdefault(fields[2], len(ids))
            rows.append((t, node, ev))
    n = max(len(ids), num_nodes or 0)
    first: dict[int, tuple[int, float]] = {}
    for t, node, ev in rows:
        first.setdefault(node, (ev, t))
    horizon = horizon_s if horizon_s is not None else (rows[-1][0] if rows else 0.0)
    return Trace(
        time_s=np.array([r[0] for r in rows], dtype=float),
        node=np.array([r[1] for r in rows], dtype=np.int64),
        event=np.array([r[2] for r in rows], dtype=np.int8),
        cause=np.zeros(len(rows), dtype=np.int16),
        duration_s=np.zeros(len(rows)),
        causes=("preemption",),
        transient_causes=frozenset(),
        num_nodes=n,
        horizon_s=float(horizon),
        initially_down=np.array(sorted(k for k, (ev, t) in first.items() if ev == ADD and t > 0), dtype=np.int64),
    )


__all__ = ["CSV_COLUMNS", "TraceFormatError", "save_csv", "load_csv", "load_addremove", "FAIL"]
