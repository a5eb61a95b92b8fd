"""Reading many per-rank reports from the store in few round trips.

The coordinator waits on one key per rank at several points (statuses after an abort, the new
generation's timings, final states). Checking each key in turn costs N round trips per poll, and
``TCPStore.multi_get`` blocks on a key that does not exist yet. So:

    present(store, keys)   which of ``keys`` exist: one ``check`` when none or all do, else a
                           halving search, O(k log(N/k)) round trips for k present keys
    read(store, seal, keys)  the sealed values of those that exist: ``present`` + one ``multi_get``
    Reports                one kind of sealed per-rank report (``keys.status(r)`` ...) collected
                           incrementally: each poll asks only about the ranks still missing, reads
                           the new ones with one ``multi_get`` and keeps only what the job sealed
    NodeReports            the same, from one sealed key per node that its agent rewrites as its
                           ranks report (a JSON object, rank -> report)
    send(...)              a rank's side: its report through its node agent, else its sealed key

A value that fails its seal (written by a process without the job's secret) is not accepted and
its rank stays missing: the real report, which overwrites it, is still taken when it comes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from deadpool.protocol import Seal


def send(store, seal: Seal, link, keys, kind: str, rank: int, text: str) -> None:
    """Rank ``rank``'s report of ``kind`` (status, timing, first_step, protected) for the
    coordinator: through its node agent when it has one (``link``: ``agent.client.NodeLink``,
    one key per node), else the sealed key ``getattr(keys, kind)(rank)``."""
    if link is not None:
        link.report(keys.g, kind, rank, text)
    else:
        key = getattr(keys, kind)(rank)
        store.set(key, seal.wrap(key, text))


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
    found = present(store, list(keys.values()))
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
    failed its seal.
    """

    def __init__(self, store, seal: Seal, key_of: Callable[[int], str], ranks: Iterable[int],
                 on_forged: Callable[[int], None] | None = None):
        self.store, self.seal, self.key_of = store, seal, key_of
        self.missing: list[int] = sorted(set(ranks))
        self.got: dict[int, str] = {}
        self.on_forged = on_forged
        self.forged: set[int] = set()

    def forget(self, ranks: Iterable[int]) -> None:
        """Stop waiting for these ranks (declared failed)."""
        gone = set(ranks)
        self.missing = [r for r in self.missing if r not in gone]

    def poll(self) -> dict[int, str]:
        if not self.missing:
            return self.got
        new = read(self.store, self.seal, {r: self.key_of(r) for r in self.missing},
                   on_forged=self._forged)
        if new:
            self.got.update(new)
            self.missing = [r for r in self.missing if r not in new]
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
    of that node's ranks' reports so far (``agent.node.NodeAgent.check_reports``). Each poll
    reads the keys of the nodes that still owe a report; a report is taken only for a rank of
    that node (``node_of(rank)``), so one node's record cannot speak for another's ranks.
    ``on_forged`` is called with the node."""

    def __init__(self, store, seal: Seal, key_of: Callable[[int], str], ranks: Iterable[int],
                 node_of: Callable[[int], int], on_forged: Callable[[int], None] | None = None):
        super().__init__(store, seal, key_of, ranks, on_forged)
        self.node_of = node_of

    def poll(self) -> dict[int, str]:
        if not self.missing:
            return self.got
        want = set(self.missing)
        nodes = sorted({self.node_of(r) for r in want})
        new = {}
        for node, text in read(self.store, self.seal, {n: self.key_of(n) for n in nodes},
                               on_forged=self._forged).items():
            try:
                got = {int(r): t for r, t in json.loads(text).items()}
            except (ValueError, AttributeError):
                continue
            new.update((r, t) for r, t in got.items() if r in want and self.node_of(r) == node)
        if new:
            self.got.update(new)
            self.missing = [r for r in self.missing if r not in new]
        return self.got
