"""Store keys and the messages exchanged between the coordinator and the ranks.

Everything about one generation lives under ``g{generation}/``; keys are never reused across
generations. Process-level keys (heartbeats, fault records) are keyed by the launch slot ``slot``,
which does not change when the process changes rank.

Messages, each a dataclass with its JSON form:

    Plan            coordinator -> every process: who is which rank in generation g, where each
                    rank's state comes from (``Source``), which groups survivors keep; on the
                    wire in full or as a delta against the previous plan (``deadpool.store.wire``)
    RankStatus      a process -> coordinator after an abort: what it can resume from
    RankTimings     a rank -> coordinator: when it passed each phase of a recovery
    RecoveryRecord  the coordinator's account of one recovery (summary.json's ``recoveries``)
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

from deadpool.store import auth


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

    def node_report(self, kind: str, node: int) -> str:
        """Under node agents: the reports of one ``kind`` (status, timing, first_step, protected)
        of a node's ranks, gathered by its agent (a sealed JSON object, rank -> the report's text,
        rewritten as more arrive): the coordinator reads O(nodes) keys, not O(ranks)."""
        return f"{self._p}{kind}/node/{node}"

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

    def finished(self, rank: int) -> str:
        """A rank finished training in this generation (sealed; ``num_finished`` is only a hint)."""
        return f"{self._p}finished/{rank}"

    def checkpointed(self, rank: int) -> str:
        """A rank wrote its state for a ``checkpoint_and_stop`` plan (sealed; the counter is a hint)."""
        return f"{self._p}checkpointed/{rank}"

    def bad_source(self, rank: int) -> str:
        """A receiver's report that a state it was sent failed its checksum (JSON: holder, owner, step)."""
        return f"{self._p}bad_source/{rank}"

    @staticmethod
    def plan(generation: int) -> str:
        """Plan ``generation`` in its wire form (``deadpool.store.wire.encode_plan``): a delta against
        the plan written before it (in full for a job's first plan). A process reading plans in
        order decodes it against the plan it holds."""
        return f"plan/{generation}"

    @staticmethod
    def plan_full(generation: int) -> str:
        """The same plan in full (``encode_plan(plan, None)``), for a process that holds no plan
        or another one (started later, or ``deadpool.store.wire.BaseMismatch`` on the delta)."""
        return f"plan/{generation}/full"

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

    PLAN_NEWEST = "plan/newest"  # the newest plan's generation (sealed; never collected)
    JOB_DONE = "job/done"
    JOB_STEP = "job/step"  # newest step any rank reported (read by idle spares' fault injection)
    COORD_HB = "coord/hb"  # the coordinator's heartbeat: a counter workers watch advance
    PROGRESS = "job/progress"  # rank 0's latest progress line
    JOB_STOP = "job/stop"
    STOP_TAKEN = "job/stop_taken"  # sealed: the coordinator's loop took a stop request
    COORD_WAKE = "coord/wake"  # set to wake the coordinator's loop (unsealed: it only wakes it)


# under node agents: each agent's record of its node (sealed), and the hint that one changed
NODES_CHANGED = "nodes/changed"  # a wake-up hint for the coordinator (unsealed: it only wakes)


def node_key(node: int) -> str:
    """The key of node ``node``'s agent record."""
    return f"node/{node}"


# a process started after the job began (an in-place regrow, recovery.elastic) waits for plans
# from this generation on, as a warm spare; it never takes the job's first plan as its own start
JOIN_GENERATION_ENV = "DEADPOOL_JOIN_GENERATION"


def coordinator_beat_s(ft) -> float:
    """How often the coordinator's heartbeat (``coord/hb``) advances while its loop turns:
    twenty beats per ``coordinator_timeout_s`` (its readers judge it on their own clocks), at most
    one per ``heartbeat_interval_s``."""
    return max(float(ft["heartbeat_interval_s"]), float(ft["coordinator_timeout_s"]) / 20)


def wake_coordinator(store) -> None:
    """Wake the coordinator's loop now (``agent.events.WakeListener``). Bump the hint it must
    see first (``nodes/changed``, the generation's error count): a wake-up carries nothing, the
    loop reads the hints it woke for."""
    store.set(Keys.COORD_WAKE, b"")


_GENERATION_KEY = re.compile(r"g(\d+)/")
_PLAN_KEY = re.compile(r"plan/(\d+)(/full)?$")


def finished_key(key: str, running: int) -> bool:
    """A key of a generation before ``running``, or a plan before ``running - 1`` (the
    coordinator deletes them once ``running`` trains: ``Coordinator.generation_running``)."""
    m = _GENERATION_KEY.match(key)
    if m:
        return int(m.group(1)) < running
    m = _PLAN_KEY.match(key)
    return m is not None and int(m.group(1)) < running - 1


def announce_abort(store, seal: "Seal", keys: Keys, reason: str) -> None:
    """Declare generation ``keys.g`` failed (the first reason written stays): every rank leaves
    whatever it waits on within one poll of ``keys.abort``."""
    if not store.check([keys.abort]):
        store.set(keys.abort, seal.wrap(keys.abort, reason))


