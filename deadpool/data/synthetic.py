"""A generated corpus (``data=synthetic``, the default): no files, nothing to prepare.

A batch is a pure function of (seed, step, batch index), like every data source's (see
``deadpool.data``). The corpus is a fixed random bigram process over the vocabulary, so the
model has structure to learn and the loss falls.
"""

from __future__ import annotations

import torch


class SyntheticCorpus:
    """Token stream from a seeded sparse bigram chain (each token has a few likely successors)."""

    def __init__(self, vocab_size: int, seed: int, num_tokens: int = 1 << 18, fanout: int = 4):
        g = torch.Generator().manual_seed(seed ^ 0x5EED)
        successors = torch.randint(0, vocab_size, (vocab_size, fanout), generator=g)
        choice = torch.randint(0, fanout, (num_tokens,), generator=g)
        tok = 0
        # A python loop over 256k tokens is ~0.2 s; vectorising the chain is not worth the clarity.
        succ = successors.tolist()
        ch = choice.tolist()
        out = [0] * num_tokens
        for i in range(num_tokens):
            tok = succ[tok][ch[i]]
            out[i] = tok
        self.tokens = torch.tensor(out, dtype=torch.long)
        self.seed = seed

    def batch(self, step: int, dp_rank: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for ``(step, dp_rank)``; same arguments, same tensors."""
        g = torch.Generator().manual_seed(hash((self.seed, step, dp_rank)) & 0x7FFFFFFFFFFFFFFF)
        starts = torch.randint(0, self.tokens.numel() - seq_len - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        chunk = self.tokens[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def eval_batch(self, k: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``k``: windows of the same chain drawn under another key (the chain
        has no held-out part; this measures the fit, not generalisation)."""
        return self.batch(-1 - k, -1, batch_size, seq_len)
