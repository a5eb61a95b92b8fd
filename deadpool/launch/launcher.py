"""Launchers start and fence the processes of a job; the coordinator never starts them itself.

``LocalLauncher`` starts every worker and warm spare as a child process of the coordinator on this
machine, so process exit is observable (``poll``) and a hung process can be fenced (SIGKILL).
``AgentLauncher`` starts one node agent per (simulated) node instead, each the parent of its
node's processes (new interpreters, or with ``launcher.fork_workers`` forks of the agent:
``fork_worker``); the agents themselves are new interpreters, or with ``launcher.fork_agents``
forks of one pre-imported interpreter (``deadpool.launch.zygote``). Under Slurm srun starts the processes (experiments/slurm/): with node agents
(``launcher.agents``) ``ExternalAgentLauncher`` knows the nodes but holds no process, and learns
and fences through the agents' records and the event log; without them ``ExternalLauncher`` has
no handles: failures are seen through heartbeats and collective errors only, and fencing is a
store key that a remote process's heartbeat thread honours.

Both hand the job's secret (deadpool/store/auth.py) to nobody but the job: ``LocalLauncher`` puts it in
each child's environment only, ``ExternalLauncher`` seals the fences it writes with it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from deadpool.launch.procs import job_env, process_stopped, sigkill, start_worker
from deadpool.launch.zygote import ZygoteChild, ZygoteClient
from deadpool.store import auth
from deadpool.store.protocol import JOIN_GENERATION_ENV, Keys
from deadpool.topology import ParallelDims, node_slots, num_nodes


class Launcher:
    """What every launcher shares: a fence of several processes is a kill of each."""

    def fence(self, slots: list[int]) -> None:
        for slot in slots:
            self.kill(slot)

    def add_slots(self, n: int, generation: int) -> list[int]:
        """Start ``n`` more processes in new slots (a repaired or replacement node joining), to
        join as warm spares from plan ``generation`` on; returns their slots."""
        raise NotImplementedError(f"{type(self).__name__} cannot start processes: the job "
                                  "stays at its width (a regrow in place needs the local launcher)")


class LocalLauncher(Launcher):
    def __init__(self, run_dir: Path, job_json: Path, secret: str | None = None,
                 share_gpu: bool = False):
        self.run_dir = Path(run_dir)
        self.share_gpu = share_gpu  # several NCCL ranks per GPU (nccl_env.share_gpu_env)
        self.job_json = Path(job_json)
        self.secret = secret
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    def start(self, slots: list[int], env: dict | None = None) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        env = env or job_env(self.secret)
        for slot in slots:
            self.procs[slot], self.logs[slot] = start_worker(self.run_dir, self.job_json, slot, env,
                                                             self.share_gpu)

    def add_slots(self, n: int, generation: int) -> list[int]:
        first = max(self.procs) + 1
        slots = list(range(first, first + n))
        self.start(slots, dict(job_env(self.secret), **{JOIN_GENERATION_ENV: str(generation)}))
        return slots

    def poll(self, slot: int) -> int | None:
        """Exit code of the process in ``slot``, or None while it runs."""
        return self.procs[slot].poll()

    def is_stopped(self, slot: int) -> bool:
        """True if the process is stopped (SIGSTOP, traced) or gone, from /proc (Linux)."""
        p = self.procs.get(slot)
        return p is None or p.poll() is not None or process_stopped(p.pid)

    def kill(self, slot: int) -> None:
        """Fence: a declared-dead process must never come back (a SIGSTOPped one would)."""
        sigkill(self.procs.get(slot))

    def wait_all(self, timeout_s: float) -> None:
        for slot, p in self.procs.items():
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill(slot)
                p.wait()

    def log_tail(self, slot: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.logs[slot].read_text().splitlines()[-lines:])
        except OSError:
            return ""


class ExternalLauncher(Launcher):
    """Processes started elsewhere (srun, torchrun): no exit codes, fencing through the store."""

    def __init__(self, store, secret: str | None = None):
        self.store = store  # the job's namespaced store (auth.namespaced)
        self.secret = secret

    def start(self, slots: list[int]) -> None:
        pass

    def poll(self, slot: int) -> int | None:
        return None

    def is_stopped(self, slot: int) -> bool:
        return False  # remote: only the hard heartbeat timeout (or a peer's error) can tell

    def kill(self, slot: int) -> None:
        key = Keys.fence(slot)  # sealed for this key: a copy under another slot's key is refused
        self.store.set(key, "1" if self.secret is None else auth.seal(self.secret, "1", context=key))

    def wait_all(self, timeout_s: float) -> None:
        pass

    def log_tail(self, slot: int, lines: int = 20) -> str:
        return ""


def job_processes(run_dir) -> list[int]:
    """PIDs of this machine's processes whose command line names ``run_dir``'s job file (a job's
    workers and spares): tests and the fault campaign check that none outlives its job."""
    needle = str(Path(run_dir) / "job.json").encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


class AgentLauncher(Launcher):
    """One node agent per node (``deadpool.agent``), each the parent of its node's processes.

    The coordinator never touches a rank's process: exits, stops and beats come from the agents'
    records (``live``, a ``liveness.NodeLiveness``), and a fence is an event the agent carries
    out (``events``, an ``agent.events.EventLog``). An agent's own exit, visible here because it
    is a local child, loses its node at once (its processes die with it); under a remote launcher
    only its silent record would show it."""

    def __init__(self, run_dir: Path, job_json: Path, secret: str | None, cfg: dict, live, events):
        self.run_dir, self.job_json, self.secret = Path(run_dir), Path(job_json), secret
        self.live, self.events = live, events
        self.nodes = {n: node_slots(cfg, n) for n in range(num_nodes(cfg))}
        self.node_of_slot = {s: n for n, slots in self.nodes.items() for s in slots}
        self.ranks_per_node = ParallelDims.from_config(cfg["parallel"]).ranks_per_node
        self.agents: dict[int, subprocess.Popen | ZygoteChild] = {}
        self.fenced: set[int] = set()
        # launcher.fork_agents: the agents are forks of one zygote (None until the first start;
        # False once it could not start: Popen from then on)
        self.zygote = None if cfg["launcher"].get("fork_agents") else False
        self.zygote_server = cfg["launcher"].get("zygote_server")  # zygote_server.py

    def start(self, slots: list[int], env: dict | None = None, extra: tuple = ()) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        env = env or job_env(self.secret)
        for node in sorted({self.node_of_slot[s] for s in slots}):
            log = self.run_dir / "logs" / f"agent{node}.log"
            argv = ["--job", str(self.job_json), "--node", str(node), *extra]
            self.agents[node] = self._forked(argv, env, log, node)
            if self.agents[node] is None:
                self.agents[node] = subprocess.Popen(
                    [sys.executable, "-m", "deadpool.agent", *argv], stdout=open(log, "a"),
                    stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _forked(self, argv: list[str], env: dict, log: Path, node: int) -> ZygoteChild | None:
        """The agent forked by the zygote (started at the first call), or None: no zygote (not
        asked for, or it failed: said once, and the job's agents are new interpreters)."""
        try:
            if self.zygote is None:
                self.zygote = ZygoteClient(self.job_json, job_env(self.secret),
                                           self.run_dir / "logs" / "zygote.log",
                                           server=self.zygote_server)
            if self.zygote:
                return self.zygote.spawn("deadpool.agent.__main__", argv, env, log,
                                         name=f"dp-agent{node}")
        except Exception as e:
            print(f"[deadpool] launcher.fork_agents: the zygote failed ({type(e).__name__}: {e}); "
                  "node agents start as new interpreters", file=sys.stderr, flush=True)
            if self.zygote:
                self.zygote.close(timeout_s=5.0)
            self.zygote = False
        return None

    def add_slots(self, n: int, generation: int) -> list[int]:
        """New nodes (``ranks_per_node`` slots each), each with its own agent that follows the
        event log from now on (older events name plans and keys that may be gone)."""
        first = max(self.node_of_slot) + 1
        slots = list(range(first, first + n))
        env = dict(job_env(self.secret), **{JOIN_GENERATION_ENV: str(generation)})
        for i in range(0, n, self.ranks_per_node):
            node, part = max(self.nodes) + 1, slots[i:i + self.ranks_per_node]
            self.nodes[node] = part
            self.node_of_slot.update({s: node for s in part})
            self.start(part, env, ("--slots", ",".join(map(str, part)),
                                   "--first-event", str(self.events.n)))
        return slots

    def slots_of_node(self, node: int) -> list[int]:
        return self.nodes.get(node, [])

    def node_gone(self, slot: int) -> bool:
        p = self.agents.get(self.node_of_slot.get(slot))
        return p is None or p.poll() is not None

    def poll(self, slot: int) -> int | None:
        code = self.live.exit_code(slot)
        if code is None and self.node_gone(slot):
            return -signal.SIGKILL  # its agent is gone, and every process of the node with it
        return code

    def is_stopped(self, slot: int) -> bool:
        return self.live.stopped(slot) or self.node_gone(slot)

    def kill(self, slot: int) -> None:
        self.fence([slot])

    def fence(self, slots: list[int], abort: int | None = None) -> None:
        """One pushed event for all of ``slots`` (every agent reads each event: a node's loss
        is one event, not one per process). ``abort``: the generation aborted for them, pushed
        as that one event (``{"kind": "abort", "g": g, "slots": [...]}``): at 2,048 nodes each
        event read is 2,048 wake-ups, and the dead are fenced as the abort arrives."""
        new = [s for s in slots if s not in self.fenced]
        for node in {self.node_of_slot.get(s) for s in new}:
            p = self.agents.get(node)
            if p is not None and p.poll() is None and process_stopped(p.pid):
                self.kill_node(node)  # a stopped agent cannot carry out a fence: the node goes
        self.fenced.update(new)
        if abort is not None:  # (the abort must go out whatever was fenced before)
            self.events.push("abort", g=abort, **({"slots": new} if new else {}))
        elif new:
            try:
                self.events.push("fence", slots=new)
            except Exception:  # the store is gone (the job is ending): the agents end with it
                pass

    def kill_node(self, node: int) -> None:
        """SIGKILL a node's agent (its processes die with it): tests' node loss, and the end."""
        sigkill(self.agents.get(node))

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for node, p in self.agents.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_node(node)
                p.wait()
        if self.zygote:  # its agents have exited: it follows them
            self.zygote.close()

    def log_tail(self, slot: int, lines: int = 20) -> str:
        try:
            return "\n".join((self.run_dir / "logs" / f"slot{slot}.log").read_text()
                             .splitlines()[-lines:])
        except OSError:
            return ""


class ExternalAgentLauncher(AgentLauncher):
    """Node agents started elsewhere (``srun --ntasks-per-node=1 python -m deadpool.agent
    --node-from-env``, experiments/slurm/deadpool_job.sh): the coordinator holds no process.

    Everything it knows comes from the agents' records (``live``) and everything it asks goes out
    as events (``events``), as under ``AgentLauncher``; it cannot kill an agent. An agent's death
    ends its presence connection (``agent.presence``: the node is lost at once, job.py); a node
    that hangs or is cut off is lost when its record has been silent for ``ft.node_timeout_s``
    (``liveness.NodeLiveness.beat_lost``): its processes leave by themselves at that timeout
    (a cut-off agent kills them, ``agent.__main__._fence_self``; under a hung agent each does,
    ``agent.client.BoardHeartbeat``), so no fence needs to reach them."""

    def start(self, slots: list[int]) -> None:
        pass  # srun started the agents, and they their processes

    add_slots = Launcher.add_slots  # srun starts the processes: none can join a running step

    def node_gone(self, slot: int) -> bool:
        return False  # no handle: only the node's silent record tells (NodeLiveness)

    def kill_node(self, node: int) -> None:
        pass  # no handle on a remote agent: its ranks are fenced through the event log

    def wait_all(self, timeout_s: float) -> None:
        pass  # the agents leave when the job is done or stopped; srun ends the step