@dataclass
class Source:
    """Where one rank's state at the resume step comes from (``recovery.plan``)::

        live     the rank's own process is already at the resume step
        local    its own process rolls back to its own snapshot of that step
        peer     ``holder``, a data-parallel peer, sends its own (identical) state
        replica  ``holder`` sends the replica it holds of the rank (with a sharded replica, the
                 parameters come from the peer ``shared_from``, or, when no data-parallel copy
                 survives, ``params_from[i]`` sends the replica of the group's i-th ZeRO shard,
                 whose master weights together are the parameters)
        init     drawn afresh from the seed (the state of step 0)
        disk     read from the disk checkpoint in ``dir``
        retiring a planned swap (``recovery.migrate``): the rank's own process, leaving it
                 (``Plan.retire``), sends its snapshot of the resume step; ``holder`` is that
                 process's launch slot, not a rank (it is in no rank of the plan)
    """

    KINDS: ClassVar[tuple[str, ...]] = ("live", "local", "peer", "replica", "init", "disk",
                                        "retiring")

    kind: str
    holder: int
    shared_from: int | None = None
    owner: int | None = None  # whose state the holder sends; differs only under faults.swap_routes
    dir: str | None = None
    params_from: list[int] | None = None  # per data-parallel rank of the group: its shard's holder
    # What the receiver checks, copied from the holders' sealed ``RankStatus`` (never the
    # sender's word): ``crc`` = [shared, unique, header] checksums of the copy ``holder`` sends;
    # ``shared_crc``: of the parameters ``shared_from`` sends; ``params_crc``: per member of
    # ``params_from``, the unique checksum of its shard's replica (None for the rank's own)
    crc: list[int] | None = None
    shared_crc: int | None = None
    params_crc: list[int | None] | None = None

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"source kind {self.kind!r} is not one of {self.KINDS}")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def describe(self) -> str:
        if self.kind == "retiring":
            return f"retiring from slot {self.holder}"
        if self.params_from is not None:
            return (f"{self.kind} from rank {self.holder} + parameters from the master shards on "
                    f"ranks {list(self.params_from)}")
        return f"{self.kind} from rank {self.holder}" + (
            f" + parameters from rank {self.shared_from}" if self.shared_from is not None else "")


@dataclass
class Plan:
    """What every process does in ``generation``. Written once by the coordinator."""

    generation: int
    action: str                       # "train" | "checkpoint" | "checkpoint_and_stop" | "stop"
    assignments: dict[int, int]       # rank -> launch slot
    resume_step: int
    sources: dict[int, Source] = field(default_factory=dict)
    reason: str = ""
    t_written: float = 0.0
    keep_groups: list[str] = field(default_factory=list)  # group keys survivors keep (clean)
    # the generation's parallel layout where it is not the job's configured one (an in-place
    # elastic job: {"dp", "global_dp", "replicas"}, recovery.elastic); empty = as configured
    layout: dict = field(default_factory=dict)
    # slots whose processes leave after this plan: ranks a migration moved to spares
    # (``recovery.migrate``): they send their state (``Source`` kind ``retiring``) and exit once
    # the generation runs (``recovery.pause.retire``)
    retire: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        d = asdict(self)
        d["assignments"] = {str(k): v for k, v in self.assignments.items()}
        d["sources"] = {str(k): v.to_dict() for k, v in self.sources.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, s: str | bytes) -> "Plan":
        d = json.loads(s)
        d["assignments"] = {int(k): v for k, v in d["assignments"].items()}
        d["sources"] = {int(k): Source(**v) for k, v in d["sources"].items()}
        return cls(**d)

    def rank_of_slot(self, slot: int) -> int | None:
        for r, s in self.assignments.items():
            if s == slot:
                return r
        return None

    @functools.cached_property
    def slot_ranks(self) -> dict[int, int]:
        """slot -> rank, built once per plan object (for a plan not changed after, as a decoded
        one: node agents ask it for their few slots, and the plans they decode are shared)."""
        return {s: r for r, s in self.assignments.items()}


@dataclass
class RankStatus:
    """What a survivor reports after an abort: which states it can resume from."""

    rank: int
    slot: int
    live_step: int | None                 # step of the live state; None: holds no rank's state
    local_steps: list[int]                # complete local snapshots
    replicas: dict[int, list[int]]        # owner rank -> replica steps held (not known corrupt)
    groups: dict[str, list[int]] = field(default_factory=dict)  # group key -> [posted, completed]
    # "own/<step>" (its own state) or "<owner>/<step>" (a replica) -> [shared, unique, header]
    # checksums of what it would send (``snapshot.transfer.held_checksums``): the plan copies
    # them into ``Source.crc``, so a receiver checks what the holder reported, not what arrives
    crcs: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> str:
        # (not dataclasses.asdict: its deep copy was half of a node's cost of reporting)
        return json.dumps({"rank": self.rank, "slot": self.slot, "live_step": self.live_step,
                           "local_steps": self.local_steps,
                           "replicas": {str(k): v for k, v in self.replicas.items()},
                           "groups": self.groups, "crcs": self.crcs})

    @classmethod
    def from_json(cls, s: str | bytes) -> "RankStatus":
        d = json.loads(s)
        d["replicas"] = {int(k): v for k, v in d["replicas"].items()}
        return cls(**d)


