"""``compile=true``: each transformer block's local compute compiled with ``torch.compile``.

A block (``model.Block`` or ``tensor.layers.ParallelBlock``) is four local pieces separated by
the tensor-parallel collectives, which stay eager, outside every compiled graph:

    h = rms_norm(x)                       [compiled]
    a = reduce_from_tp(attn(copy_to_tp(h)))   attn = qkv -> rotary -> SDPA -> out  [compiled]
    x, h = x + a, rms_norm(x + a)         [compiled]
    x + reduce_from_tp(mlp(copy_to_tp(h)))    mlp = down(silu(gate) * up)  [compiled]

At tp == 1 there is no collective between them, so the attention half (norm, qkv, rotary, SDPA,
out projection, residual add) and the MLP half (norm, SwiGLU, residual add) are one graph each:
RMSNorm and the rotary embedding are fused by inductor into their neighbours. The collectives
being eager is what lets recovery replace the communicator under a compiled model: no graph holds
a process group, and a new generation's groups change no guard.

The pieces are module-level functions taking the weights as arguments, so every block of every
stage (and a spare's stage, whatever rank it takes) runs the same compiled code: dynamo guards on
the inputs' shapes, dtypes and ``requires_grad``, not on which module they came from. A spare
compiles them while warm (``warm_up``: one forward and backward of zeros through a block with
detached copies of its weights, touching no parameter and no communicator), so a hot swap
compiles nothing; ``compiles()`` counts the graphs dynamo has handed to inductor in this process
(a counting backend), so tests can assert that survivors recompile nothing after a swap.

Compiled and eager results are not bitwise equal (inductor fuses and reorders elementwise and
reduction arithmetic); compiled code is deterministic run to run and identical in every process
that compiles the same graph, so a hot swap under ``compile=true`` ends bitwise equal to a
failure-free run with ``compile=true`` (tests/integration/test_compile.py).

Activation checkpointing: ``selective`` is not applied inside the compiled MLP (inductor's
min-cut partitioner already recomputes cheap pointwise ops such as ``silu(gate) * up`` in
backward rather than keeping them); ``full`` wraps the compiled block as it wraps the eager one.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from deadpool.model import attention_core, rms_norm
from deadpool.parallel.tensor.ops import copy_to_tp, reduce_from_tp
from deadpool.settings import num_microbatches

_compiles = 0  # graphs compiled in this process (forward graphs; see compiles())
_warm_compiles = 0  # of which while warming up (warm_up)


def compiles() -> int:
    """Graphs dynamo has compiled in this process so far outside ``warm_up`` (first compiles and
    recompiles; each metrics record carries it: after a hot swap it must not move)."""
    return _compiles - _warm_compiles


def warm_compiles() -> int:
    """Graphs compiled by ``warm_up`` (a spare's, before it takes a rank)."""
    return _warm_compiles


def _counting_inductor(gm, example_inputs):
    global _compiles
    _compiles += 1
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs)


def _norm(x, w, eps: float):
    return rms_norm(x, w, eps)


def _attn(h, qkv_w, out_w, cos, sin, heads: int, kv_heads: int, head_dim: int):
    return F.linear(attention_core(F.linear(h, qkv_w), heads, kv_heads, head_dim, cos, sin), out_w)


def _add_norm(x, a, w, eps: float):
    x = x + a
    return x, rms_norm(x, w, eps)


def _mlp(h, gate_w, up_w, down_w):
    return F.linear(F.silu(F.linear(h, gate_w)) * F.linear(h, up_w), down_w)


def _attn_half(x, norm_w, eps: float, qkv_w, out_w, cos, sin, heads: int, kv_heads: int,
               head_dim: int):
    return x + _attn(rms_norm(x, norm_w, eps), qkv_w, out_w, cos, sin, heads, kv_heads, head_dim)


def _mlp_half(x, norm_w, eps: float, gate_w, up_w, down_w):
    return x + _mlp(rms_norm(x, norm_w, eps), gate_w, up_w, down_w)


class _Kernels:
    def __init__(self):
        def c(fn):
            return torch.compile(fn, backend=_counting_inductor, dynamic=False)
        self.norm, self.attn, self.add_norm, self.mlp = c(_norm), c(_attn), c(_add_norm), c(_mlp)
        self.attn_half, self.mlp_half = c(_attn_half), c(_mlp_half)


_kernels: _Kernels | None = None


