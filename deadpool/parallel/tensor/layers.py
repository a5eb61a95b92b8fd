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
                         each rank holding the q rows of its n_heads/tp query heads and the k and
                         v rows of its n_kv_heads/tp KV heads (not a contiguous block of the fused
                         weight, see ``shard``); output projection row-parallel. Under grouped-
                         query attention the split keeps every query head on the rank of its KV
                         head: rank r's query heads [r H/tp, (r+1) H/tp) read KV heads
                         [r KV/tp, (r+1) KV/tp), which needs KV % tp == 0 (and KV | H).
  ParallelSwiGLU         gate/up column-parallel, down row-parallel: the elementwise
                         ``silu(gate) * up`` needs no communication.

Every forward takes the generation's ``comm``; nothing here stores it.

Activation checkpointing and communication. ``full`` checkpoints a whole ``ParallelBlock``,
communication included, as Megatron's full recomputation does: backward re-runs the block's
forward up to its last saved tensor (non-reentrant checkpointing stops there), which repeats the
attention's ``reduce_from_tp`` all-reduce; the MLP's comes after the last saved tensor and is
not repeated. So one more all-reduce per block and micro-batch. That is correct because (1)
every rank of a TP group recomputes the same blocks of the same micro-batches in the same order
(the schedule and the graph are the same on each), so each issues the same sequence of
collectives and the groups' op counters stay equal; (2) the sum is of the same inputs as in the
forward, and an all-reduce of equal inputs over the same group is bitwise repeatable (gloo's
ring; NCCL with its algorithm fixed by message size), so the recomputed activations equal the
forward's and gradients are bitwise those without checkpointing (tested at tp=2, with the
collective counts). The recomputed all-reduce is abortable like every other wait. ``selective``
recomputes only ``silu(gate) * up``, which contains no communication.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from deadpool.model import ModelConfig, RMSNorm, attention_core, model_config, swiglu_activation
from deadpool.parallel.tensor.ops import copy_to_tp, reduce_from_tp


def tp_replicated(name: str) -> bool:
    """Parameter ``name`` is held whole, with identical values and gradients, by every
    tensor-parallel rank (the norms): it must be counted once in sums over tp."""
    return name.endswith("norm.weight")


def shard(name: str, full: torch.Tensor, tp_rank: int, tp: int, model_cfg=None) -> torch.Tensor:
    """This TP rank's slice of the full parameter ``name`` (a copy). The one place that defines
    the slicing convention: the stage builder, ``unshard`` and the tests use it.

      embed / head / ffn.gate / ffn.up    dim 0 chunk (vocabulary or output features)
      attn.qkv                            dim 0, per q/k/v: rows of this rank's query heads, then
                                          of its KV heads in k and in v (``model_cfg`` gives the
                                          q/k/v row split; without it the weight must be
                                          multi-head, [3 d, d], and is cut in thirds)
      attn.out / ffn.down                 dim 1 chunk (input features; heads for attn.out)
      norms                               replicated (full)
    """
    if tp == 1 or tp_replicated(name):
        return full.clone()
    leaf = name.split(".")[-2]
    if leaf == "qkv":
        rows = _qkv_rows(name, full.shape, tp, model_cfg)
        return torch.cat([part.chunk(tp, dim=0)[tp_rank] for part in full.split(rows, dim=0)])
    dim = 1 if leaf in ("out", "down") else 0
    if leaf not in ("embed", "head", "gate", "up", "out", "down"):
        raise ValueError(f"no tensor-parallel slicing rule for {name!r}")
    if full.shape[dim] % tp:
        raise ValueError(f"{name}: dim {dim} of size {full.shape[dim]} not divisible by tp={tp}")
    return full.chunk(tp, dim=dim)[tp_rank].clone()


def unshard(name: str, pieces: list[torch.Tensor], model_cfg=None) -> torch.Tensor:
    """The full parameter ``name`` from its TP ranks' slices ``pieces`` (rank order): the inverse
    of ``shard``, for tools that consolidate a tensor-parallel run (an exporter, a checkpoint
    converter)."""
    tp = len(pieces)
    if tp == 1 or tp_replicated(name):
        return pieces[0].clone()
    leaf = name.split(".")[-2]
    if leaf == "qkv":
        full_shape = (tp * pieces[0].shape[0], pieces[0].shape[1])
        rows = [r // tp for r in _qkv_rows(name, full_shape, tp, model_cfg)]
        split = [p.split(rows, dim=0) for p in pieces]  # per rank: (q, k, v)
        return torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
    return torch.cat(pieces, dim=1 if leaf in ("out", "down") else 0)


def _qkv_rows(name: str, shape, tp: int, model_cfg) -> tuple[int, int, int]:
    """Rows of q, k, v in the fused weight of full ``shape``. Without ``model_cfg`` only a
    multi-head weight ([3 d, d]: as many KV heads as query heads) is accepted, since a grouped-
    query weight's split depends on the head counts."""
    if model_cfg is None:
        if shape[0] != 3 * shape[1]:
            raise ValueError(f"{name}: a grouped-query q/k/v weight {tuple(shape)} needs the model "
                             "config to be split")
        rows = (shape[1],) * 3
    else:
        cfg = model_config(model_cfg)
        rows = cfg.qkv_rows
        if cfg.n_kv_heads % tp:
            raise ValueError(f"model n_kv_heads={cfg.n_kv_heads} is not divisible by tp={tp}")
    if shape[0] != sum(rows) or any(r % tp for r in rows):
        raise ValueError(f"{name}: {shape[0]} rows do not split into q/k/v {rows} over tp={tp}")
    return rows


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
        assert cfg.n_kv_heads % tp == 0 and cfg.n_heads % cfg.n_kv_heads == 0, (cfg, tp)
        self.n_heads, self.n_kv_heads = cfg.n_heads // tp, cfg.n_kv_heads // tp  # local heads
        self.head_dim = cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.d_model, sum(cfg.qkv_rows), tp)
        self.out = RowParallelLinear(cfg.n_heads * cfg.head_dim, cfg.d_model, tp)

    def forward(self, x, cos, sin, comm):
        y = attention_core(self.qkv(copy_to_tp(x, comm)), self.n_heads, self.n_kv_heads,
                           self.head_dim, cos, sin)
        return self.out(y, comm)


class ParallelSwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, recompute_activation: bool = False):
        super().__init__()
        hidden = cfg.ffn_hidden
        self.recompute_activation = recompute_activation
        self.gate = ColumnParallelLinear(cfg.d_model, hidden, tp)
        self.up = ColumnParallelLinear(cfg.d_model, hidden, tp)
        self.down = RowParallelLinear(hidden, cfg.d_model, tp)

    def forward(self, x, comm):
        x = copy_to_tp(x, comm)
        return self.down(swiglu_activation(self.gate(x), self.up(x), self.recompute_activation),
                         comm)


class ParallelBlock(nn.Module):
    """``model.Block`` with its attention and MLP split over tp; norms replicated (their inputs
    are full activations, and their gradients come out identical on every TP rank)."""

    def __init__(self, cfg: ModelConfig, tp: int, activation_checkpointing: str = "none"):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = ParallelAttention(cfg, tp)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = ParallelSwiGLU(cfg, tp, activation_checkpointing == "selective")

    def forward(self, x, cos, sin, comm):
        x = x + self.attn(self.attn_norm(x), cos, sin, comm)
        return x + self.ffn(self.ffn_norm(x), comm)
