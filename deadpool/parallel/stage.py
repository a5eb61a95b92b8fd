"""One rank's piece of the decoder under tp x pp: a contiguous run of layers, tensor-parallel.

Stage ``pp_rank`` of ``pp`` holds layers ``layer_range(n_layers, pp, pp_rank)`` (as even as
possible, earlier stages take the extra layer: the last stage also carries the head and the loss,
the first only an embedding lookup). The first stage adds the vocabulary-parallel embedding; the
last the final norm, the vocabulary-parallel head and the vocabulary-parallel cross-entropy.

Under interleaved 1F1B (``virtual_stages`` v > 1) a rank holds v model chunks instead, chunk
``c`` being model chunk ``c * pp + pp_rank`` (``topology.layer_chunks``); ``forward(chunk=c)``
runs one of them. The embedding still sits on rank 0 (its chunk 0) and the head on the last rank
(its chunk v - 1), so ``is_first`` / ``is_last`` keep their meaning for the rank.

Parameter names are the single-process model's (``deadpool.model.GPT``): blocks live in a
``ModuleDict`` keyed by their *global* index, so stage 1 of a 4-layer, 2-stage model holds
``blocks.2.*`` and ``blocks.3.*``. Each parameter is ``layers.shard(name, full, tp_rank, tp)`` of
the full one, and ``build_stage`` builds it bit-for-bit from ``model.init_values_`` without building
the whole model: on its device, from the meta device, computing only the elements it holds
(``shard_segments`` says where they lie in the full parameter). Checkpoints, snapshots and tests can therefore map any layout onto any other
through (name, tp slice).

``activation_checkpointing`` (``none|full|selective``, see ``deadpool/model.py``) applies per
block; under ``full`` the stage's forward keeps one activation per block for the pipeline's
backward, whose recomputation runs inside the schedule's backward of that micro-batch.
"""

from __future__ import annotations

import math

import torch
import torch._dynamo  # noqa: F401  (see below)
import torch.nn as nn

from deadpool.model import (GPT, RMSNorm, check_activation_checkpointing, init_values_,
                            model_config, rotary_tables, run_block)
from deadpool.parallel.tensor.layers import (ColumnParallelLinear, ParallelBlock,
                                             VocabParallelEmbedding, shard)
from deadpool.parallel.tensor.ops import copy_to_tp, vocab_parallel_cross_entropy
from deadpool.topology import layer_chunks, layer_range  # noqa: F401 (layer_range re-exported)

# Stages are built on the meta device first (``empty_stage``), where torch's parameter init runs
# Python meta kernels that import torch._dynamo on first use: about 1 s of CPU. Imported with
# this module instead, a process that forks ranks after importing the worker (a node agent under
# ``launcher.fork_workers``, the launcher's zygote) pays it once for all of them, not once per
# rank; a new interpreter pays it as before. The import starts no thread.


class StageModel(nn.Module):
    def __init__(self, cfg, *, pp_rank: int, pp: int, tp_rank: int, tp: int,
                 activation_checkpointing: str = "none", virtual_stages: int = 1):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = check_activation_checkpointing(activation_checkpointing)
        self.pp_rank, self.pp, self.tp_rank, self.tp = pp_rank, pp, tp_rank, tp
        self.virtual_stages = virtual_stages
        self.is_first, self.is_last = pp_rank == 0, pp_rank == pp - 1
        self.chunks = layer_chunks(cfg.n_layers, pp, pp_rank, virtual_stages)
        self.layers = [i for chunk in self.chunks for i in chunk]
        if self.is_first:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tp_rank, tp)
        self.blocks = nn.ModuleDict({str(i): ParallelBlock(cfg, tp, activation_checkpointing)
                                     for i in self.layers})
        if self.is_last:
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.head = ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tp)
            self.vocab_start = tp_rank * (cfg.vocab_size // tp)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def activation_shape(self, micro_batch_size: int, seq_len: int) -> tuple[int, int, int]:
        """Shape of the activation passed between stages (what a non-first stage receives)."""
        return (micro_batch_size, seq_len, self.cfg.d_model)

    def chunk_is_first(self, chunk: int) -> bool:
        """Model chunk 0: it starts from token ids (the embedding)."""
        return self.is_first and chunk == 0

    def chunk_is_last(self, chunk: int) -> bool:
        """The model's last chunk: it ends in the head and the loss."""
        return self.is_last and chunk == self.virtual_stages - 1

    def forward(self, inp: torch.Tensor, comm, targets: torch.Tensor | None = None,
                chunk: int = 0):
        """``inp``: token ids ``(b, t)`` on the first chunk, else the activation ``(b, t, d)``.

        Returns the activation ``(b, t, d)``; on the last chunk the mean cross-entropy over its
        ``b * t`` tokens (or, without ``targets``, this rank's logits slice ``(b, t, vocab/tp)``).
        ``chunk``: which of the rank's ``virtual_stages`` chunks runs (0 when not interleaved).
        """
        t = inp.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(inp, comm) if self.chunk_is_first(chunk) else inp
        for i in self.chunks[chunk]:
            x = run_block(self.blocks[str(i)], self.activation_checkpointing, x, cos, sin, comm)
        if not self.chunk_is_last(chunk):
            return x
        logits = self.head(copy_to_tp(self.norm(x), comm))
        if targets is None:
            return logits
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), targets.reshape(-1),
                                              self.vocab_start, comm)
        return losses.mean()


