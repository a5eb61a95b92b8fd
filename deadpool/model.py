"""A small LLaMA-style decoder (RMSNorm, rotary attention, SwiGLU) for the runtime.

Size comes from ``conf/model``. Nothing here knows about fault tolerance: the snapshot engine sees
the model only through ``named_parameters()`` and the optimizer's state.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    ffn_mult: int
    max_seq_len: int
    ffn_multiple_of: int = 32  # SwiGLU hidden size is rounded up to a multiple of this (LLaMA: 256)

    @property
    def ffn_hidden(self) -> int:
        """LLaMA's SwiGLU width: 2/3 of ``ffn_mult * d_model`` (same parameter count as a plain
        MLP of that width), rounded up to a multiple of ``ffn_multiple_of``."""
        hidden = int(2 * self.ffn_mult * self.d_model / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


def model_config(model_cfg) -> ModelConfig:
    """A ``ModelConfig`` from a config mapping (keys with defaults may be absent) or itself."""
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    fields = ModelConfig.__dataclass_fields__
    return ModelConfig(**{k: int(model_cfg[k]) for k in fields if k in model_cfg})


def init_param(name: str, shape, seed: int) -> torch.Tensor:
    """The initial value of the full (unsharded) parameter ``name``, independent of any layout.

    Each parameter has its own CPU generator seeded from ``(seed, crc32(name))``, so its value
    depends on nothing else: a tensor/pipeline shard draws just the full parameters it holds a
    slice of and keeps its slice, and gets exactly the bits of the single-process model. (A
    stream cannot be skipped into, so the full tensor is drawn; it is freed right after.) Norm
    weights are ones; every other weight (Linear, Embedding) is N(0, 0.02).
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(((seed & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode()))
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # always on the CPU (also under a meta-device context: computing them on meta is slow)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device="cpu").float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.ffn_hidden
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model)
        self.ffn = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.d_model // cfg.n_heads, cfg.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy against ``targets``; without them, the logits ``(b, t, vocab)``."""
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(model_cfg, seed: int, device: str = "cpu") -> GPT:
    """Build the model with a seed-determined init (``init_param``): every rank and every spare
    gets the same weights, and so does every tensor/pipeline layout (``parallel/stage.py``)."""
    cfg = model_config(model_cfg)
    with torch.random.fork_rng(devices=[]):  # the modules' default init must not move the global RNG
        model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_param(name, p.shape, seed))
    return model.to(device)


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with its state created eagerly, so the snapshot layout is fixed before step 1."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                            foreach=False)
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
    return opt
