"""One size of the benchmark: start-up (progress lines say where it is), steady state, an exit,
a silent node (``run_size``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from deadpool.agent.events import EventLog
from deadpool.control.liveness import NodeLiveness
from deadpool.store import auth
from deadpool.store.protocol import Keys, Seal
from experiments.control_plane.common import (ALIVE, BUILT, DEAD, FIELDS, LAG, OPS, REACT_CPU,
                                              REACT_N, REACT_T, SILENT, WIN, Counted,
                                              plan_read_t, plan_reads)
from experiments.control_plane.coordinator_side import (BenchAgents, BenchCoordinator, Launcher,
                                                        Stop, config, thread_cpu)
from experiments.control_plane.fake_nodes import fake_nodes_process
from experiments.control_plane.fake_ranks import fake_process


def process_cpu(pids) -> dict[int, float]:
    """CPU seconds (user + system) each process has used so far (Linux ``/proc``; {} elsewhere)."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            pass
    return out


def recovery_cpu(before: dict, after: dict, window_s: float, rate: dict, coordinator: int) -> dict:
    """Where the machine's CPU went from the exit to plan 1 (``window_s``): each process's CPU
    then, less what it spends in steady state over as long (``rate``: CPU seconds per second),
    is the recovery's own work; ``window_cores`` what was busy in all (of ``os.cpu_count()``)."""
    used = {p: after[p] - before[p] for p in after if p in before}
    steady = {p: rate.get(p, 0.0) * window_s for p in used}
    fakes = [p for p in used if p != coordinator]
    return {"window_s": window_s, "window_cores": sum(used.values()) / max(window_s, 1e-9),
            "steady_cores": sum(rate.get(p, 0.0) for p in used), "cores": os.cpu_count(),
            "recovery_work_fakes_cpu_s": sum(used[p] - steady[p] for p in fakes),
            "recovery_work_coordinator_process_cpu_s": used.get(coordinator, 0.0)
            - steady.get(coordinator, 0.0)}