@dataclass
class RankTimings:
    """When one rank passed each phase of a generation's start (``time.time()``), written under
    ``Keys.timing`` once it is ready to train; the coordinator turns them into the recovery's
    breakdown (``recovery.timeline``)."""

    plan_seen: float
    rebuilt: float | None = None       # its groups of the new generation exist
    transferred: float | None = None   # the state it needed has arrived
    rolled_back: float | None = None   # its live state is at the resume step
    ready: float | None = None         # about to start replication and train
    built: float | None = None         # a spare finished building its rank's stage
    exec: float | None = None          # a (re)launched process: interpreter up
    imported: float | None = None      # ... torch and deadpool imported
    groups_kept: int = 0
    bytes_received: int = 0

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def from_json(cls, s: str | bytes) -> "RankTimings":
        return cls(**json.loads(s))


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()  # a record field never set (left out of the JSON; None is written as null)


@dataclass
class RecoveryRecord:
    """One recovery as summary.json reports it. Fields never set are left out of the JSON; the
    ``*_s`` durations are filled by ``recovery.timeline`` once every rank reported."""

    generation: int
    failed_rank: object = UNSET        # int, list of ints, or None (a planned regrow)
    failed_slot: object = UNSET
    fault: object = UNSET              # the injected fault's kind, "unknown" or "none"
    detected_by: object = UNSET        # exit | heartbeat | progress | exception | collective_error ...
    resume_step: object = UNSET
    steps_recomputed: object = UNSET
    detect_s: object = UNSET
    t_kill: object = UNSET
    t_detect: object = UNSET
    bad_sources: object = UNSET
    spare_slot: object = UNSET
    sources: object = UNSET            # rank -> Source.describe()
    groups_kept: object = UNSET
    plan_s: object = UNSET
    t_plan: object = UNSET
    bytes_transferred: object = UNSET
    outcome: object = UNSET
    fallback: object = UNSET           # disk | restart | shrink | grow
    elastic: object = UNSET            # a shrink or grow: in_place | relaunch
    checkpoint_s: object = UNSET       # in place: the state of the resume step written to disk
    failed_at_step: object = UNSET
    dropped_dp: object = UNSET
    dp: object = UNSET
    t_relaunch: object = UNSET
    teardown_s: object = UNSET
    start_s: object = UNSET
    rebuild_s: object = UNSET
    transfer_s: object = UNSET
    rollback_s: object = UNSET
    load_s: object = UNSET
    build_s: object = UNSET
    exec_s: object = UNSET
    imports_s: object = UNSET
    first_step_s: object = UNSET
    kill_to_training_s: object = UNSET
    kill_to_first_step_s: object = UNSET
    first_kill_to_first_step_s: object = UNSET
    kill_to_protected_s: object = UNSET

    def update(self, **values) -> None:
        for k, v in values.items():
            if k not in self.__dataclass_fields__:
                raise AttributeError(f"RecoveryRecord has no field {k!r}")
            setattr(self, k, v)

    def get(self, name: str, default=None):
        v = getattr(self, name)
        return default if v is UNSET else v

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not UNSET}


class Seal:
    """Authenticates every control message (plans, aborts, fences, join announcements,
    heartbeats, reports, flags) with the job's secret, bound to the store key it is written under
    (deadpool/store/auth.py). With no secret (unit tests on a private store) messages pass unsealed."""

    def __init__(self, secret: str | None):
        self.secret = secret

    def wrap(self, key: str, text: str) -> str:
        return text if self.secret is None else auth.seal(self.secret, text, context=key)

    def unwrap(self, key: str, value: str | bytes) -> str:
        """The message's text; raises ``auth.AuthError`` if it was not sealed by this job."""
        if self.secret is None:
            return value.decode() if isinstance(value, (bytes, bytearray)) else value
        return auth.unseal(self.secret, value, context=key)

    def open(self, key: str, value: str | bytes) -> str | None:
        """``unwrap``, or None for a message this job did not seal (the caller ignores it)."""
        try:
            return self.unwrap(key, value)
        except auth.AuthError:
            return None

    def flag(self, store, key: str) -> bool:
        """A sealed flag (``job/done``, ``job/stop``) is set: it exists and this job sealed it."""
        return store.check([key]) and self.open(key, store.get(key)) is not None

    def count(self, store, key: str, exists: bool = False) -> int:
        """A sealed count (``coord/hb``): -1 if the key is absent, not this job's or not a number.
        ``exists``: the caller saw it before (it stays: one request, not two)."""
        if not exists and not store.check([key]):
            return -1
        text = self.open(key, store.get(key))
        try:
            return -1 if text is None else int(text)
        except ValueError:
            return -1


def now() -> float:
    return time.time()
