"""Store keys and the messages exchanged between the coordinator and the ranks.

Everything about one generation lives under ``g{generation}/``; keys are never reused across
generations. Process-level keys (heartbeats, fault records) are keyed by the launch slot ``slot``,
which does not change when the process changes rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field


class Keys:
    def __init__(self, generation: int):
        self.g = generation
        p = f"g{generation}/"
        self.abort = p + "abort"
        self.num_errors = p + "num_errors"
        self.finished_count = p + "num_finished"
        self.protected_count = p + "num_protected"
        self._p = p

    def error(self, rank: int) -> str:
        return f"{self._p}error/{rank}"

    def status(self, rank: int) -> str:
        return f"{self._p}status/{rank}"

    def timing(self, rank: int) -> str:
        return f"{self._p}timing/{rank}"

    def first_step(self, rank: int) -> str:
        return f"{self._p}first_step/{rank}"

    def protected(self, rank: int) -> str:
        return f"{self._p}protected/{rank}"

    def repl_done(self, step: int) -> str:
        return f"{self._p}repl_done/{step}"

    def failed(self, rank: int) -> str:
        return f"{self._p}failed/{rank}"

    @staticmethod
    def plan(generation: int) -> str:
        return f"plan/{generation}"

    @staticmethod
    def heartbeat(slot: int) -> str:
        return f"hb/{slot}"

    @staticmethod
    def fault(slot: int) -> str:
        return f"fault/{slot}"

    def checkpointed_count(self) -> str:
        return f"{self._p}num_checkpointed"

    @staticmethod
    def crash(slot: int) -> str:
        return f"crash/{slot}"

    @staticmethod
    def fence(slot: int) -> str:
        return f"fence/{slot}"

    @staticmethod
    def fault_fired(rank: int, step: int, phase: str) -> str:
        return f"fault_fired/{rank}/{step}/{phase}"

    @staticmethod
    def spare_ready(slot: int) -> str:
        return f"spare_ready/{slot}"

    @staticmethod
    def final(rank: int) -> str:
        return f"final/{rank}"

    JOB_DONE = "job/done"
    PROGRESS = "job/progress"  # rank 0's latest progress line
    JOB_STOP = "job/stop"


@dataclass
class Plan:
    """What every process does in ``generation``. Written once by the coordinator."""

    generation: int
    action: str                       # "train" | "checkpoint_and_stop" | "stop"
    assignments: dict[int, int]       # rank -> launch slot
    resume_step: int
    # rank -> {"kind": "live" | "local" | "replica", "holder": rank holding the replica}
    sources: dict[int, dict] = field(default_factory=dict)
    reason: str = ""
    t_written: float = 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["assignments"] = {str(k): v for k, v in self.assignments.items()}
        d["sources"] = {str(k): v for k, v in self.sources.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str | bytes) -> "Plan":
        d = json.loads(s)
        d["assignments"] = {int(k): v for k, v in d["assignments"].items()}
        d["sources"] = {int(k): v for k, v in d["sources"].items()}
        return cls(**d)

    def rank_of_slot(self, slot: int) -> int | None:
        for r, s in self.assignments.items():
            if s == slot:
                return r
        return None


@dataclass
class RankStatus:
    """What a survivor reports after an abort: which states it can resume from."""

    rank: int
    slot: int
    live_step: int | None                 # last completed optimizer step in live memory
    local_steps: list[int]                # complete local snapshots
    replicas: dict[int, list[int]]        # owner rank -> verified replica steps held

    def to_json(self) -> str:
        d = asdict(self)
        d["replicas"] = {str(k): v for k, v in self.replicas.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str | bytes) -> "RankStatus":
        d = json.loads(s)
        d["replicas"] = {int(k): v for k, v in d["replicas"].items()}
        return cls(**d)


def now() -> float:
    return time.time()
