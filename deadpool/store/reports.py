"""Reading many per-rank reports from the store in few round trips.

The coordinator waits on one key per rank (or per node) at several points: statuses after an
abort, the new generation's timings, error, crash, fault and bad-copy reports, final states.
``TCPStore.check`` is all-of and ``multi_get`` blocks on a key that does not exist yet, so
finding which of N mostly absent keys exist costs up to 2N-1 round trips by probing alone. So
every report the coordinator waits on during a recovery is *posted*:

    post(store, seal, key, text)   a writer's side: the sealed value, then the key's last part
                                   appended to its kind's index (``g3/error/17`` is listed in
                                   ``g3/error/index``): a listed key exists
    read_posted(store, seal, keys)  the sealed values of those of ``keys`` that exist: one
                                   request for the index, two more (``check`` + ``multi_get``)
                                   when it lists any of them: O(1) requests, O(found) bytes
    read(store, seal, keys)        for keys that are expected to exist (node records, joins):
                                   ``present`` + one ``multi_get``
    present(store, keys)           which of ``keys`` exist: one ``check`` when all do, else a
                                   halving search, O(k log(N/k)) round trips for k missing keys
                                   (2N-1 when none exists: never use it for sparse reports)
    Reports                        one kind of sealed per-rank report (``keys.status(r)`` ...)
                                   collected incrementally: each poll asks only about the ranks
                                   still missing, posted ones only when their index changed;
                                   with a ``budget`` (keys written by processes that cannot post,
                                   e.g. join announcements) at most that many requests a poll
    NodeReports                    the same, from one sealed key per node that its agent
                                   rewrites (and posts) as its ranks report (rank -> report)
    send(...)                      a rank's side: its report through its node agent, else posted

An index is a hint, like the ``num_errors`` counter: anyone reaching the store can append to it.
A listed key that does not exist (a forger's entry, a deleted key) costs a probe of the listed
keys only; a value that fails its seal (written by a process without the job's secret) is not
accepted and its rank stays missing: the real report, which overwrites it, is still taken when
it comes.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable

from deadpool.store.protocol import Seal


def send(store, seal: Seal, link, keys, kind: str, rank: int, text: str) -> None:
    """Rank ``rank``'s report of ``kind`` (status, timing, first_step, protected) for the
    coordinator: through its node agent when it has one (``link``: ``agent.client.NodeLink``,
    one key per node), else the sealed key ``getattr(keys, kind)(rank)``."""
    if link is not None:
        link.report(keys.g, kind, rank, text)
    else:
        post(store, seal, getattr(keys, kind)(rank), text)


def index_of(key: str) -> str:
    """The index listing the posted keys of ``key``'s kind: its last part replaced by ``index``
    (``g3/status/5`` -> ``g3/status/index``, ``crash/7`` -> ``crash/index``)."""
    return key.rpartition("/")[0] + "/index"


def post(store, seal: Seal, key: str, text: str) -> None:
    """Write the sealed report ``text`` at ``key``, then list it in its kind's index (in this
    order: a key the index lists exists, so the reader's ``multi_get`` never blocks on it)."""
    store.set(key, seal.wrap(key, text))
    store.append(index_of(key), "," + key.rpartition("/")[2])


_ABSENT = "\x00"  # an index value no writer produces


