"""Megatron-style tensor-parallel layers for the decoder of ``deadpool/model.py``.

Each layer holds this rank's slice of the full parameter, under the full model's parameter name
(``shard`` says which slice), so a stage's state maps one-to-one onto the single-process model.

  ColumnParallelLinear   weight (out/tp, in): rows [r*out/tp, (r+1)*out/tp) of the full weight.
                         Input replicated, output split along features. No communication of its
                         own: the caller applies ``copy_to_tp`` once to the input, so several
                         column layers on one input (SwiGLU's gate and up) share one backward
                         all-reduce.
  RowParallelLinear      weight (out, in/tp): columns [r*in/tp, ...). Input split along features,
                         output all-reduced (``reduce_from_tp``) to the full activation.
  VocabParallelEmbedding weight (vocab/tp, d): rows of this rank's vocabulary slice; tokens outside
                         it give zeros, and the all-reduce sums the one rank that has each token.
  ParallelAttention      heads split over tp: the fused qkv projection is column-parallel with
                         each rank holding the q, k and v rows of *its* heads (not a contiguous
                         block of the fused weight, see ``shard``); output projection row-parallel.
  ParallelSwiGLU         gate/up column-parallel, down row-parallel: the elementwise
                         ``silu(gate) * up`` needs no communication.

Every forward takes the generation's ``comm``; nothing here stores it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deadpool.model import ModelConfig, RMSNorm, apply_rotary
from deadpool.parallel.tensor.ops import copy_to_tp, reduce_from_tp


def tp_replicated(name: str) -> bool:
    """Parameter ``name`` is held whole, with identical values and gradients, by every
    tensor-parallel rank (the norms): it must be counted once in sums over tp."""
    return name.endswith("norm.weight")


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of the full parameter ``name`` (a copy). The one place that defines
    the slicing convention: the stage builder and the tests both use it.

      embed / head / ffn.gate / ffn.up    dim 0 chunk (vocabulary or output features)
      attn.qkv                            dim 0, per q/k/v: rows of this rank's heads of each
      attn.out / ffn.down                 dim 1 chunk (input features; heads for attn.out)
      norms                               replicated (full)
    """
    if tp == 1 or tp_replicated(name):
        return full.clone()
    leaf = name.split(".")[-2]
    if leaf == "qkv":
        three_d, d_in = full.shape
        return full.view(3, tp, three_d // (3 * tp), d_in)[:, tp_rank].reshape(-1, d_in).clone()
    dim = 1 if leaf in ("out", "down") else 0
    if leaf not in ("embed", "head", "gate", "up", "out", "down"):
        raise ValueError(f"no tensor-parallel slicing rule for {name!r}")
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} not divisible by tp={tp}")
    return full.chunk(tp, dim=dim)[tp_rank].clone()


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ W_r.T`` with ``W_r`` this rank's rows; ``x`` must already be ``copy_to_tp``'d."""

    def __init__(self, in_features: int, out_features: int, tp: int):
        super().__init__()
        assert out_features % tp == 0, (out_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features // tp, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r @ W_r.T`` (all-reduced) with ``x_r``, ``W_r`` split along in-features."""

    def __init__(self, in_features: int, out_features: int, tp: int):
        super().__init__()
        assert in_features % tp == 0, (in_features, tp)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))

    def forward(self, x: torch.Tensor, comm) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), comm)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, tp_rank: int, tp: int):
        super().__init__()
        assert vocab_size % tp == 0, (vocab_size, tp)
        n = vocab_size // tp
        self.vocab_start, self.vocab_end = tp_rank * n, (tp_rank + 1) * n
        self.weight = nn.Parameter(torch.empty(n, dim))

    def forward(self, idx: torch.Tensor, comm) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)  # the owning rank supplies these rows
        return reduce_from_tp(x, comm)


class ParallelAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        assert cfg.n_heads % tp == 0, (cfg.n_heads, tp)
        self.n_heads = cfg.n_heads // tp  # local heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, tp)
        self.out = RowParallelLinear(cfg.d_model, cfg.d_model, tp)

    def forward(self, x, cos, sin, comm):
        b, t, _ = x.shape
        d_local = self.n_heads * self.head_dim
        q, k, v = self.qkv(copy_to_tp(x, comm)).split(d_local, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d_local), comm)


class ParallelSwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        hidden = cfg.ffn_hidden
        self.gate = ColumnParallelLinear(cfg.d_model, hidden, tp)
        self.up = ColumnParallelLinear(cfg.d_model, hidden, tp)
        self.down = RowParallelLinear(hidden, cfg.d_model, tp)

    def forward(self, x, comm):
        x = copy_to_tp(x, comm)
        return self.down(F.silu(self.gate(x)) * self.up(x), comm)


class ParallelBlock(nn.Module):
    """``model.Block`` with its attention and MLP split over tp; norms replicated (their inputs
    are full activations, and their gradients come out identical on every TP rank)."""

    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = ParallelAttention(cfg, tp)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = ParallelSwiGLU(cfg, tp)

    def forward(self, x, cos, sin, comm):
        x = x + self.attn(self.attn_norm(x), cos, sin, comm)
        return x + self.ffn(self.ffn_norm(x), comm)
