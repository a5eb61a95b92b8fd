"""The coordinator's side of the benchmark: the real ``Coordinator`` and agent launcher, with
stand-ins only where a process would be started or killed."""

from __future__ import annotations

import time
from pathlib import Path

from deadpool.control.coordinator import Coordinator
from deadpool.launch.config import compose_config
from deadpool.launch.launcher import AgentLauncher
from experiments.control_plane.common import DEAD


class Stop(Exception):
    """Ends the coordinator's loop once a size is measured."""


class Launcher:
    """The launcher stand-in: an exit is reported by ``poll``; a kill silences the fake slot."""

    def __init__(self, flags):
        self.flags, self.exited, self.stopped = flags, {}, False

    def poll(self, slot):
        if self.stopped:
            raise Stop()
        return self.exited.get(slot)

    def is_stopped(self, slot):
        return False

    def kill(self, slot):
        self.flags[slot] = DEAD

    def fence(self, slots):
        for slot in slots:
            self.kill(slot)

    def log_tail(self, slot, lines=20):
        return ""


class BenchAgents(AgentLauncher):
    """The real agent launcher's coordinator side, with agents started by the benchmark (as
    under a remote launcher: an agent's death is seen only by its silent record)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.stopped = False

    def start(self, slots):
        pass

    def node_gone(self, slot):
        return False

    def poll(self, slot):
        if self.stopped:
            raise Stop()
        return super().poll(slot)


class BenchCoordinator(Coordinator):
    """The real coordinator, noting when it detected each failure and wrote each plan, and per
    recovery how long from its detection to its plan written (``time.monotonic()``) and how
    many store requests the coordinator made meanwhile (abort, fences, status, report and fault
    collection, the plan)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.detected: list[tuple[dict, float]] = []
        self.plans: dict[int, float] = {}
        self.to_plan: dict[int, tuple[float, int]] = {}  # generation -> (seconds, requests)
        self.to_plan_by_method: dict[int, dict[str, int]] = {}
        self.to_plan_cpu: dict[int, float] = {}  # generation -> the coordinator thread's CPU (s)
        self.found_wall: dict[int, float] = {}  # generation -> detection, time.time()
        self._found: tuple[float, int, dict, float] | None = None

    def recover(self, failed, t_detect):
        self.detected.append((dict(failed), t_detect))
        self.found_wall[self.gen + 1] = time.time()
        self._found = (time.monotonic(), self.store.requests,  # (failures() just returned)
                       dict(self.store.by_method), time.thread_time())
        super().recover(failed, t_detect)

    def write_plan(self, p):
        super().write_plan(p)
        self.plans[p.generation] = p.t_written
        if self._found is not None:
            t, n, by, cpu = self._found
            self.to_plan_cpu[p.generation] = time.thread_time() - cpu
            self.to_plan[p.generation] = (time.monotonic() - t, self.store.requests - n)
            self.to_plan_by_method[p.generation] = {
                k: v - by.get(k, 0) for k, v in self.store.by_method.items() if v > by.get(k, 0)}
            self._found = None


def thread_cpu(thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def config(n: int, rpn: int, dilation: float, run_dir: Path) -> dict:
    cfg = compose_config(["model=tiny"], run_dir)
    cfg["parallel"] = dict(cfg["parallel"], dp=n, tp=1, pp=1, ranks_per_node=rpn)
    ft = dict(cfg["ft"], num_spares=rpn + 1, startup_timeout_s=600.0)
    for k in ("heartbeat_interval_s", "heartbeat_timeout_s", "heartbeat_hard_timeout_s",
              "coordinator_timeout_s", "status_timeout_s", "collective_poll_s", "progress_timeout_s",
              "agent_interval_s", "node_timeout_s"):
        ft[k] = float(ft[k]) * dilation
    cfg["ft"] = ft
    cfg["faults"] = dict(cfg["faults"], events=[])
    return cfg


