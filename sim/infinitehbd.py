"""The InfiniteHBD fault trace (a real trace of 400 GPU servers): episodes and replay traces.

The shipped half (``sim/data/infinitehbd/``, days 0-174, Apache-2.0, see its NOTICE) lists, per
server, ``fault_start`` / ``fault_end`` events that alternate in file order. ``load`` pairs them
into ``Episode`` rows (a server unavailable from ``start_d`` to ``end_d``; a fault still open at
the horizon is ``censored`` and ends there). The population is 400 servers: the 159 that failed
are named in the file, the other 241 never appear (``POPULATION``).

``to_trace`` turns the episodes into a ``sim.trace.Trace`` for one job on ``job_nodes`` of the
400 servers with ``num_spares`` spares from the rest. Which physical server holds which slot is
a seeded permutation of the 400 (``seed``): slot i of the job is server ``perm[i]``, the next
``num_spares`` are the pool, the rest are outside the allocation (their faults are ignored).
Repair times are the trace's (``fault_end - fault_start``), not drawn.

Fault classes are mapped onto the simulator's cause vocabulary (``CAUSES``), so that the shared
calibration's lists decide what each strategy must do: a link or NIC fault leaves processes
hung (``hang_causes``: the progress watchdog detects it), a power supply, fan, motherboard or
system crash takes the host down (``node_causes`` where the calibration gives them), a GPU fault
ends a process (a crash), a software fault is transient (``TRANSIENT``: the process restarts on
the same server once it is back; the server is away only for the trace's short repair time).
Every fault makes the server unavailable for its repair time, whatever the class: a hot swap
replaces it; a restart waits for a spare or for it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from sim.trace import DAY_S, FAIL, Trace

DATA_DIR = Path(__file__).resolve().parent / "data" / "infinitehbd"
HALF_TRACE = DATA_DIR / "fault_trace_days_0_174.json"
POPULATION = 400  # servers in the published trace (those that never failed are not listed)
GPUS_PER_SERVER = 8
HORIZON_DAYS = 174.0  # the shipped half: every event with event_time < 174

# (Level, Class) -> simulator cause. The calibration classifies causes (hang_causes, node_causes,
# sdc_causes; the rest are crashes); TRANSIENT causes recover in place.
CAUSES: dict[tuple[str, str], str] = {
    ("Hardware Failure", "GPU"): "faulty_gpu",
    ("Hardware Failure", "Parameter Plane Cable"): "network_switch_cable",
    ("Hardware Failure", "NIC"): "nic",
    ("Hardware Failure", "Power Supply"): "psu",
    ("Hardware Failure", "Fan"): "server_chassis",
    ("Hardware Failure", "Motherboard Battery"): "io_board",
    ("Other Failure", "System Crash"): "server_chassis",
    ("Other Failure", "Unknown Error"): "unknown_error",
    ("Other Failure", "Stress Test Failure"): "stress_test_failure",
    ("Software Failure", "Other Failures"): "software_bug",
    ("Software Failure", "File System"): "ssd",
}
TRANSIENT = ("software_bug",)


@dataclasses.dataclass(frozen=True)
class Episode:
    """One fault: ``server`` (index 0..158 in order of first appearance) unavailable from
    ``start_d`` to ``end_d`` days; ``censored`` when still open at the horizon."""

    server: int
    start_d: float
    end_d: float
    level: str
    fault_class: str
    desc: str
    censored: bool

    @property
    def repair_d(self) -> float:
        return self.end_d - self.start_d

    @property
    def cause(self) -> str:
        return cause_of(self.level, self.fault_class)


def cause_of(level: str, fault_class: str) -> str:
    """The simulator cause of a trace class (unknown classes keep a slug of their own: a crash)."""
    return CAUSES.get((level, fault_class), fault_class.lower().replace(" ", "_"))


def load(path: str | Path = HALF_TRACE, horizon_d: float = HORIZON_DAYS) -> list[Episode]:
    """Pair each server's starts and ends (they alternate in file order); sorted by start."""
    events = json.loads(Path(path).read_text())
    ids: dict[str, int] = {}
    open_: dict[int, dict] = {}
    out: list[Episode] = []
    for e in events:
        s = ids.setdefault(e["node_id"], len(ids))
        ft = e["fault_type"]
        if e["event_type"] == "fault_start":
            if s in open_:
                raise ValueError(f"{path}: server {e['node_id']} starts a fault at {e['event_time']} while one is open")
            open_[s] = e
        elif e["event_type"] == "fault_end":
            st = open_.pop(s, None)
            if st is None:
                raise ValueError(f"{path}: server {e['node_id']} ends a fault at {e['event_time']} with none open")
            sf = st["fault_type"]
            out.append(Episode(s, float(st["event_time"]), float(e["event_time"]), sf["Level"], sf["Class"],
                               sf["Desc"], False))
        else:
            raise ValueError(f"{path}: event_type {e['event_type']!r}")
    for s, st in open_.items():
        sf = st["fault_type"]
        out.append(Episode(s, float(st["event_time"]), max(horizon_d, float(st["event_time"])), sf["Level"],
                           sf["Class"], sf["Desc"], True))
    out.sort(key=lambda ep: (ep.start_d, ep.server))
    return out


def server_permutation(seed: int, population: int = POPULATION) -> np.ndarray:
    """Physical server of each slot: a seeded shuffle of the population (seed 0 included)."""
    return np.random.default_rng(np.random.SeedSequence([seed, 0x1BD])).permutation(population)


def to_trace(episodes: list[Episode], job_nodes: int, num_spares: int, seed: int = 0,
             horizon_d: float = HORIZON_DAYS, population: int = POPULATION) -> Trace:
    """A ``Trace`` over the job's slots (``0..job_nodes-1``), its pool (the next ``num_spares``)
    and the servers outside the allocation (the rest): every fault start is a ``fail`` row whose
    duration is the trace's repair time (to the horizon when censored)."""
    if job_nodes + num_spares > population:
        raise ValueError(f"{job_nodes} job nodes + {num_spares} spares exceed the {population} servers")
    perm = server_permutation(seed, population)
    slot_of_server = np.empty(population, dtype=np.int64)
    slot_of_server[perm] = np.arange(population)
    eps = [ep for ep in episodes if ep.start_d < horizon_d]
    causes = tuple(dict.fromkeys(ep.cause for ep in eps))
    return Trace(
        time_s=np.array([ep.start_d * DAY_S for ep in eps], dtype=float),
        node=np.array([slot_of_server[ep.server] for ep in eps], dtype=np.int64),
        event=np.full(len(eps), FAIL, dtype=np.int8),
        cause=np.array([causes.index(ep.cause) for ep in eps], dtype=np.int16),
        duration_s=np.array([max(ep.repair_d, 0.0) * DAY_S for ep in eps], dtype=float),
        causes=causes,
        transient_causes=frozenset(TRANSIENT),
        num_nodes=population,
        horizon_s=horizon_d * DAY_S,
    )


def unavailable_fraction(episodes: list[Episode], t0_d: float, t1_d: float, population: int = POPULATION) -> float:
    """Time-averaged fraction of the population unavailable in [t0, t1) (overlaps clipped)."""
    down = sum(max(0.0, min(ep.end_d, t1_d) - max(ep.start_d, t0_d)) for ep in episodes)
    return down / (population * (t1_d - t0_d))


__all__ = ["Episode", "load", "to_trace", "cause_of", "server_permutation", "unavailable_fraction",
           "HALF_TRACE", "POPULATION", "GPUS_PER_SERVER", "HORIZON_DAYS", "CAUSES", "TRANSIENT"]