def peek(store, key: str) -> bytes:
    """``key``'s value, ``b""`` while it does not exist: one request that never blocks
    (``compare_set`` with an expected value nobody writes changes nothing and answers the value
    there, or the expected one when there is none)."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return b"" if value == _ABSENT.encode() else value


def listed(store, keys: list[str]) -> list[str]:
    """Those of ``keys`` (posted reports) that their indexes list, in order: one request per
    index (``keys`` of one kind share one)."""
    by_index: dict[str, list[str]] = {}
    for k in keys:
        by_index.setdefault(index_of(k), []).append(k)
    out = set()
    for index, ks in by_index.items():
        names = set(peek(store, index).decode(errors="replace").split(",")) - {""}
        out.update(k for k in ks if k.rpartition("/")[2] in names)
    return [k for k in keys if k in out]


def read_posted(store, seal: Seal, keys: dict, on_forged=None) -> dict:
    """``read`` for posted reports: the sealed values of those of ``keys`` (id -> key) that
    exist, id -> text, in O(1) requests however many keys are absent."""
    found = listed(store, list(keys.values()))
    if found and not store.check(found):  # a listed key that does not exist: probe the list
        found = present(store, found)
    return _fetch(store, seal, keys, found, on_forged)


def present(store, keys: list[str]) -> list[str]:
    """The keys of ``keys`` that exist in ``store``, in order."""
    if not keys:
        return []
    if store.check(keys):
        return list(keys)
    if len(keys) == 1:
        return []
    half = len(keys) // 2
    return present(store, keys[:half]) + present(store, keys[half:])


def read(store, seal: Seal, keys: dict, on_forged=None) -> dict:
    """The sealed values of those of ``keys`` (id -> key) that exist, id -> text; a value that
    fails its seal is left out (``on_forged(id)`` is called for it)."""
    return _fetch(store, seal, keys, present(store, list(keys.values())), on_forged)


def _fetch(store, seal: Seal, keys: dict, found: list[str], on_forged) -> dict:
    """The sealed values of ``found`` (existing keys of ``keys``, id -> key), id -> text."""
    if not found:
        return {}
    by_key = {k: i for i, k in keys.items()}
    out = {}
    for key, value in zip(found, store.multi_get(found)):
        text = seal.open(key, value)
        if text is None:
            if on_forged is not None:
                on_forged(by_key[key])
            continue
        out[by_key[key]] = text
    return out


class Reports:
    """Sealed per-rank reports of one kind: ``key_of(rank)`` for each rank of ``ranks``.

    ``poll`` must be called until ``missing`` is empty (or the caller gives up); it returns the
    reports read so far, rank -> text. ``on_forged(rank)`` is called once per rank whose value
    failed its seal. ``posted``: the writers ``post`` (``send`` does): a poll then costs one
    request while the index is unchanged, three when it lists news, whatever the number of ranks.

    ``budget`` (unposted keys only): a poll makes at most this many probes (and one ``multi_get``
    of what they found), however many keys are missing, instead of an exact ``present`` (2N-1 round trips while none of N exists: at
    16,384 join announcements, 32,767 requests per poll of the start-up wait, which starved the
    writers it waited on). It scans the missing keys in order from where the last poll stopped,
    galloping over runs of present keys (a run of p costs O(log p) requests, an absent key one),
    so every missing key is probed at least once every ``ceil(missing / budget)`` polls and a
    complete set is seen within O(log N) requests. A poll may then return only some of the keys
    that exist: callers that name the missing at a deadline must poll until the scan has passed
    over them (``settle``).
    """

    def __init__(self, store, seal: Seal, key_of: Callable[[int], str], ranks: Iterable[int],
                 on_forged: Callable[[int], None] | None = None, posted: bool = False,
                 budget: int | None = None):
        self.store, self.seal, self.key_of = store, seal, key_of
        self._missing: set[int] = set(ranks)
        self._missing_list: list[int] | None = None  # sorted, made again only after a change
        self.got: dict[int, str] = {}
        self.on_forged = on_forged
        self.forged: set[int] = set()
        self.posted = posted
        self._keys: dict[int, str] = {}  # id -> key, made once (an id is a rank, or a node)
        self._by_name: dict[str, int] = {}  # a key's last part (what its index lists) -> id
        self._index_read = 0  # how much of the index earlier polls read (posted reports)
        self._keyed = False  # posted: every id's key made (at the first read)
        self.budget = budget
        self._cursor = 0  # budgeted scans: the id the next poll starts at

    @property
    def missing(self) -> list[int]:
        """The ids still owed a report, in order (kept as a set: a poll or a report taken costs
        what changed, not the number of ids, which a 2 ms wait loop at 16,384 ranks felt)."""
        if self._missing_list is None:
            self._missing_list = sorted(self._missing)
        return self._missing_list

    def forget(self, ranks: Iterable[int]) -> None:
        """Stop waiting for these ranks (declared failed)."""
        self._discard(ranks)

    def _discard(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i in self._missing:
                self._missing.discard(i)
                self._missing_list = None

    def poll(self) -> dict[int, str]:
        self.poll_new()
        return self.got

    def poll_new(self) -> dict[int, str]:
        """``poll``, answering only the reports this poll took (a caller that acts on each
        report once need not walk every report taken so far at every turn of its wait)."""
        if not self._missing:
            return {}
        new = self._read(self._missing if self.posted else self.missing)
        self._take(new)
        return new

    def _take(self, new: dict[int, str]) -> None:
        if new:
            self.got.update(new)
            self._discard(new)

    def _read(self, ids: list[int]) -> dict[int, str]:
        """The sealed values of the keys of ``ids`` that exist (posted: that the index listed
        since the last poll), id -> text."""
        if not self.posted or not self._keyed:  # (posted: the ids only shrink, keyed once)
            self._keyed = self.posted
            for i in ids:
                if i not in self._keys:
                    self._keys[i] = key = self.key_of(i)
                    self._by_name[key.rpartition("/")[2]] = i
        if not self.posted:
            keys = {i: self._keys[i] for i in ids}
            if self.budget is not None:
                return _fetch(self.store, self.seal, keys, self._scan(ids), self._forged)
            return read(self.store, self.seal, keys, on_forged=self._forged)
        value = peek(self.store, index_of(self._keys[next(iter(ids))]))
        if len(value) < self._index_read:  # deleted and begun again
            self._index_read = 0
        news = value[self._index_read:].decode(errors="replace").split(",")
        self._index_read = len(value)
        listed_ids = {self._by_name[n] for n in news if self._by_name.get(n) in ids}
        keys = {i: self._keys[i] for i in sorted(listed_ids)}
        found = list(keys.values())
        if found and not self.store.check(found):  # a listed key that does not exist
            found = present(self.store, found)
        return _fetch(self.store, self.seal, keys, found, self._forged)

    def _scan(self, ids: list[int]) -> list[str]:
        """Existing keys among ``ids`` (sorted) found in at most ``budget`` requests, scanning
        on from ``_cursor`` and wrapping around (``budget`` docstring)."""
        keys = [self._keys[i] for i in ids]
        found: list[str] = []
        i = bisect.bisect_left(ids, self._cursor) % len(ids)
        m, used, scanned = 1, 0, 0
        while used < max(1, self.budget) and scanned < len(ids):
            j = min(i + m, len(ids))
            used += 1
            if self.store.check(keys[i:j]):
                found += keys[i:j]
                scanned, i, m = scanned + j - i, j, m * 2
            elif m == 1:
                scanned, i = scanned + 1, i + 1  # absent
            else:
                m //= 2  # a run ends within this chunk: narrow down
            if i >= len(ids):
                i, m = 0, 1
        self._cursor = ids[i] if i < len(ids) else 0
        got = set(found)
        return [k for k in keys if k in got]

    def settle(self) -> dict[int, str]:
        """One exact read of every missing key (2N-1 requests at worst): what a budgeted caller
        does once before naming the missing (a deadline)."""
        if self.missing:
            keys = {i: self.key_of(i) for i in self.missing}
            self._take(read(self.store, self.seal, keys, on_forged=self._forged))
        return self.got

    def _forged(self, r: int) -> None:
        if r not in self.forged and self.on_forged is not None:
            self.on_forged(r)
        self.forged.add(r)

    @property
    def complete(self) -> bool:
        return not self.missing


class NodeReports(Reports):
    """``Reports`` gathered per node: ``key_of(node)`` holds the sealed JSON object, rank -> text,
    of that node's ranks' reports so far (``agent.node.NodeAgent.check_reports``, posted each
    time it is rewritten). Each poll reads the keys of the nodes that still owe a report and
    posted since the last; a report is taken only for a rank of that node (``node_of(rank)``),
    so one node's record cannot speak for another's ranks. ``on_forged`` is called with the
    node."""

    def __init__(self, store, seal: Seal, key_of: Callable[[int], str], ranks: Iterable[int],
                 node_of: Callable[[int], int], on_forged: Callable[[int], None] | None = None):
        super().__init__(store, seal, key_of, ranks, on_forged, posted=True)
        self.node_of = node_of
        self._node = {r: node_of(r) for r in self._missing}  # asked once per rank
        self._owing: dict[int, int] = {}  # node -> how many of its ranks still owe a report
        for n in self._node.values():
            self._owing[n] = self._owing.get(n, 0) + 1

    def _discard(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i in self._missing:
                n = self._node[i]
                self._owing[n] -= 1
                if not self._owing[n]:
                    del self._owing[n]
        super()._discard(ids)

    def poll_new(self) -> dict[int, str]:
        if not self._missing:
            return {}
        new = {}
        for node, text in self._read(self._owing).items():  # (a dict: O(1) membership)
            try:
                got = {int(r): t for r, t in json.loads(text).items()}
            except (ValueError, AttributeError):
                continue
            new.update((r, t) for r, t in got.items()
                       if r in self._missing and self._node[r] == node)
        self._take(new)
        return new
