"""Node agents: one process per node between its ranks and the coordinator's store.

Without agents every process polls the store (heartbeats at 20 Hz, the abort key inside every
wait, the plan key while waiting): one store thread then serves O(ranks) requests per second and
saturates at a few thousand ranks. With agents (``launcher.agents=true``)::

    rank  --(shared memory: board.py)-->  node agent  --(one sealed record per interval)-->  store
    rank  --(report files: status, timings)-->  node agent  --(one sealed key per kind)-->  store
    rank  <--(board flags, plan files)--  node agent  <--(pushed events: events.py)--------  coordinator

    board.py    the node's shared memory: beats and progress in, aborts, plans and flags out
    node.py     NodeAgent: judges local liveness, writes the node's record, applies events
    events.py   the coordinator's event log and the agents' blocking follower
    client.py   the rank's side: BoardHeartbeat, NodeLink
    loops.py    the agent's loops that outlive any one failure: events applied, retried or
                escalated (the node leaves rather than go deaf); the store reader
    shm.py      the node's directory, private to the job's user
    files.py    the plan and report files next to the board (written whole, sealed)
    __main__    the agent process: starts the node's processes as children (they die with it)

The coordinator reads node records (``liveness.NodeLiveness``) and pushes aborts, plans and
fences (``launcher.AgentLauncher``); its per-loop work grows with nodes and events, not ranks.
"""
