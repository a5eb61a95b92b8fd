"""Control-plane benchmark: the store protocol with N fake ranks and the real coordinator.

    python experiments/bench_control_plane.py --ranks 512,2048,8192,16384 --out DIR
        [--protocol new,old] [--duration-s 10] [--ranks-per-node 8] [--procs 2] [--threads 8]
        [--dilation 1|auto|D1,D2,...] [--phases steady,exit,node] [--startup-timeout-s 900]

The parts live in ``experiments/control_plane/`` (fake ranks, fake nodes, the coordinator's
side, one size's measurement, the table). Start-up prints a progress line every 10 s (fake
processes alive, slots announced, plan 0 written, plan 0 read by how many), and every wait is
bounded: a size whose start-up is not done within ``--startup-timeout-s`` is reported failed
with where it stood.

``--protocol new`` (node agents, deadpool/agent): per fake node a real ``NodeAgent`` on a real
shared-memory board, following the coordinator's pushed events on its own blocking store
connection, fetching each plan (a delta) once, writing its sealed record every
``ft.agent_interval_s``; the node's processes are fake (they beat into the board at each of the
agent's ticks, write their status next to the board after an abort, which their agent sends on
in one key per node, and see a plan one local poll after their agent has it). The coordinator is the real one with ``liveness.NodeLiveness`` and
the real ``launcher.AgentLauncher`` minus process start-up (as under a remote launcher, a dead
agent shows only as a silent record). An exit is the agent's ``waitpid`` returning; a silent
node is an agent that stops. ``--protocol old`` is what follows:

One process holds the real ``TCPStore`` (``auth.serve_store``) and the real ``Coordinator`` (its
loop: detection, abort, status collection, planning, plan writing) with a launcher stand-in.
``--procs`` other processes hold the N fake ranks plus warm spares, ``--threads`` store
connections each, speaking the worker's store protocol (no torch, no training):

    every heartbeat_interval_s  set hb/<slot> (sealed), get coord/hb, every 4th beat check fence
    every collective_poll_s     a training rank checks g<g>/abort (the abort watcher, rank/comm.py)
    every 10 ms                 a process waiting for a plan checks plan/<g> (every 10th poll
                                also job/stop); an idle spare also reads job/step every 50 ms
    after an abort              post its sealed RankStatus (``reports.post``), then wait for
                                the next plan
    every --snapshot-every-s    a training rank's snapshot agreements (``deadpool.store.rounds``):
                                its replicated step (an ``add`` on ``repl_done/<step>``), and
                                every 16th an interval vote (2 adds, 2 reads)

Under ``--protocol new`` the same agreements go through the board: each node's ranks set their
words, the agent writes its record at once, the coordinator pushes ``protected`` (and the vote's
``interval``) as events every agent follows. Not modelled: the progress line (rank 0 only),
group rendezvous and state transfer. A real rank opens five store connections; the fake ranks of
one thread share one.

Per N it measures, in order:

    steady  ``--duration-s`` of steady state: store requests per second per rank (the fake
            ranks' and the coordinator's; a multi_get counts one), and the coordinator's CPU (its
            loop and heartbeat threads, not the store's own thread) as a fraction of one core
    exit    rank 1's process exits (the launcher's poll reports it) -> detected
            (``exit_detect_s``) -> plan g+1 written (``detect_to_plan_s``: the abort, every
            survivor's status, the crash, error, bad-copy and fault reports, planning, the plan;
            ``recovery_store_ops``: the coordinator's store requests meanwhile, O(nodes +
            failures) with posted reports) -> read by every live fake process
            (``plan_everywhere_s``)
    node    every rank of one node goes silent, no exit seen (as under srun) -> detected
            (``node_detect_s``: bounded below by ``ft.heartbeat_hard_timeout_s``, 10 s, unless
            an abort finds them silent first)

``--dilation D`` multiplies every protocol period and timeout by D (the coordinator's own 10 ms
loop excepted), so the offered load is 1/D: the fake ranks' rates are reported multiplied by D
and the period-driven times (node detection, plan reads) divided by D (undilated equivalents;
an exit is seen by the undilated loop and reported as measured), and D is written in the table (``auto``: N / 256, at least 1; a
list: one per size). Dilation stretches what is driven by periods; the plan's bytes (every rank
reads the whole plan) are not stretched, so ``plan_everywhere_s`` under dilation is optimistic
at large N. ``--phases`` leaves phases out (the node phase waits D x 10 s). A size is ``survived`` when the fake
ranks kept their schedule (lag below one heartbeat interval), the coordinator declared no healthy
rank dead, and both recoveries were planned and read everywhere in time; the sizes after the
first one that does not survive are not run.

Writes ``DIR/table.csv`` (``ranks, protocol, store_ops_per_s_per_rank, exit_detect_s,
node_detect_s, plan_everywhere_s, coordinator_cpu_frac, detect_to_plan_s, recovery_store_ops,
statuses_in_s, plan_after_statuses_s, node_react_ms, coordinator_recovery_cpu_s, dilation,
survived``; ``detect_to_plan_s`` as measured, not divided by D: the nodes' reactions to the
abort are CPU, not periods. Under node agents it is split into ``statuses_in_s`` (detection ->
the last node's statuses sent on: every fake node's reaction, which this machine runs one after
another on its cores and a cluster on every node at once), ``plan_after_statuses_s`` (the rest:
the coordinator's last poll, planning, the plan), ``node_react_ms`` (one node's reaction, its
ranks' status files and its agent sending them, mean CPU) and ``coordinator_recovery_cpu_s``
(the coordinator thread's CPU from detection to plan)) and
``DIR/runs.json``, which also holds ``recovery_cpu``: every process's CPU from the exit to plan 1
less its steady-state rate over as long (the recovery's own work, in the fakes and in the
coordinator's process, store included) and how many cores were busy meanwhile: on 2 cores the
window is as long as that work takes on the cores the steady state leaves. Not modelled in
either protocol: the progress line, group rendezvous and transfers.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    # imported here, not at the top: the fake processes (spawned) run this module's top level
    # again, and need only experiments.control_plane.fake_nodes / fake_ranks, not the
    # coordinator's imports (seconds of start-up each on a loaded machine)
    from experiments.control_plane.table import main

    main()
