"""The chunked cross-entropy (parallel/tensor/ops.py) against torch's and the unchunked kernel,
at tp 1 and tp 2 (threads), its determinism, and the memory it saves."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deadpool.parallel.tensor import ops
from deadpool.parallel.tensor.ops import vocab_parallel_cross_entropy
from tests.deadpool.helpers import master_store, run_threads
from tests.deadpool.parallel.test_tensor import tp_comm

# the chunked kernel computes softmax as exp(x - lse) (torch: exp(x - max) / sum): fp32 rounding
TOL = dict(rtol=1e-5, atol=1e-6)


def data(n=37, v=64, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * 4).to(dtype)
    return logits, torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)


def loss_and_grad(logits, targets, w, **kw):
    x = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, targets, 0, None, **kw)
    (loss * w).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_torch_and_is_deterministic(dtype):
    logits, targets, w = data(dtype=dtype)
    ref_x = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_x.float(), targets, reduction="none")
    (ref * w).sum().backward()
    loss, grad = loss_and_grad(logits, targets, w, chunk_rows=5)  # 8 chunks, the last of 2
    assert grad.dtype == dtype
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    gtol = TOL if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)  # one bf16 rounding
    torch.testing.assert_close(grad, ref_x.grad, **gtol)
    again = loss_and_grad(logits, targets, w, chunk_rows=5)
    assert torch.equal(loss, again[0]) and torch.equal(grad, again[1])
    # one chunk: the unchunked kernel, bitwise as before
    whole = loss_and_grad(logits, targets, w)
    assert torch.equal(whole[0], F.cross_entropy(logits.float(), targets, reduction="none"))


def test_chunked_vocab_parallel_cross_entropy_over_tp2_equals_dense():
    logits, targets, w = data(n=23, v=32, seed=3)
    ref_x = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_x, targets, reduction="none")
    (ref * w).sum().backward()
    master = master_store()

    def rank_fn(r):
        comm = tp_comm(master, r)
        x = logits.chunk(2, dim=1)[r].clone().requires_grad_()
        losses = []
        for rows in (4, None):  # chunked (6 chunks), then unchunked: both all-reduce per chunk
            x.grad = None
            loss = vocab_parallel_cross_entropy(x, targets, r * 16, comm, chunk_rows=rows)
            (loss * w).sum().backward()
            losses.append((loss.detach(), x.grad.clone()))
        return losses

    for r, ((loss, grad), (loss1, grad1)) in enumerate(run_threads(rank_fn, 2)):
        torch.testing.assert_close(loss, ref.detach(), **TOL)
        torch.testing.assert_close(grad, ref_x.grad.chunk(2, dim=1)[r], **TOL)
        torch.testing.assert_close(loss, loss1, **TOL)


class PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode and still alive (a tracemalloc for
    torch's CPU tensors): a storage counts from the op that allocates it until the last tensor
    the mode saw on it is collected (views and in-place results share their input's storage)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors seen on it]

    def _drop(self, ptr):
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr == 0 or (ptr in inputs and ptr not in self.storages):
                continue  # an input's storage (made outside the mode) or empty
            if ptr not in self.storages:
                self.storages[ptr] = [t.untyped_storage().nbytes(), 0]
                self.live += self.storages[ptr][0]
            self.storages[ptr][1] += 1
            weakref.finalize(t, self._drop, ptr)
        self.peak = max(self.peak, self.live)
        return out


def peak_bytes(fn) -> int:
    with PeakBytes() as m:
        fn()
    return m.peak


def test_chunked_cross_entropy_holds_a_fraction_of_the_fp32_logits():
    """gpt_small-ish logits (2,048 tokens of a 32,000 vocabulary, bf16: 131 MB): peak bytes
    created by the loss's forward and backward, over and above the logits themselves."""
    n, v = 2048, 32000
    logits = torch.randn(n, v).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,))
    fp32_logits = n * v * 4

    def run(rows):
        def go():
            x = logits.detach().requires_grad_()
            vocab_parallel_cross_entropy(x, targets, 0, None, chunk_rows=rows).mean().backward()
        return peak_bytes(go)

    whole, chunked = run(n), run(256)  # today's kernel (one chunk) vs 8 chunks of 32 MB fp32
    print(f"peak bytes over the bf16 logits: unchunked {whole / 2**20:.0f} MiB, "
          f"chunked {chunked / 2**20:.0f} MiB (fp32 logits {fp32_logits / 2**20:.0f} MiB)")
    # measured: unchunked 750 MiB (3 x the fp32 logits: the fp32 copy, the saved log-softmax, its
    # gradient), chunked 219 MiB (the bf16 gradient, half the fp32 logits, and fp32 temporaries
    # of one chunk at a time, 31 MiB each)
    assert whole >= 2.5 * fp32_logits
    assert chunked <= fp32_logits / 2 + 4 * 256 * v * 4
    assert ops.ce_chunk_rows(v) * v * 4 <= ops.CE_CHUNK_BYTES
