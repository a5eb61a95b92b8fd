"""The node agent process: ``python -m deadpool.agent --job <run_dir>/job.json --node N``.

Started once per node of ``parallel.ranks_per_node`` launch slots: locally by
``launcher.AgentLauncher`` (one per simulated node), under Slurm by one srun step of one task per
node (``--node-from-env``: the node is the task's SLURM_PROCID; experiments/slurm/deadpool_job.sh).
An in-place regrow starts one more for a new node (``--slots``, ``--first-event``). It creates
the node's board, starts the node's processes as its children (each dies with it:
``PR_SET_PDEATHSIG``, so the agent's death is the loss of its node), and runs these threads around
one ``NodeAgent``:

    main      tick every ft.agent_interval_s: the record and the board beat, one signal (its
              ranks fence themselves when it stops, as the job declares the node lost); the
              coordinator's silence judged on this clock
    cut-off   under srun: a node whose record is silent and whose coordinator's host does not
              answer fences itself (``_fence_self``)
    reader    the coordinator's heartbeat and the job's step (store reads, its own client)
    events    follow the coordinator's pushed events (blocking store waits); a failing event
              is retried, then the node leaves (``agent.loops.EventApplier``), never deaf
    rounds    woken by the board's doorbell (or every 0.1 s): the ranks' agreement words
              (deadpool.store.rounds) and their reports
    waiters   one per child: its exit is written at once (waitpid, milliseconds)

It exits when every child has exited, after writing its last record. SIGTERM, SIGUSR1 or SIGINT
(srun forwards a job's signals to its tasks) ask the coordinator to write the newest step in
memory and stop the job; the agent ends with its processes (``deadpool.launch.stop.install_agent``).
"""

from __future__ import annotations

import time

T_EXEC = time.time()  # this process's interpreter is up (the start of a child it forks, too)

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from datetime import timedelta
from functools import partial
from pathlib import Path

from deadpool.agent.board import NODE_DIR_ENV, NODE_INDEX_ENV, Doorbell, NodeBoard, waker_name
from deadpool.agent.events import EventFollower
from deadpool.agent.loops import EventApplier, store_reader
from deadpool.agent.node import NodeAgent
from deadpool.agent.presence import PROBE_S, PresenceClient
from deadpool.agent.shm import UnsafeNodeDir, make_node_dir
from deadpool.launch.procs import fork_worker, job_env, local_rank, sigkill, start_worker
from deadpool.launch.stop import ask_timeout_s, install_agent
from deadpool.rank import netif
from deadpool.rank.groups import layout_group_keys
from deadpool.store import auth
from deadpool.store.protocol import Seal
from deadpool.topology import node_slots, num_nodes

PR_SET_PDEATHSIG = 1
LAST_RECORD_S = 2.0  # the agent's last record (its processes' exits), written within this or not
ROUNDS_IDLE_S = 0.1  # the agent looks at its ranks' words when its doorbell rings, or this often


def node_dir(cfg: dict, node: int, environ=os.environ) -> Path:
    """Where the node's board and plans live: node-local shared memory (/dev/shm) when there is
    one, else the temporary directory; named after the job's run directory (and the Slurm job).

    Never the run directory: under Slurm that is a shared file system (NFS, Lustre), where a
    mapped board would be written back over the network on every beat and every node would see
    the others' files. Not $TMPDIR first either: a site may point it at shared scratch. /dev/shm
    is RAM on the node itself, so the board costs no I/O and dies with the node. The Slurm job id
    in the name keeps two jobs on one node apart even with the same run directory (a resubmission
    while the last job's step still ends). A SIGKILLed agent leaves its (tiny) directory behind;
    the next agent of the same job and node removes it. The name is predictable: it is made
    with ``agent.shm.make_node_dir``, which refuses a parent it does not own alone."""
    tag = hashlib.blake2b(str(Path(cfg["run_dir"]).resolve()).encode(), digest_size=6).hexdigest()
    job = environ.get("SLURM_JOB_ID")
    if job:
        tag = f"{tag}-j{job}"
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"deadpool-{os.getuid()}-{tag}" / f"node{node}"


# the variables srun sets for one task: the agent's, not its children's (a child is no srun task)
SRUN_TASK_ENV = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_TASK_PID", "SLURM_GTIDS")


