"""The node agent process: ``python -m deadpool.agent --job <run_dir>/job.json --node N``.

Started once per node (locally by ``launcher.AgentLauncher``, one per simulated node of
``parallel.ranks_per_node`` launch slots). It creates the node's board, starts the node's
processes as its children (each dies with it: ``PR_SET_PDEATHSIG``, so the agent's death is the
loss of its node), and runs three threads around one ``NodeAgent``:

    main      tick every ft.agent_interval_s (record, coordinator heartbeat)
    beat      the agent's own beat on the board, apart from any store request
    events    follow the coordinator's pushed events (blocking store waits)
    waiters   one per child: its exit is written at once (waitpid, milliseconds)

It exits when every child has exited, after writing its last record.
"""

from __future__ import annotations

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
import time
from pathlib import Path

from deadpool import auth
from deadpool.agent.board import NODE_DIR_ENV, NODE_INDEX_ENV, NodeBoard
from deadpool.agent.events import EventFollower
from deadpool.agent.node import NodeAgent
from deadpool.groups import keepable_keys
from deadpool.launcher import job_env, sigkill, start_worker
from deadpool.protocol import Seal
from deadpool.topology import ParallelDims

PR_SET_PDEATHSIG = 1


def node_slots(cfg: dict, node: int) -> list[int]:
    """The launch slots of ``node``: ``ranks_per_node`` consecutive slots (the spares after the
    ranks, on nodes of their own once the ranks' nodes are full)."""
    dims = ParallelDims.from_config(cfg["parallel"])
    n = dims.world_size + int(cfg["ft"]["num_spares"])
    rpn = dims.ranks_per_node
    return [s for s in range(node * rpn, min(n, (node + 1) * rpn))]


def num_nodes(cfg: dict) -> int:
    dims = ParallelDims.from_config(cfg["parallel"])
    n = dims.world_size + int(cfg["ft"]["num_spares"])
    return -(-n // dims.ranks_per_node)


def node_dir(cfg: dict, node: int) -> Path:
    """Where the node's board and plans live: node-local shared memory (/dev/shm) when there is
    one, else the temporary directory; named after the job's run directory."""
    tag = hashlib.blake2b(str(Path(cfg["run_dir"]).resolve()).encode(), digest_size=6).hexdigest()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"deadpool-{os.getuid()}-{tag}" / f"node{node}"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", required=True)
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--slots", help="this node's slots, comma-separated (a node joining a running "
                                    "job, launcher.AgentLauncher.add_slots); default: the job's")
    ap.add_argument("--first-event", type=int, default=0,
                    help="follow the event log from this event on (a node joining later)")
    args = ap.parse_args(argv)
    job_json = Path(args.job)
    cfg = json.loads(job_json.read_text())
    ft, run_dir = cfg["ft"], Path(cfg["run_dir"])
    secret = auth.load_secret()
    seal = Seal(secret)
    host, port = cfg["_store"]["host"], int(cfg["_store"]["port"])

    def open_store(timeout_s: float = 60.0):
        return auth.open_store(host, port, secret, timeout_s)

    slots = [int(x) for x in args.slots.split(",")] if args.slots else node_slots(cfg, args.node)
    where = node_dir(cfg, args.node)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True, mode=0o700)
    board = NodeBoard.create(where / "board", slots)
    procs: dict[int, object] = {}
    store = open_store()
    dims = ParallelDims.from_config(cfg["parallel"])
    agent = NodeAgent(args.node, board, store, seal, ft, where,
                      kill=lambda slot: sigkill(procs.get(slot)),
                      group_keys=keepable_keys(dims, ft["buddy_policy"]))
    lock = threading.Lock()  # the store client and the agent's state are shared by the threads
    with lock:
        agent.publish()
    env = job_env(secret)
    env[NODE_DIR_ENV] = str(where)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for i, slot in enumerate(slots):
        procs[slot], _ = start_worker(run_dir, job_json, slot,
                                      dict(env, **{NODE_INDEX_ENV: str(i)}),
                                      bool(cfg["launcher"].get("share_gpu")),
                                      preexec_fn=_die_with_parent)
    stop = threading.Event()

    def wait_child(slot, p):
        code = p.wait()
        with lock:
            agent.on_exit(slot, code)

    waiters = [threading.Thread(target=wait_child, args=(s, p), daemon=True, name=f"wait-{s}")
               for s, p in procs.items()]
    for t in waiters:
        t.start()

    def follow():
        events = EventFollower(lambda: open_store(timeout_s=max(60.0, ft["coordinator_timeout_s"])),
                               seal, on_forged=lambda i: print(
                                   f"[agent {args.node}] event {i} without the job's secret ignored",
                                   flush=True))
        events.i = args.first_event
        while not stop.is_set():
            try:
                ev = events.next(stop)
            except Exception:  # the store is gone: the coordinator died
                with lock:
                    agent.check_coordinator(error=True)
                time.sleep(0.5)
                continue
            if ev is not None:
                with lock:
                    agent.apply(ev)

    threading.Thread(target=follow, daemon=True, name="events").start()

    def beat():  # the agent's own beat, never behind a store request: its processes leave if it
        while not stop.is_set():  # stops (client.BoardHeartbeat), not when the store is slow
            try:
                board.beat_agent()
            except ValueError:  # the board was closed: the agent is ending
                return
            time.sleep(float(ft.get("agent_interval_s", 0.25)))

    threading.Thread(target=beat, daemon=True, name="agent-beat").start()
    interval = float(ft.get("agent_interval_s", 0.25))
    while any(t.is_alive() for t in waiters):
        time.sleep(interval)
        with lock:
            try:
                agent.tick()
            except Exception as e:  # a store hiccup: the next tick retries
                agent.store = store = _reopen(open_store, e, args.node)
                if store is None:
                    agent.check_coordinator(error=True)
    stop.set()
    with lock:
        try:
            agent.observe()
            agent.publish()
        except Exception:
            pass
    board.close()
    shutil.rmtree(where, ignore_errors=True)
    return 0


def _reopen(open_store, err, node):
    try:
        return open_store(timeout_s=2.0)
    except Exception:
        print(f"[agent {node}] store unreachable ({err})", flush=True)
        return None


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    sys.exit(main())
