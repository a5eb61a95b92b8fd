"""``data=tokens data.path=DIR``: memory-mapped token shards in a seeded, stateless order.

A *sample* is ``seq_len + 1`` consecutive tokens of one shard, starting at a multiple of
``seq_len`` (inputs and next-token targets; consecutive samples share one token). Samples do
not cross shards and ignore document boundaries (the ``eos_id`` separator is trained on, as
GPT-2 and nanoGPT do).

Order. Step ``s``'s global batch is ``global_batches`` batches of ``batch_size`` samples; sample
``j`` of batch ``i`` has global position ``g = (s * global_batches + i) * batch_size + j``, which
is epoch ``g // n`` and position ``g % n`` of that epoch, drawn through the epoch's permutation
(``order.permute``). So a batch is a pure function of (seed, step, i), the same whichever rank
computes it (an elastic job at a narrower width computes the same global batch), every sample
is seen once per epoch, and nothing but the step number is needed to resume.

Validation batch ``k`` is samples ``k * batch_size ...`` of the ``val`` split in order
(wrapping), the same for every step and run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from deadpool.data import manifest as mf
from deadpool.data.order import permute


class Split:
    """The samples of one split: its shards memory-mapped, samples numbered shard by shard."""

    def __init__(self, directory: Path, split: dict, dtype: str, seq_len: int):
        self.seq_len = seq_len
        self.shards = [np.memmap(directory / s["file"], dtype=np.dtype(dtype).newbyteorder("<"),
                                 mode="r", shape=(s["tokens"],)) if s["tokens"] else None
                       for s in split["shards"]]
        counts = [max(0, (s["tokens"] - 1) // seq_len) for s in split["shards"]]
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_samples = int(self.first[-1])

    def samples(self, idx: np.ndarray) -> torch.Tensor:
        """``(len(idx), seq_len + 1)`` int64 tokens of the samples ``idx``."""
        shard = np.searchsorted(self.first, idx, side="right") - 1
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        for row, (k, i) in enumerate(zip(shard, idx)):
            start = int(i - self.first[k]) * self.seq_len
            out[row] = self.shards[k][start:start + self.seq_len + 1]
        return torch.from_numpy(out)


class TokenDataset:
    """Training batches from the ``train`` split, validation batches from ``val`` (see module)."""

    def __init__(self, path, *, seed: int, seq_len: int, batch_size: int, global_batches: int):
        self.path = Path(path)
        self.manifest = mf.read(self.path)
        mf.check_sizes(self.path, self.manifest)  # (the launch verifies the checksums: verify.py)
        dtype = self.manifest["dtype"]
        self._setup(Split(self.path, self.manifest["splits"]["train"], dtype, seq_len),
                    Split(self.path, self.manifest["splits"]["val"], dtype, seq_len),
                    seed, seq_len, batch_size, global_batches)

    def _setup(self, train: Split, val: Split | None, seed: int, seq_len: int, batch_size: int,
               global_batches: int) -> None:
        """The order's parameters and the splits (a source of another layout opens its own)."""
        self.train, self.val = train, val
        self.seed, self.seq_len = seed, seq_len
        self.batch_size, self.global_batches = batch_size, global_batches
        if self.train.num_samples < 1:
            raise ValueError(f"data.path={self.path}: the train split has no sample of seq_len={seq_len} "
                             "+ 1 tokens")

    def positions(self, step: int, index: int) -> np.ndarray:
        """Global sample positions of batch ``index`` of ``step`` (before the permutation)."""
        first = (step * self.global_batches + index) * self.batch_size
        return np.arange(first, first + self.batch_size, dtype=np.int64)

    def sample_ids(self, step: int, index: int) -> np.ndarray:
        """The train-split sample indices batch ``index`` of ``step`` is made of."""
        g, n = self.positions(step, index), self.train.num_samples
        out = np.empty_like(g)
        for epoch in np.unique(g // n):
            here = g // n == epoch
            out[here] = permute(g[here] % n, n, self.seed, int(epoch))
        return out

    def batch(self, step: int, index: int, batch_size: int, seq_len: int):
        if (batch_size, seq_len) != (self.batch_size, self.seq_len):
            raise ValueError(f"built for batch_size={self.batch_size}, seq_len={self.seq_len}")
        chunk = self.train.samples(self.sample_ids(step, index))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def eval_batch(self, k: int, batch_size: int, seq_len: int):
        if seq_len != self.seq_len:
            raise ValueError(f"built for seq_len={self.seq_len}")
        if self.val is None or self.val.num_samples < 1:
            raise ValueError(f"data.path={self.path}: the val split has no sample of "
                             f"seq_len={seq_len} + 1 tokens")
        idx = np.arange(k * batch_size, (k + 1) * batch_size, dtype=np.int64) % self.val.num_samples
        chunk = self.val.samples(idx)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def check(path, *, vocab_size: int, seq_len: int, need_val: bool, log=None) -> dict:
    """Everything the job needs of ``data.path`` that costs no reading of the shards, checked
    before any process starts (raises ``ValueError`` naming the field): the manifest, every
    file's size, a tokenizer that fits ``model.vocab_size``, at least one sample per split used.
    Returns the manifest. The checksums are verified while the job runs (``verify.py``)."""
    if path in (None, "", "???"):
        raise ValueError("data=tokens needs data.path=DIR (a directory written by "
                         "python -m deadpool.data.prepare)")
    m = mf.read(path)
    if int(m["vocab_size"]) > vocab_size:
        raise ValueError(f"data.path={path}: its tokenizer has {m['vocab_size']} tokens, more than "
                         f"model.vocab_size={vocab_size}; set model.vocab_size >= {m['vocab_size']} "
                         "(divisible by parallel.tp)")
    mf.check_sizes(path, m)
    for split in ("train", "val") if need_val else ("train",):
        s = Split(Path(path), m["splits"][split], m["dtype"], seq_len)
        if s.num_samples < 1:
            raise ValueError(f"data.path={path}: the {split} split ({m['splits'][split]['tokens']} "
                             f"tokens) has no sequence of seq_len={seq_len} + 1 tokens")
    return m