def slurm_node(environ=os.environ) -> int:
    """The node index of an agent started by srun with one task per node: the task's
    SLURM_PROCID (equal to SLURM_NODEID in such a step; unlike it, also right for a test step of
    several agents on one machine), else SLURM_NODEID."""
    for name in ("SLURM_PROCID", "SLURM_NODEID"):
        if environ.get(name, "").strip():
            return int(environ[name])
    raise ValueError("--node-from-env: neither SLURM_PROCID nor SLURM_NODEID is set (not under srun?)")


def child_env(env: dict, index: int, external: bool, num_devices: int | None = None) -> dict:
    """The environment of the node's ``index``-th process (its record on the board).

    Under srun (``external``) the node's GPUs are all visible to the agent: a child's device is
    its local index, round-robin over them, in LOCAL_RANK (worker.main selects
    ``cuda:SLURM_LOCALID`` else ``cuda:LOCAL_RANK``); the agent's own task variables are dropped,
    so a child does not pass for the agent's srun task. Locally the simulated nodes share one
    machine's GPUs: ``start_worker`` picks the device from the slot (LOCAL_RANK)."""
    out = dict(env, **{NODE_INDEX_ENV: str(index)})
    if external:
        for name in SRUN_TASK_ENV:
            out.pop(name, None)
        out["LOCAL_RANK"] = str(local_rank(index, num_devices))
    return out


