"""Buddy placement: which slot holds a slot's copy (a replica, or a redundant computation).

Small policies, one per class, shared by every strategy that keeps a copy on another node
(DeadPool and in-memory checkpoint/restart keep a ring; replication keeps pairs). Slot ``i``
starts on physical node ``i``, so with ``nodes_per_rack`` nodes behind a rack switch, slot
``i`` starts in rack ``i // nodes_per_rack``: placing copies a rack away keeps a rack failure
from taking a node and its copy together. Select with ``buddy_placement`` (calibration).
"""

from __future__ import annotations


class Ring:
    """Slot i's replica lives on slot i+1 (the runtime's ``ring_over_nodes``).

        rack:    |  0   |  1   |  2   |      (2 nodes per rack)
        slot:    | 0  1 | 2  3 | 4  5 |
        buddy:   | 1  2 | 3  4 | 5  0 |      rack 1 fails: slot 2's replica (on 3) is gone too
    """

    def __init__(self, num_slots: int, nodes_per_rack: int = 1, replicas: int = 1):
        self.n = num_slots
        self.step = 1
        self.k = replicas  # copies per slot: on its buddy and the k-1 slots after (ft.replicas)

    def buddy(self, slot: int) -> int:
        return (slot + self.step) % self.n

    def buddies(self, slot: int) -> set[int]:
        """The ``k`` slots holding this slot's copies (the buddy, its buddy, ...)."""
        return {(slot + j * self.step) % self.n for j in range(1, self.k + 1)} - {slot}

    def lost(self, slot: int, pending: set[int]) -> bool:
        """``slot`` fails while ``pending`` slots' states live only in their copies: is some
        dead slot's state now gone with all of its copies? (k=1: a ring neighbour of ``slot``
        is pending.)"""
        dead = set(pending) | {slot}
        return any(self.buddies(p) <= dead for p in dead)

    def ward(self, slot: int) -> int:
        return (slot - self.step) % self.n

    def neighbours(self, slot: int) -> set[int]:
        """The buddy (holds this slot's copy) and the ward (whose copy this slot holds)."""
        return {self.buddy(slot), self.ward(slot)} - {slot}


class RingCrossRack(Ring):
    """Slot i's replica lives one rack over, on slot i + nodes_per_rack.

        rack:    |  0   |  1   |  2   |
        slot:    | 0  1 | 2  3 | 4  5 |
        buddy:   | 2  3 | 4  5 | 0  1 |      rack 1 fails: every replica of slots 2, 3 survives
    """

    def __init__(self, num_slots: int, nodes_per_rack: int = 1, replicas: int = 1):
        super().__init__(num_slots, replicas=replicas)
        self.step = max(1, nodes_per_rack) if num_slots > nodes_per_rack else 1


class Pairs:
    """Slots in pairs that compute each other's work (Bamboo-style), neighbours in one rack.

        slot:    | 0  1 | 2  3 |
        pair:    | 1  0 | 3  2 |
    """

    def __init__(self, num_slots: int, nodes_per_rack: int = 1):
        self.n = num_slots
        self.d = 1

    def buddy(self, slot: int) -> int:
        block, pos = divmod(slot, 2 * self.d)
        b = block * 2 * self.d + (pos + self.d) % (2 * self.d)
        return b if b < self.n else (slot - self.d if slot >= self.d else slot)

    def neighbours(self, slot: int) -> set[int]:
        return {self.buddy(slot)} - {slot}


class PairsCrossRack(Pairs):
    """Pairs one rack apart.

        rack:    |  0   |  1   |
        slot:    | 0  1 | 2  3 |
        pair:    | 2  3 | 0  1 |
    """

    def __init__(self, num_slots: int, nodes_per_rack: int = 1):
        super().__init__(num_slots)
        self.d = max(1, nodes_per_rack) if num_slots >= 2 * nodes_per_rack else 1


RINGS = {"adjacent": Ring, "cross_rack": RingCrossRack}
PAIRS = {"adjacent": Pairs, "cross_rack": PairsCrossRack}


def ring(name: str, num_slots: int, nodes_per_rack: int, replicas: int = 1) -> Ring:
    if name not in RINGS:
        raise ValueError(f"buddy_placement must be one of {', '.join(RINGS)}, got {name!r}")
    if not 1 <= replicas < max(2, num_slots):
        raise ValueError(f"replicas must be in [1, {num_slots - 1}] for {num_slots} slots, got {replicas}")
    return RINGS[name](num_slots, nodes_per_rack, replicas)


def pairs(name: str, num_slots: int, nodes_per_rack: int) -> Pairs:
    if name not in PAIRS:
        raise ValueError(f"buddy_placement must be one of {', '.join(PAIRS)}, got {name!r}")
    return PAIRS[name](num_slots, nodes_per_rack)
