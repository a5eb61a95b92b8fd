"""Store keys and the messages exchanged between the coordinator and the ranks.

Everything about one generation lives under ``g{generation}/``; keys are never reused across
generations. Process-level keys (heartbeats, fault records) are keyed by the launch slot ``slot``,
which does not change when the process changes rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from deadpool import auth


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

    def interval_vote(self, step: int, interval: int) -> str:
        return f"{self._p}interval/{step}/{interval}"

    def interval_voters(self, step: int) -> str:
        return f"{self._p}interval/{step}/voters"

    def repl_done(self, step: int) -> str:
        return f"{self._p}repl_done/{step}"

    def checkpoint_interval(self, rank: int) -> str:
        """A rank's proposed disk checkpoint interval (ft.persist_interval_steps=auto)."""
        return f"{self._p}ckpt_interval/{rank}"

    def failed(self, rank: int) -> str:
        return f"{self._p}failed/{rank}"

    def bad_source(self, rank: int) -> str:
        """A receiver's report that a state it was sent failed its CRC (JSON: holder, owner, step)."""
        return f"{self._p}bad_source/{rank}"

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
    def fault_fired(who: str, step: int, phase: str) -> str:
        return f"fault_fired/{who}/{step}/{phase}"

    @staticmethod
    def spare_ready(slot: int) -> str:
        return f"spare_ready/{slot}"

    @staticmethod
    def final(rank: int) -> str:
        return f"final/{rank}"

    JOB_DONE = "job/done"
    JOB_STEP = "job/step"  # newest step any rank reported (read by idle spares' fault injection)
    COORD_HB = "coord/hb"  # the coordinator's heartbeat: a counter workers watch advance
    PROGRESS = "job/progress"  # rank 0's latest progress line
    JOB_STOP = "job/stop"


@dataclass
class Plan:
    """What every process does in ``generation``. Written once by the coordinator."""

    generation: int
    action: str                       # "train" | "checkpoint_and_stop" | "stop"
    assignments: dict[int, int]       # rank -> launch slot
    resume_step: int
    # rank -> {"kind": "live" | "local" | "peer" | "replica" | "disk", "holder": rank that sends}
    sources: dict[int, dict] = field(default_factory=dict)
    reason: str = ""
    t_written: float = 0.0
    keep_groups: list[str] = field(default_factory=list)  # group keys survivors keep (clean)

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
    live_step: int | None                 # step of the live state; None: holds no rank's state
    local_steps: list[int]                # complete local snapshots
    replicas: dict[int, list[int]]        # owner rank -> replica steps held (not known corrupt)
    groups: dict[str, list[int]] = field(default_factory=dict)  # group key -> [posted, completed]

    def to_json(self) -> str:
        d = asdict(self)
        d["replicas"] = {str(k): v for k, v in self.replicas.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str | bytes) -> "RankStatus":
        d = json.loads(s)
        d["replicas"] = {int(k): v for k, v in d["replicas"].items()}
        return cls(**d)


class Seal:
    """Authenticates control messages (plans, aborts, fences, join announcements) with the job's
    secret, bound to the store key they are written under (deadpool/auth.py). With no secret
    (unit tests on a private store) messages pass unsealed."""

    def __init__(self, secret: str | None):
        self.secret = secret

    def wrap(self, key: str, text: str) -> str:
        return text if self.secret is None else auth.seal(self.secret, text, context=key)

    def unwrap(self, key: str, value: str | bytes) -> str:
        """The message's text; raises ``auth.AuthError`` if it was not sealed by this job."""
        if self.secret is None:
            return value.decode() if isinstance(value, (bytes, bytearray)) else value
        return auth.unseal(self.secret, value, context=key)


def now() -> float:
    return time.time()