def describe(cfg: dict) -> str:
    """``<agents> <nodes>`` for the Slurm job body: whether the job runs node agents, and how many
    (one srun task each)."""
    return f"{int(bool(cfg['launcher'].get('agents')))} {num_nodes(cfg)}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True)
    where_ = ap.add_mutually_exclusive_group(required=True)
    where_.add_argument("--node", type=int)
    where_.add_argument("--node-from-env", action="store_true",
                        help="the node is this srun task's SLURM_PROCID (one task per node)")
    where_.add_argument("--describe", action="store_true",
                        help="print '<agents> <nodes>' of the job file and exit (deadpool_job.sh)")
    ap.add_argument("--slots", help="this node's slots, comma-separated (a node joining a running "
                                    "job, launcher.AgentLauncher.add_slots); default: the job's")
    ap.add_argument("--first-event", type=int, default=0,
                    help="follow the event log from this event on (a node joining later)")
    args = ap.parse_args(argv)
    job_json = Path(args.job)
    cfg = json.loads(job_json.read_text())
    if args.describe:
        print(describe(cfg))
        return 0
    external = cfg["launcher"]["name"] != "local"
    if args.node_from_env:
        args.node = slurm_node()
    if not args.slots and not 0 <= args.node < num_nodes(cfg):
        print(f"[agent] node {args.node}: the job has {num_nodes(cfg)} node(s) of "
              f"parallel.ranks_per_node slots; start one agent per node", flush=True)
        return 2
    ft, run_dir = cfg["ft"], Path(cfg["run_dir"])
    secret = auth.load_secret()
    seal = Seal(secret)
    host, port = cfg["_store"]["host"], int(cfg["_store"]["port"])

    def open_store(timeout_s: float = 60.0):
        return auth.open_store(host, port, secret, timeout_s)

    slots = [int(x) for x in args.slots.split(",")] if args.slots else node_slots(cfg, args.node)
    where = node_dir(cfg, args.node)
    try:
        make_node_dir(where)
    except UnsafeNodeDir as e:
        print(f"[agent {args.node}] {e}", flush=True)
        return 2
    board = NodeBoard.create(where / "board", slots)
    bell = Doorbell(where)  # before the children start: each opens it once
    wakers = [Doorbell(where, waker_name(i)) for i in range(len(slots))]  # each child's
    procs: dict[int, object] = {}
    # the record's own client, used by the writer thread only (its answer to a record may never
    # come: a stopped coordinator's store does not time out)
    record_timeout_s = max(0.5, min(2.0, float(ft.get("node_timeout_s", 3.0)) / 3))
    # (its connect as patient as any client's: a store that many agents reach at once on loaded
    # cores answers late; its requests are bounded after that)
    store = open_store()
    store.set_timeout(timedelta(seconds=record_timeout_s))
    agent = NodeAgent(args.node, board, store, seal, ft, where,
                      kill=lambda slot: sigkill(procs.get(slot)),
                      group_keys=partial(layout_group_keys, cfg),
                      wake=lambda: [w.ring() for w in wakers])
    agent.ack_records = True
    agent.on_forged = lambda name: print(f"[agent {args.node}] {name} not sealed by the job: "
                                         "ignored", flush=True)
    agent.publish()  # (the agent guards its own state: agent.lock, never held across a store call)
    env = job_env(secret, netif.socket_env(cfg))  # this host's interface, never assumed
    env[NODE_DIR_ENV] = str(where)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    # launcher.fork_workers: the children are forks of this process (no thread runs yet), each
    # saving an interpreter start and a torch import; else each is a new interpreter
    fork = bool(cfg["launcher"].get("fork_workers"))
    for i, slot in enumerate(slots):
        start = partial(fork_worker, t_exec=T_EXEC) if fork else start_worker
        procs[slot], _ = start(run_dir, job_json, slot, child_env(env, i, external),
                               bool(cfg["launcher"].get("share_gpu")),
                               preexec_fn=_die_with_parent, keep_local_rank=external)
    print(f"[agent {args.node}] started slots {slots} (board {where})", flush=True)
    presence = _presence(cfg, args.node, secret, external)  # (a thread: after any fork)
    stop = threading.Event()

    def coordinator_lost():  # a signal with the store unreachable: its ranks write what they hold
        with agent.lock:
            agent.lose_coordinator()

    # SIGTERM, SIGUSR1, SIGINT (srun forwards a job's signals): the coordinator stops the job and
    # this agent ends with its processes, or kills them once the coordinator's bound is past
    install_agent(args.node, open_store, seal, procs, coordinator_lost, stop,
                  partial(_leave, where),
                  float(ft["stop_timeout_s"]) + float(ft["coordinator_timeout_s"]), ask_timeout_s(ft))

    def wait_child(slot, p):
        code = p.wait()
        try:
            agent.on_exit(slot, code)
        except Exception:  # the store is gone (the job ended): the exit is kept for the
            pass           # last record, which the main loop still tries to write

    waiters = [threading.Thread(target=wait_child, args=(s, p), daemon=True, name=f"wait-{s}")
               for s, p in procs.items()]
    for t in waiters:
        t.start()

    def deaf(why):  # events it cannot apply: the node leaves rather than stay deaf but fresh
        print(f"[agent {args.node}] leaving the job: its events cannot be applied ({why})",
              flush=True)
        for p in procs.values():
            sigkill(p)
        _leave(where, code=5)

    def follow():
        events = EventFollower(lambda: open_store(timeout_s=max(60.0, ft["coordinator_timeout_s"])),
                               seal, on_forged=lambda i: print(
                                   f"[agent {args.node}] event {i} without the job's secret ignored",
                                   flush=True))
        events.i = args.first_event
        apply = EventApplier(agent, lambda: open_store(timeout_s=10.0),
                             give_up_s=float(ft.get("node_timeout_s", 3.0)),
                             log=lambda m: print(m, flush=True), on_deaf=deaf)
        while not stop.is_set():
            try:
                ev = events.next(stop)
            except Exception:  # the store is gone: the coordinator died
                agent.check_coordinator(error=True)
                time.sleep(0.5)
                continue
            if ev is not None and not apply(ev):
                return

    threading.Thread(target=follow, daemon=True, name="events").start()
    threading.Thread(target=store_reader, args=(agent, open_store, stop, agent.coord_every_s * 2),
                     daemon=True, name="agent-reader").start()

    def rounds():  # the ranks' agreements (deadpool.store.rounds): their words on the board, folded
        reports = None  # and written as soon as they move; their reports sent on, on a client
        while not stop.is_set():  # of this thread's (a post waits for its answer: never the
            try:  # record's client)
                if reports is None:
                    reports = open_store(timeout_s=10.0)
                agent.check_rounds(reports)
            except ValueError:  # the board was closed: the agent is ending
                return
            except Exception:  # a store hiccup: a fresh client; try again later
                reports = None
            bell.wait(ROUNDS_IDLE_S)

    threading.Thread(target=rounds, daemon=True, name="agent-rounds").start()

    def cut_off():  # apart from the tick, which may be stuck in a store call when cut off
        while not stop.wait(float(ft.get("agent_interval_s", 0.25))):
            # probed from half a second before the coordinator's node timeout, so that the node
            # has stopped by the time the job declares it lost
            if agent.silent_for() > agent.node_timeout_s - PROBE_S and presence.cut_off():
                _fence_self(args.node, agent.silent_for(), procs, where)

    if presence is not None:
        threading.Thread(target=cut_off, daemon=True, name="agent-cut-off").start()
    def reconnect(err):  # on the writer's thread: a connect to a stopped host may block long
        store = _reopen(open_store, err, args.node)
        if store is not None:
            store.set_timeout(timedelta(seconds=record_timeout_s))
            agent.store = store

    def writer():  # the records, written and acknowledged apart from the tick
        while not stop.is_set():
            try:
                agent.run_writer(stop)
            except Exception as e:  # a store hiccup: a fresh client, the newest record again
                reconnect(e)
                time.sleep(0.1)

    threading.Thread(target=writer, daemon=True, name="agent-writer").start()
    interval = float(ft.get("agent_interval_s", 0.25))
    while any(t.is_alive() for t in waiters):
        time.sleep(interval)
        try:
            agent.tick()  # the record handed to the writer, the board beat, on the agent's clock
        except ValueError:  # the board was closed: the agent is ending
            break
    stop.set()

    def last_record():  # not handed to the ending writer, and not waited for long: the writer
        try:  # may hold the client in a request a stopped coordinator's store never answers
            agent._writer = agent.ack_records = False
            agent.observe()
            agent.publish()
        except Exception:
            pass

    last = threading.Thread(target=last_record, daemon=True, name="agent-last-record")
    last.start()
    last.join(LAST_RECORD_S)
    board.close()
    shutil.rmtree(where, ignore_errors=True)
    try:
        where.parent.rmdir()  # the job's directory, once its last node on this machine is gone
    except OSError:
        pass
    return 0


