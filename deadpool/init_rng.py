"""Counter-based initial values: element ``i`` of parameter ``name`` is a pure function of
``(seed, name, i)``, computed on the parameter's own device, for any subset of ``i``.

Why not a torch generator: a stream generator (the CPU's Mersenne twister) cannot be skipped
into, so a rank holding a tensor-parallel slice would have to draw the full tensor and keep its
slice, on the host; CUDA's Philox can start at an offset, but which element gets which counter
depends on the kernel's launch grid, and its bits are not the CPU's. Here the counter is the
element's flat (row-major) index in the full parameter, so a rank draws exactly the elements it
holds, on its device, in chunks (bounded memory), and gets the bits of the single-process model.

Elements ``2p`` and ``2p + 1`` are one Box-Muller pair (``normal_pairs``):

    h = splitmix64(p * GOLDEN + key(seed, name))        64 random bits (wrapping int64 ops)
    u = (2 h[41:64] + 1) / 2^24,  v = (2 h[18:41] + 1) / 2^24      in (0, 1), 23 bits each
    r = std sqrt(-2 ln u),  x = pi/2 v
    element 2p = +-r cos x (sign: bit 16),  element 2p + 1 = +-r sin x (sign: bit 15)

(a quarter turn and two sign bits make an angle uniform over the full turn: Box-Muller's pair of
independent normals).

``ln``, ``cos`` and ``sin`` are polynomials (an atanh series on a mantissa in
[1/sqrt 2, sqrt 2); Taylor series on [0, pi/2]; truncation errors below 1e-8, within 3e-7 of the
true values once evaluated in float32) built from float32 add, mul, div and sqrt alone, one torch
op each. Those are correctly rounded in IEEE arithmetic on the CPU, vectorised body or scalar
tail alike, and on CUDA (no fast-math, no fused multiply-add across separate kernels). So the
bits depend on neither the chunking, the thread count nor the slice (tested), nor, by the same
argument, on the device: ``test_init_rng.py``'s ``gpu`` test and ``check_startup.py``'s probe
check that, not yet run on a GPU. Torch's own ``log``/``cos`` would not promise it (SLEEF in the
CPU's vector loop, libm in its tail, libdevice on CUDA). ``|z| <= sqrt(48 ln 2) = 5.77``.

Cost: about 70 elementwise ops per pair, each a pass over the chunk. On a CPU that is about 3x
the Mersenne twister's ``normal_`` per element (experiments/results/runtime/startup); a rank at
tp >= 3 still draws less than before, and on a GPU the passes are cheap. A fused kernel (Triton,
C++) computing this same function, tested bitwise against it, would remove the CPU cost; none is
written yet.

Nothing here imports the rest of the package: ``model.py`` (the full parameter) and
``parallel/stage.py`` (a tensor-parallel slice, ``shard_segments``) both draw through
``fill_normal_``.
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

_MASK64 = (1 << 64) - 1


def _int64(x: int) -> int:
    """``x`` modulo 2^64 as a signed int64 (the bits torch's wrapping int64 ops carry)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


GOLDEN = _int64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio, odd)
_M1, _M2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)  # splitmix64's multipliers
# Taylor coefficients of cos(x) = sum_n (-1)^n x^(2n) / (2n)!, n = 1..6, and of sin(x) / x
_COS = [(-1) ** n / math.factorial(2 * n) for n in range(1, 7)]
_SIN = [(-1) ** n / math.factorial(2 * n + 1) for n in range(1, 7)]  # sin(x) / x, n = 1..6
# atanh series: ln m = 2 s (1 + s^2/3 + s^4/5 + s^6/7 + s^8/9), s = (m-1)/(m+1), |s| <= 0.172
_LN = [1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0]
_CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}  # elements per chunk: ~10 scratch tensors of it per thread