def check_layout(cfg, pp: int, tp: int, virtual_stages: int = 1) -> None:
    """Raise ``ValueError`` unless the model splits evenly over tp and has a layer per stage
    (under interleaving: ``n_layers`` divisible by ``pp * virtual_stages``)."""
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                    ("vocab_size", cfg.vocab_size), ("ffn hidden size", cfg.ffn_hidden)):
        if n % tp:
            raise ValueError(f"model {what}={n} is not divisible by tp={tp}")
    if cfg.n_layers < pp:
        raise ValueError(f"model n_layers={cfg.n_layers} is fewer than pp={pp} stages")
    layer_chunks(cfg.n_layers, pp, 0, virtual_stages)  # raises when chunks would be unequal


def empty_stage(cfg, device, **kw) -> StageModel:
    """A stage with parameters allocated on ``device`` but not set (rotary tables computed)."""
    with torch.device("meta"):
        stage = StageModel(cfg, **kw)
    stage = stage.to_empty(device=device)
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    stage.rope_cos.copy_(cos)
    stage.rope_sin.copy_(sin)
    return stage


def shard_segments(name: str, full_shape, tp_rank: int, tp: int, model_cfg) -> tuple[list[int], int]:
    """Where ``shard(name, full, tp_rank, tp, model_cfg)`` lies in ``full``'s flat (row-major)
    index: flattened, the slice is the runs ``[s, s + width)`` for each ``s`` of the returned
    starts, in order. Found by applying ``shard`` itself to a grid of (row, column block) ids,
    one id per row and ``tp``-th of a row, so the slicing convention stays defined in one
    place (``layers.shard``: whole rows for dim-0 chunks and the q/k/v heads, a column block of
    every row for dim-1 chunks)."""
    shape = tuple(full_shape)
    numel = math.prod(shape)
    rows = shape[0] if len(shape) > 1 else 1
    cols = numel // rows
    blocks = tp if cols % tp == 0 else 1  # a row must split evenly to be cut by columns
    width = cols // blocks
    grid = torch.arange(rows * blocks).view((rows, blocks) if len(shape) > 1 else (blocks,))
    held = shard(name, grid, tp_rank, tp, model_cfg).reshape(-1)
    starts = ((held // blocks) * cols + (held % blocks) * width).tolist()
    if all(b - a == width for a, b in zip(starts, starts[1:])):  # one contiguous run
        return starts[:1], width * len(starts)
    return starts, width


def build_stage(model_cfg, seed: int, *, pp_rank: int, pp: int, tp_rank: int, tp: int,
                device="cpu", init: bool = True, activation_checkpointing: str = "none",
                weights=None, virtual_stages: int = 1) -> StageModel:
    """This rank's stage, with parameters equal (bitwise) to the matching slices of
    ``deadpool.model.build_model(model_cfg, seed)``. Draws only the elements it holds, on
    ``device`` (the values are meant not to depend on the device: ``deadpool.init_rng``).

    ``init=False``: parameters are allocated but not drawn (a spare whose state will arrive by
    transfer: drawing the init it overwrites would lengthen every hot-swap).

    ``virtual_stages``: the rank's model chunks under interleaved 1F1B (``StageModel``).

    ``weights``: ``(name, tp_rank, tp) -> slice``, the initial values read instead of drawn
    (``model.init_from``: ``export.hf_import.stage_loader``); each must have its parameter's
    shape."""
    cfg = model_config(model_cfg)
    check_layout(cfg, pp, tp, virtual_stages)
    kw = dict(pp_rank=pp_rank, pp=pp, tp_rank=tp_rank, tp=tp,
              activation_checkpointing=activation_checkpointing, virtual_stages=virtual_stages)
    if not init:
        return empty_stage(cfg, device, **kw)
    if weights is not None:  # read on the CPU slice by slice (no full parameter), then moved
        stage = empty_stage(cfg, "cpu", **kw)
        with torch.no_grad():
            for name, p in stage.named_parameters():
                t = weights(name, tp_rank, tp)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: the initial weights give {list(t.shape)}, the stage "
                                     f"(tp {tp_rank} of {tp}) holds {list(p.shape)}")
                p.copy_(t)
        return stage.to(device)
    with torch.device("meta"):
        full_shapes = {n: p.shape for n, p in GPT(cfg).named_parameters()}
    stage = empty_stage(cfg, device, **kw)
    with torch.no_grad():
        for name, p in stage.named_parameters():
            starts, width = shard_segments(name, full_shapes[name], tp_rank, tp, cfg)
            init_values_(name, p, seed, starts, width)
    return stage