def _presence(cfg: dict, node: int, secret: str, external: bool) -> PresenceClient | None:
    """Under srun: this agent's presence connection to the coordinator (``agent.presence``)."""
    port = cfg["_store"].get("presence")
    if not external or not port:
        return None
    try:
        return PresenceClient(cfg["_store"]["host"], int(port), node, secret).connect()
    except OSError as e:
        print(f"[agent {node}] no presence connection ({e}): a lost node is seen by its silent "
              "record only, and a cut-off one does not fence itself", flush=True)
        return None


def _fence_self(node: int, silent_s: float, procs: dict, where: Path) -> None:
    """This node is cut off: no record has reached the store for ``ft.node_timeout_s``, so the
    coordinator has declared it lost and given its ranks to spares, and its host cannot reach
    the coordinator's. It must not train on, write its state into the job's directories, or
    rejoin when the link returns: every process of the node is killed, now, with the agent."""
    print(f"[agent {node}] cut off: no record reached the store for {silent_s:.1f} s and the "
          "coordinator's host does not answer; the job has declared this node lost. Killing its "
          "processes and leaving", flush=True)
    for p in procs.values():
        sigkill(p)
    _leave(where, code=4)


def _leave(where: Path, code: int = 0) -> None:
    """End the agent now (its processes are gone, its main thread may wait on a store that does
    not answer): the node's directory removed, as at a normal end."""
    shutil.rmtree(where, ignore_errors=True)
    try:
        where.parent.rmdir()
    except OSError:
        pass
    sys.stdout.flush()
    os._exit(code)


def _reopen(open_store, err, node):
    try:
        return open_store(timeout_s=2.0)
    except Exception:
        print(f"[agent {node}] store unreachable ({err})", flush=True)
        return None


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    code = main()
    sys.stdout.flush()
    # no interpreter shutdown: the events thread may be inside a store call (under Slurm the
    # coordinator's store is gone by now, and the thread reconnects), and a daemon thread stopped
    # in C++ during finalization aborts the process ("terminate called without an active
    # exception"), which srun reports as a failed task
    os._exit(code)