def splitmix64(x: int) -> int:
    """splitmix64's output function on a Python int (the reference for ``_mix_``)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def param_key(seed: int, name: str) -> int:
    """The 64-bit key of parameter ``name``'s draw: its name's CRC-32 under the seed's 32 bits."""
    return _int64(splitmix64(((seed & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode())))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function, in place on int64 ``z`` (multiplications wrap mod 2^64)."""
    z.bitwise_xor_(_shr(z, 30)).mul_(_M1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_M2)
    return z.bitwise_xor_(_shr(z, 31))


def _uniform(h: torch.Tensor, shift: int) -> torch.Tensor:
    """``(2 b + 1) / 2^24`` for the 23 bits ``b = h[shift + 1 : shift + 24]``: in (0, 1), exact
    in float32 (setting bit ``shift`` makes the odd number ``2 b + 1``)."""
    return (h >> shift).bitwise_and_(0xFFFFFF).bitwise_or_(1).to(torch.float32).mul_(2.0 ** -24)


def _ln_(u: torch.Tensor) -> torch.Tensor:
    """Natural log of float32 ``u`` in (0, 1) (consumed) from add, mul and div only: ``u = 2^e m``
    exactly, ``m`` in [1/sqrt 2, sqrt 2) (the mantissa, halved when above sqrt 2), then the atanh
    series of ``ln m``. Negative for every ``u < 1`` (``m - 1`` is exact)."""
    bits = u.view(torch.int32)
    e = (bits >> 23).sub_(127)
    m = bits.bitwise_and_(0x7FFFFF).bitwise_or_(0x3F800000).view(torch.float32)  # [1, 2)
    big = m > math.sqrt(2)
    e = e.add_(big).to(torch.float32)
    m.mul_(big.to(torch.float32).mul_(-0.5).add_(1))  # halved (exactly) when big
    s = (m - 1).div_(m.add_(1))
    s2 = s * s
    p = s2 * _LN[0]
    for c in _LN[1:-1]:
        p.add_(c).mul_(s2)
    return p.add_(1).mul_(s).mul_(2).add_(e.mul_(math.log(2)))


def _cos_sin_(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of float32 ``x`` in [0, pi/2] (consumed) from add/mul only (Taylor series to
    x^12 and x^13: errors below 7e-9 and 7e-10)."""
    x2 = x * x
    c = x2 * _COS[-1]
    for k in reversed(_COS[:-1]):
        c.add_(k).mul_(x2)
    s = x2 * _SIN[-1]
    for k in reversed(_SIN[:-1]):
        s.add_(k).mul_(x2)
    return c.add_(1), s.add_(1).mul_(x)


def normal_pairs(pair: torch.Tensor, key: int, std: float, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """float32 draws of N(0, std^2) of elements ``2 p`` and ``2 p + 1`` for each ``p`` of int64
    ``pair`` (consumed), under ``key``, element by element into ``out`` (``2 len(pair)``
    elements, contiguous, any float dtype) or a new tensor."""
    h = _mix_(pair.mul_(GOLDEN).add_(key))
    r = _ln_(_uniform(h, 40)).mul_(-2).sqrt_().mul_(std)
    c, s = _cos_sin_(_uniform(h, 17).mul_(math.pi / 2))
    # bits 16 and 15: the signs, so that the angle is uniform over the full turn
    sign = (h >> 16).bitwise_and_(1).mul_(-2).add_(1).to(torch.float32)
    c.mul_(sign)
    sign = (h >> 15).bitwise_and_(1).mul_(-2).add_(1).to(torch.float32)
    s.mul_(sign)
    out = torch.empty(2 * len(pair), device=pair.device) if out is None else out
    pairs = out.view(-1, 2)
    torch.mul(c, r, out=pairs[:, 0])
    torch.mul(s, r, out=pairs[:, 1])
    return out


def normal_at(index: torch.Tensor, key: int, std: float) -> torch.Tensor:
    """The draws at the int64 flat indices ``index`` (any order; each computes its pair)."""
    return normal_pairs(index >> 1, key, std).view(-1, 2)[torch.arange(index.numel(),
                                                                        device=index.device),
                                                           index & 1]


def _pieces(starts: list[int], width: int, chunk: int):
    """``(first_local_element, first_run, runs, offset, count)``: pieces of at most ``chunk``
    elements covering the runs ``[s, s + width)`` of ``starts`` in order: ``runs`` whole runs
    side by side when they are shorter than a chunk and fall on whole pairs (even starts and
    width), else ``count`` elements of one run from ``offset``."""
    if width < chunk and width % 2 == 0 and all(s % 2 == 0 for s in starts):
        k = chunk // width
        for r in range(0, len(starts), k):
            n = min(k, len(starts) - r)
            yield r * width, r, n, 0, n * width
        return
    for r in range(len(starts)):
        for off in range(0, width, chunk):
            yield r * width + off, r, 1, off, min(chunk, width - off)


def init_threads(device) -> int:
    """Threads drawing chunks on the CPU: the cores this process may run on, at most 8 (a
    worker runs its training with one intra-op thread; its build may use them all). The count
    changes no bit. On CUDA one (the kernels queue on one stream)."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(8, len(os.sched_getaffinity(0))))


def fill_normal_(out: torch.Tensor, key: int, std: float, starts, width: int,
                 chunk: int | None = None, threads: int | None = None) -> torch.Tensor:
    """Fill contiguous ``out`` (any float dtype, any device) with the draws of ``key`` at the full
    parameter's flat indices ``[s, s + width)`` for each ``s`` in ``starts``, concatenated in
    order (``out.numel() == len(starts) * width``). Computed in float32 on ``out``'s device,
    ``chunk`` elements at a time, ``threads`` chunks at once on the CPU."""
    starts = [int(s) for s in starts]
    if out.numel() != len(starts) * width or not out.is_contiguous():
        raise ValueError(f"out ({out.numel()} elements) is not {len(starts)} runs of {width}")
    dev = out.device
    chunk = chunk or _CHUNK.get(dev.type, _CHUNK["cuda"])

    first = torch.tensor(starts, dtype=torch.int64, device=dev) >> 1  # first pair of each run
    across = torch.arange(min(width, chunk) // 2, device=dev)

    def one(piece):
        local, r, runs, off, count = piece
        a = starts[r] + off
        if runs > 1:  # whole runs of whole pairs side by side
            pairs = (first[r:r + runs, None] + across).view(-1)
        else:  # the pairs holding one run's [off, off + count)
            pairs = torch.arange(a >> 1, (a + count + 1) >> 1, device=dev)
        with torch.no_grad():  # per thread; the views of out too
            dst = out.view(-1)[local:local + count]
            if runs > 1 or (a % 2 == 0 and count % 2 == 0):
                normal_pairs(pairs, key, std, out=dst)
            else:  # an odd end: drop the other half of its pair
                dst.copy_(normal_pairs(pairs, key, std)[a & 1:(a & 1) + count])

    pieces = _pieces(starts, width, chunk)
    n = threads or init_threads(dev)
    if n == 1:
        for piece in pieces:
            one(piece)
    else:
        with ThreadPoolExecutor(n, thread_name_prefix="init") as pool:
            list(pool.map(one, pieces))
    return out