def kernels() -> _Kernels:
    global _kernels
    if _kernels is None:
        _kernels = _Kernels()
    return _kernels


def block_forward(block, tp: int, x, cos, sin, comm=None):
    """``block(x, cos, sin[, comm])`` through the compiled pieces (see the module docstring).
    ``tp`` is the layout's (the stage's), not the communicator's: a spare warming up without a
    communicator runs the same pieces as it will under its group."""
    k, a, f = kernels(), block.attn, block.ffn
    heads = (a.n_heads, a.n_kv_heads, a.head_dim)
    if tp == 1:
        x = k.attn_half(x, block.attn_norm.weight, block.attn_norm.eps, a.qkv.weight, a.out.weight,
                        cos, sin, *heads)
        return k.mlp_half(x, block.ffn_norm.weight, block.ffn_norm.eps, f.gate.weight,
                          f.up.weight, f.down.weight)
    h = k.norm(x, block.attn_norm.weight, block.attn_norm.eps)
    y = reduce_from_tp(k.attn(copy_to_tp(h, comm), a.qkv.weight, a.out.weight, cos, sin, *heads),
                       comm)
    x, h = k.add_norm(x, y, block.ffn_norm.weight, block.ffn_norm.eps)
    return x + reduce_from_tp(k.mlp(copy_to_tp(h, comm), f.gate.weight, f.up.weight,
                                    f.down.weight), comm)


def compile_blocks(model, enabled: bool = True) -> None:
    """Route every block of ``model`` (a ``GPT`` or a ``StageModel``) through ``block_forward``.
    A no-op unless ``enabled`` (the ``compile`` setting): the eager modules run unchanged."""
    if not enabled:
        return
    tp = int(getattr(model, "tp", 1))
    blocks = model.blocks.values() if isinstance(model.blocks, torch.nn.ModuleDict) else model.blocks
    for block in blocks:
        def forward(self, x, cos, sin, comm=None, _tp=tp):
            return block_forward(self, _tp, x, cos, sin, comm)
        block.forward = types.MethodType(forward, block)


def compile_stage(stage, cfg: dict, warm: bool = False) -> None:
    """``compile_blocks(stage)`` when ``cfg["compile"]``; with ``warm`` (a spare's first build),
    also ``warm_up`` for the run's micro-batch shape."""
    if not cfg.get("compile", False):
        return
    compile_blocks(stage)
    if warm:
        warm_up(stage, int(cfg["batch_size"]) // num_microbatches(cfg), int(cfg["seq_len"]))


def warm_up(model, micro_batch: int, seq_len: int) -> int:
    """Compile ``model``'s block pieces for inputs ``(micro_batch, seq_len, d_model)`` now: one
    forward and backward of zeros through its first block, with detached copies of the block's
    weights (no parameter gets a gradient, no hook fires, no communicator is needed). Returns
    the graphs compiled. A warm spare calls it after pre-building its stage."""
    global _warm_compiles
    before = _compiles
    blocks = list(model.blocks.values() if isinstance(model.blocks, torch.nn.ModuleDict)
                  else model.blocks)
    if not blocks:
        return 0
    block = blocks[0]
    like = next(block.parameters())
    copy = {n: torch.nn.Parameter(p.detach().clone().zero_()) for n, p in block.named_parameters()}
    ghost = _Ghost(block, copy)
    t = seq_len
    cos, sin = model.rope_cos[:t], model.rope_sin[:t]
    x = torch.zeros(micro_batch, t, model.cfg.d_model, dtype=like.dtype, device=like.device,
                    requires_grad=True)
    block_forward(ghost, int(getattr(model, "tp", 1)), x, cos, sin, None).sum().backward()
    _warm_compiles += _compiles - before
    return _compiles - before


class _Ghost:
    """A block's attribute tree with other weights (what ``block_forward`` reads)."""

    def __init__(self, block, weights: dict, prefix: str = ""):
        for name in ("attn", "ffn", "attn_norm", "ffn_norm", "qkv", "out", "gate", "up", "down"):
            if hasattr(block, name):
                setattr(self, name, _Ghost(getattr(block, name), weights, prefix + name + "."))
        for name in ("n_heads", "n_kv_heads", "head_dim", "eps"):
            if hasattr(block, name):
                setattr(self, name, getattr(block, name))
        if prefix + "weight" in weights:
            self.weight = weights[prefix + "weight"]
