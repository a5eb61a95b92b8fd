"""The order samples are drawn in: a seeded, stateless permutation of ``[0, n)`` per epoch.

``permute(positions, n, seed, epoch)`` maps positions to sample indices with a 4-round Feistel
network on ``2 * half`` bits (the smallest even width covering ``n``), cycle-walking values that
land at or past ``n`` back into range. Each round's function mixes the half-word with a round key
derived from (seed, epoch, round). A Feistel network is a bijection whatever its round function,
and cycle-walking a bijection restricted to ``[0, n)`` stays one, so every epoch visits every
sample exactly once; and each position is computed on its own, in O(1), with no table: a
batch is a pure function of (seed, epoch, position), and nothing needs to be saved or restored
to resume. Each walk step lands in range with probability ``n / 4**half`` > 1/4.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser on a Python int (for round keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def round_keys(seed: int, epoch: int) -> list[int]:
    base = _mix64((seed & _M64) ^ _mix64(epoch & _M64))
    return [_mix64(base + r) for r in range(_ROUNDS)]


def _round(r: np.ndarray, key: int, mask: np.uint64) -> np.ndarray:
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, which is the intent
        x = (r ^ np.uint64(key)) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(32)
    return x & mask


def _feistel(x: np.ndarray, half: int, keys: list[int]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & mask
    for k in keys:
        left, right = right, left ^ _round(right, k, mask)
    return (left << np.uint64(half)) | right


def permute(positions, n: int, seed: int, epoch: int) -> np.ndarray:
    """Sample indices (int64) of ``positions`` (each in ``[0, n)``) in epoch ``epoch``'s order."""
    if n < 1:
        raise ValueError(f"cannot permute an empty range (n={n})")
    pos = np.asarray(positions, dtype=np.uint64)
    if pos.size and int(pos.max()) >= n:
        raise ValueError(f"positions must be in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = round_keys(seed, epoch)
    out = _feistel(pos, half, keys)
    bad = out >= np.uint64(n)
    while bad.any():  # cycle-walk: apply the permutation again until the value is in range
        out[bad] = _feistel(out[bad], half, keys)
        bad = out >= np.uint64(n)
    return out.astype(np.int64)
