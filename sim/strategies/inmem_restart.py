"""In-memory checkpoint with job restart (Gemini-like, SOSP'23).

The copy lives where DeadPool's does: per-step snapshots in host memory, replicated to a
buddy's host memory over the same network (same measured overhead, same interval and lag from
``sim.network``, same buddy placement and disk fallback). What differs is the recovery: every
failure restarts the job (requeue + relaunch, as checkpoint/restart) and loads state from host
memory instead of storage (the replacement node's state comes from its buddy: one transfer).
Comparing it with DeadPool isolates "hot swap vs restart"; comparing it with checkpoint/restart
isolates "where the copy lives".

Gemini itself picks checkpoint frequency and placement groups to fit its traffic; here those
are the shared snapshot engine's settings, so only the recovery mechanism differs.
"""

from __future__ import annotations

from sim.strategies.deadpool import DeadPool


class InMemoryRestart(DeadPool):
    def resume(self):
        yield from self.phase("restart", self.p.memory_restart_s)
        self.ledger.count("restarts")