def wait_for(cond, timeout_s: float, every_s: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


def wait_startup(coord, procs, stats, nthreads: int, total: int, timeout_s: float,
                 log=print, every_s: float = 10.0) -> str | None:
    """Wait until plan 0 is written and read by all ``total`` fake processes; None, or why not.

    Every ``every_s`` a progress line says where start-up is: how many fake processes are alive
    (spawned, importing), how many slots announced themselves (their node built), whether the
    coordinator saw them all (plan 0 written) and how many read plan 0. Bounded by ``timeout_s``;
    a fake process that died ends the wait at once."""
    def col(i):
        return int(sum(stats[t * FIELDS + i] for t in range(nthreads)))

    t0 = time.monotonic()
    deadline, next_line = t0 + timeout_s, t0 + every_s
    while True:
        built, read = col(BUILT), col(plan_reads(0))
        if 0 in coord.plans and read >= total:
            return None
        now = time.monotonic()
        where = (f"{sum(p.is_alive() for p in procs)}/{len(procs)} fake processes, {built}/{total} "
                 f"slots announced, plan 0 {'written' if 0 in coord.plans else 'not written'}, "
                 f"read by {read}/{total}")
        if not all(p.is_alive() for p in procs):
            return f"start-up: a fake process died ({where})"
        if now > deadline:
            return f"start-up: not done after {timeout_s:.0f} s ({where})"
        if now >= next_line:
            log(f"[bench] start-up {now - t0:.0f} s: {where}", flush=True)
            next_line = now + every_s
        time.sleep(0.05)


class Alive:
    """How many fake processes are alive, recounted at most every ``every_s`` (a count over
    every slot at each 10 ms poll cost the coordinator's process CPU at 16,384 slots)."""

    def __init__(self, flags, slots, every_s: float = 0.5):
        self.flags, self.slots, self.every_s = flags, slots, every_s
        self.t, self.n = -1e9, 0

    def __call__(self) -> int:
        if time.monotonic() - self.t > self.every_s:
            self.n = sum(1 for s in self.slots if self.flags[s] == ALIVE)
            self.t = time.monotonic()
        return self.n


def run_size(n: int, args, protocol: str = "old", log=print) -> dict:
    D, rpn = args.dilation_of[n], args.ranks_per_node
    if n < 2 * rpn or n % rpn:
        raise SystemExit(f"--ranks {n}: needs at least two nodes of --ranks-per-node {rpn}")
    run_dir = Path(tempfile.mkdtemp(prefix="bench_cp_"))  # both removed at the end, also when a
    shm_root = tempfile.mkdtemp(prefix="bench_cp_nodes_",  # fake process had to be terminated
                                dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    cfg = config(n, rpn, D, run_dir)
    ft = cfg["ft"]
    slots = list(range(n + int(ft["num_spares"])))
    secret = auth.new_secret()
    master = auth.serve_store("127.0.0.1", 0, timeout_s=300)
    store = Counted(auth.namespaced(master, secret))
    ctx = mp.get_context("spawn")
    flags = ctx.Array("b", len(slots), lock=False)
    nthreads = args.procs * args.threads
    stats = ctx.Array("d", nthreads * FIELDS, lock=False)
    window = ctx.Value("i", 0, lock=False)
    exit_req = ctx.Value("i", -1, lock=False)
    stop = ctx.Event()
    periods = {"hb": float(ft["heartbeat_interval_s"]), "poll": float(ft["collective_poll_s"]),
               "plan": 0.01 * D, "spare": 0.05 * D, "agent": float(ft["agent_interval_s"]),
               "snap": args.snapshot_every_s * D,
               # a training rank sees the abort on the board within ft.collective_poll_s (10 ms
               # on average): not dilated, as detection -> plan is reported as measured
               "abort": float(ft["collective_poll_s"]) / D / 2}
    live = events = None
    if protocol == "new":
        cfg["launcher"] = dict(cfg["launcher"], agents=True)
        nodes = {node: slots[node * rpn:(node + 1) * rpn] for node in range(-(-len(slots) // rpn))}
        names = sorted(nodes)
        procs = [ctx.Process(target=fake_nodes_process, daemon=True, args=(
            "127.0.0.1", master.port, secret, {k: nodes[k] for k in names[i::args.procs]}, n, rpn,
            periods, ft, flags, stats, i * args.threads, args.threads, window, exit_req, stop,
            shm_root))
            for i in range(args.procs)]
        events = EventLog(store, Seal(secret))
        launcher = BenchAgents(run_dir, run_dir / "job.json", secret, cfg, None, events)
        live = launcher.live = NodeLiveness(
            float(ft["heartbeat_timeout_s"]), float(ft["heartbeat_hard_timeout_s"]),
            float(ft["node_timeout_s"]), launcher.node_of_slot.get)
    else:
        procs = [ctx.Process(target=fake_process, daemon=True, args=(
            "127.0.0.1", master.port, secret, slots[i::args.procs], n, rpn, periods, flags, stats,
            i * args.threads, args.threads, window, stop)) for i in range(args.procs)]
        launcher = Launcher(flags)
    for p in procs:
        p.start()
    coord = BenchCoordinator(cfg, store, launcher, log=lambda line: None, secret=secret,
                             live=live, events=events)
    def run_coordinator():
        try:
            coord.run()
        except Stop:
            pass
    ct = threading.Thread(target=run_coordinator, daemon=True, name="coordinator")
    ct.start()
    out = {"ranks": n, "protocol": protocol, "dilation": D, "survived": False}

    def reads(g):
        return sum(stats[t * FIELDS + plan_reads(g)] for t in range(nthreads))

    def last_read(g):
        return max(stats[t * FIELDS + plan_read_t(g)] for t in range(nthreads))

    def fake_ops():
        return sum(stats[t * FIELDS + OPS] for t in range(nthreads))

    def total(field):
        return sum(stats[t * FIELDS + field] for t in range(nthreads))

    def recovery_parts(g, react0):
        """Where detection -> plan ``g`` went: the nodes' reactions (statuses written, sent on by
        their agents), which this machine runs one after another on its 2 cores and a cluster runs
        on every node at once, and the coordinator's own work (its thread's CPU)."""
        cpu, n = total(REACT_CPU) - react0[0], total(REACT_N) - react0[1]
        t_last = max(stats[t * FIELDS + REACT_T] for t in range(nthreads))
        statuses_in = t_last - coord.found_wall[g]
        return {"statuses_in_s": statuses_in,
                "plan_after_statuses_s": coord.to_plan[g][0] - statuses_in,
                "node_react_ms": cpu / max(1, n) * 1e3, "nodes_reacted": int(n),
                "coordinator_recovery_cpu_s": coord.to_plan_cpu[g]}

    def lag():
        return max(stats[t * FIELDS + LAG] for t in range(nthreads)
                   if stats[t * FIELDS + WIN] == window.value)

    alive = Alive(flags, slots)
    try:
        t0 = time.time()
        why = wait_startup(coord, procs, stats, nthreads, len(slots), args.startup_timeout_s, log)
        if why is not None:
            out["failed"] = why
            return out
        out["startup_s"] = time.time() - t0
        log(f"[bench] start-up done in {out['startup_s']:.1f} s; steady state", flush=True)
        time.sleep(2 * periods["hb"] + 1.0)  # every schedule running
        window.value = 1
        time.sleep(periods["hb"] * 2)
        pids = [os.getpid()] + [p.pid for p in procs]
        ops0, req0, t_a = fake_ops(), store.requests, time.time()
        cpu0, proc0 = thread_cpu(ct) + thread_cpu(coord._beating), time.process_time()
        procs0 = process_cpu(pids)
        time.sleep(args.duration_s)
        ops1, req1, t_b = fake_ops(), store.requests, time.time()
        cpu1, proc1 = thread_cpu(ct) + thread_cpu(coord._beating), time.process_time()
        procs1 = process_cpu(pids)
        cpu_rate = {p: (procs1[p] - procs0[p]) / (t_b - t_a) for p in procs1 if p in procs0}
        # the rest of this process's CPU is the store's own thread (the main thread sleeps)
        out["store_cpu_frac"] = (proc1 - proc0 - (cpu1 - cpu0)) / (t_b - t_a)
        out["steady_lag_s"] = lag() / D
        # the fake ranks' rate undilated; the coordinator's as measured (its 10 ms loop is not
        # dilated, only its heartbeat reads are: this undercounts those at D > 1)
        rate = (ops1 - ops0) / (t_b - t_a) * D + (req1 - req0) / (t_b - t_a)
        out["store_ops_per_s"] = rate
        out["store_ops_per_s_per_rank"] = rate / n
        out["coordinator_cpu_frac"] = (cpu1 - cpu0) / (t_b - t_a)
        out["coordinator_requests_per_s"] = (req1 - req0) / (t_b - t_a)
        out["fake_ops_per_s_per_rank"] = (ops1 - ops0) / (t_b - t_a) * D / n
        if coord.detected:
            bad = coord.detected[0][0]
            out["failed"] = (f"{len(bad)} healthy rank(s) declared failed in steady state, e.g. "
                             f"{dict(list(bad.items())[:4])}")
            return out
        period = float(ft["agent_interval_s" if protocol == "new" else "heartbeat_interval_s"])
        if out["steady_lag_s"] > period / D:
            out["failed"] = f"fake ranks lag their schedule by {out['steady_lag_s']:.3f} s"
        if "exit" not in args.phases:
            out["survived"] = "failed" not in out
            return out
        # exit: rank 1's process exits
        log("[bench] steady state measured; rank 1's process exits", flush=True)
        t_exit, react0 = time.time(), (total(REACT_CPU), total(REACT_N))
        cpu_exit, m_exit = process_cpu(pids), time.monotonic()
        if protocol == "new":
            exit_req.value = coord.members.ranks[1]  # its agent's waitpid returns
        else:
            launcher.exited[coord.members.ranks[1]] = -9
            flags[coord.members.ranks[1]] = DEAD
        if wait_for(lambda: 1 in coord.plans, 120 * D, every_s=0.005):
            out["recovery_cpu"] = recovery_cpu(cpu_exit, process_cpu(pids),
                                               time.monotonic() - m_exit, cpu_rate, os.getpid())
        if not wait_for(lambda: 1 in coord.plans and reads(1) >= alive(), 120 * D):
            out["failed"] = f"exit: plan 1 read by {int(reads(1))} of {alive()}"
            return out
        # an exit is seen by the coordinator's own 10 ms loop, which is not dilated
        out["exit_detect_s"] = coord.detected[0][1] - t_exit
        out["exit_detected_by"] = coord.detected[0][0]
        out["plan_everywhere_s"] = (last_read(1) - coord.plans[1]) / D
        # detection -> plan: the abort, the survivors' statuses (through their agents), reports,
        # faults, planning, the plan; as measured, not divided by D (the nodes' reactions are CPU,
        # not periods), then where it went
        out["detect_to_plan_s"], out["recovery_store_ops"] = coord.to_plan[1]
        out["recovery_store_ops_by_method"] = coord.to_plan_by_method[1]
        if protocol == "new":
            out.update(recovery_parts(1, react0))
        out["plan_bytes"] = len(store.get(Keys.plan(1) if protocol == "new" else Keys.plan_full(1)))
        time.sleep(1.0 * D)
        # a node goes silent (no exit seen)
        log("[bench] exit recovered; the last node goes silent", flush=True)
        if any(r not in coord.members.ranks for r in range(n - rpn, n)):  # (a shrink, not a swap)
            out["failed"] = (f"exit: the recovery left {len(coord.members.ranks)} of {n} ranks "
                             "(more ranks declared failed than spares: the fakes fell behind)")
            return out
        node = [coord.members.ranks[r] for r in range(n - rpn, n)]  # the last node
        t_node, react0 = time.time(), (total(REACT_CPU), total(REACT_N))
        for s in node:
            flags[s] = SILENT
        if "node" not in args.phases:
            out["survived"] = "failed" not in out
            return out
        if not wait_for(lambda: 2 in coord.plans and reads(2) >= alive(), 120 * D):
            out["failed"] = f"node: plan 2 read by {int(reads(2))} of {alive()}"
            return out
        out["node_detect_s"] = (coord.detected[1][1] - t_node) / D
        out["node_detected_by"] = coord.detected[1][0]
        out["plan_everywhere_node_s"] = (last_read(2) - coord.plans[2]) / D
        out["detect_to_plan_node_s"] = coord.to_plan[2][0]
        out["recovery_store_ops_node"] = coord.to_plan[2][1]
        if protocol == "new":
            out.update({k + "_node": v for k, v in recovery_parts(2, react0).items()})
        out["survived"] = "failed" not in out
        return out
    finally:
        stop.set()
        launcher.stopped = True  # ends the coordinator's loop at its next poll
        ct.join(timeout=30)
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        del master
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)


