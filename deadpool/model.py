"""A small LLaMA-style decoder (RMSNorm, rotary grouped-query attention, SwiGLU) for the runtime.

Size comes from ``conf/model``. Nothing here knows about fault tolerance: the snapshot engine sees
the model only through ``named_parameters()`` and the optimizer's state.

Attention weights (what an exporter splits). ``blocks.{i}.attn.qkv.weight`` fuses q, k and v along
dim 0, ``[(n_heads + 2 * n_kv_heads) * head_dim, d_model]`` with ``head_dim = d_model / n_heads``:

    rows [0, H*hd)                 q   (query head h: rows [h*hd, (h+1)*hd))   = HF q_proj
    rows [H*hd, (H+KV)*hd)         k   (KV head j: rows H*hd + [j*hd, (j+1)*hd)) = HF k_proj
    rows [(H+KV)*hd, (H+2KV)*hd)   v                                            = HF v_proj

(H = ``n_heads``, KV = ``n_kv_heads``). Query head h reads KV head ``h // (H / KV)`` (grouped-
query attention; KV = H is multi-head attention, whose weight is the ``[3 * d_model, d_model]``
of q, k and v thirds, with the same initial values and results bit for bit). ``attn.out.weight`` is ``[d_model, H*hd]`` (HF o_proj). Rotary embedding
rotates adjacent pairs ``(2i, 2i+1)`` of each q and k head with frequency
``rope_theta ** (-2i / head_dim)``, as Meta's reference code does; Hugging Face's LlamaAttention
rotates halves ``(i, i + head_dim/2)``, so an exporter permutes the rows of each q and k head
(HF's ``convert_llama_weights_to_hf`` does the same).

Activation checkpointing (``activation_checkpointing``, conf/train.yaml) is per transformer block,
with ``torch.utils.checkpoint`` (non-reentrant):

  none        autograd keeps every activation of every block.
  full        a block keeps only its input; backward re-runs its forward (about one more
              forward pass of compute; under tensor parallelism the recomputation re-runs the
              attention's all-reduce too, see ``parallel/tensor/layers.py``).
  selective   only the SwiGLU activation ``silu(gate) * up`` is recomputed: elementwise, so ~T*f
              flops against the block's ~(8 d^2 + 6 d f) T of matmuls, and it drops silu(gate), one
              of the four ``T x f`` tensors the MLP keeps (the largest per-layer activations:
              f ~ 2.7 d). Megatron's selective recomputation targets the attention core's
              ``seq x seq`` scores instead; here attention is memory-efficient
              (``scaled_dot_product_attention``) and keeps no such tensor, so recomputing it would
              cost ~4 T^2 d flops for almost no memory. No communication is inside this region.

The model has no dropout or any other random op, so recomputation replays nothing random
(checkpoint still restores the RNG state around it, at the cost of reading it).

``compile=true`` (conf/train.yaml) runs each block's local compute, RMSNorm and the rotary
embedding included, through ``torch.compile`` (``parallel/compile.py``: the same arithmetic as
``rms_norm`` and ``attention_core``, fused by inductor); without it these run eagerly as here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from deadpool.init_rng import fill_normal_, param_key
from deadpool.topology import layer_range

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int             # query heads
    ffn_mult: int
    max_seq_len: int
    ffn_multiple_of: int = 32  # SwiGLU hidden size is rounded up to a multiple of this (LLaMA: 256)
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention); None: n_heads
    rope_theta: float = 10000.0    # rotary base: frequencies rope_theta ** (-2i / head_dim)
    norm_eps: float = 1e-6         # RMSNorm epsilon (LLaMA 1: 1e-6; Llama 2 and 3: 1e-5)

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for f in fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"model.{f.name}={getattr(self, f.name)} must be positive")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model.d_model={self.d_model} must be n_heads={self.n_heads} heads "
                             "of an even size (rotary embedding rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads="
                             f"{self.n_heads} (each KV head serves a group of query heads)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qkv_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v in the fused ``attn.qkv`` weight (see the module docstring)."""
        kv = self.n_kv_heads * self.head_dim
        return (self.n_heads * self.head_dim, kv, kv)

    @property
    def ffn_hidden(self) -> int:
        """LLaMA's SwiGLU width: 2/3 of ``ffn_mult * d_model`` (same parameter count as a plain
        MLP of that width), rounded up to a multiple of ``ffn_multiple_of``."""
        hidden = int(2 * self.ffn_mult * self.d_model / 3)
        return self.ffn_multiple_of * math.ceil(hidden / self.ffn_multiple_of)


_FLOAT_FIELDS = {"rope_theta", "norm_eps"}


def _field_value(key: str, value):
    if value is None and key == "n_kv_heads":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"model.{key} must be a number, got {value!r}") from None
    if key in _FLOAT_FIELDS:
        return number
    if number != int(number):
        raise ValueError(f"model.{key} must be an integer, got {value!r}")
    return int(number)


def model_config(model_cfg) -> ModelConfig:
    """A ``ModelConfig`` from a config mapping (keys with defaults may be absent) or itself.
    Raises ``ValueError`` naming the field on a non-number, a fractional count or a shape that
    does not hold together (``ModelConfig.__post_init__``)."""
    if isinstance(model_cfg, ModelConfig):
        return model_cfg
    return ModelConfig(**{f.name: _field_value(f.name, model_cfg[f.name])
                          for f in fields(ModelConfig) if f.name in model_cfg})


def check_activation_checkpointing(mode: str) -> str:
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing must be one of {list(ACTIVATION_CHECKPOINTING)}, "
                         f"got {mode!r}")
    return mode


def run_block(block: nn.Module, mode: str, *args):
    """``block(*args)``, checkpointed as a whole when ``mode == "full"`` and autograd records."""
    if mode == "full" and torch.is_grad_enabled():
        return checkpoint(block, *args, use_reentrant=False)
    return block(*args)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor, recompute: bool) -> torch.Tensor:
    """``silu(gate) * up``; with ``recompute`` (selective checkpointing) autograd keeps only
    ``gate`` and ``up`` and recomputes ``silu(gate)`` in backward."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(_silu_mul, gate, up, use_reentrant=False)
    return _silu_mul(gate, up)


INIT_STD = 0.02  # every weight but the norms' (Linear, Embedding): N(0, INIT_STD^2)


def init_values_(name: str, out: torch.Tensor, seed: int, starts=None, width: int | None = None
                 ) -> torch.Tensor:
    """Fill ``out`` with the initial values of parameter ``name`` at the full (unsharded)
    parameter's flat indices ``[s, s + width)`` for each ``s`` in ``starts`` (default: all of
    it), on ``out``'s device. Independent of any layout: element ``i`` is a function of ``(seed,
    name, i)`` alone (``deadpool.init_rng``), so a tensor/pipeline shard computes just the
    elements it holds (``parallel.stage.shard_segments``) and gets exactly the bits of the
    single-process model. Norm weights are ones; every other weight is N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return out.fill_(1.0)
    if starts is None:
        starts, width = [0], out.numel()
    return fill_normal_(out, param_key(seed, name), INIT_STD, starts, width)


def init_param(name: str, shape, seed: int, device="cpu") -> torch.Tensor:
    """The initial value of the full parameter ``name`` of ``shape`` (float32, on ``device``)."""
    return init_values_(name, torch.empty(shape, device=device), seed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's arithmetic (eager here; ``compile=true`` fuses it into the block's graphs,
    parallel/compile.py)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # always on the CPU (also under a meta-device context: computing them on meta is slow)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device="cpu").float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, heads, seq, head_dim); rotate pairs (even, odd)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2)


def attention_core(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                   cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal attention from the fused projection ``qkv`` ``(b, t, (n_heads + 2 n_kv_heads) hd)``
    (q, k, v row blocks as in the module docstring) to ``(b, t, n_heads * hd)``. Query head h uses
    KV head ``h // (n_heads / n_kv_heads)``; the KV heads are not copied (``enable_gqa``) where
    the kernel allows it (``native_gqa``)."""
    b, t, _ = qkv.shape
    q, k, v = qkv.split((n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim), dim=-1)
    q = q.view(b, t, n_heads, head_dim).transpose(1, 2)
    k, v = (z.view(b, t, n_kv_heads, head_dim).transpose(1, 2) for z in (k, v))
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    grouped = n_kv_heads != n_heads
    if grouped and not native_gqa(q):
        k, v = (z.repeat_interleave(n_heads // n_kv_heads, dim=1) for z in (k, v))
        grouped = False
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    return y.transpose(1, 2).reshape(b, t, n_heads * head_dim)


def native_gqa(q: torch.Tensor) -> bool:
    """Whether ``scaled_dot_product_attention(enable_gqa=True)`` runs a memory-efficient kernel
    for ``q``: on the CPU always; on CUDA only flash attention supports it (fp16/bf16), and fp32
    would fall back to the math kernel, which materialises the seq x seq scores. There the KV
    heads are repeated instead (2 T (d - kv) more bytes per layer than the memory estimate)."""
    return q.device.type == "cpu" or q.dtype in (torch.float16, torch.bfloat16)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, sum(cfg.qkv_rows), bias=False)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin):
        y = attention_core(self.qkv(x), self.n_heads, self.n_kv_heads, self.head_dim, cos, sin)
        return self.out(y)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, recompute_activation: bool = False):
        super().__init__()
        hidden = cfg.ffn_hidden
        self.recompute_activation = recompute_activation
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down(swiglu_activation(self.gate(x), self.up(x), self.recompute_activation))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, activation_checkpointing: str = "none"):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg, recompute_activation=activation_checkpointing == "selective")

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, activation_checkpointing: str = "none"):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = check_activation_checkpointing(activation_checkpointing)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, activation_checkpointing)
                                    for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The mean cross-entropy against ``targets``; without them, the logits ``(b, t, vocab)``."""
        t = idx.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embed(idx)
        for block in self.blocks:
            x = run_block(block, self.activation_checkpointing, x, cos, sin)
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def build_model(model_cfg, seed: int, device: str = "cpu",
                activation_checkpointing: str = "none") -> GPT:
    """Build the model with a seed-determined init (``init_values_``), drawn on ``device`` from
    the meta device (no default init, no host copy): every rank and every spare gets the same
    weights, and so does every tensor/pipeline layout (``parallel/stage.py``)."""
    cfg = model_config(model_cfg)
    with torch.device("meta"):
        model = GPT(cfg, activation_checkpointing)
    model = model.to_empty(device=device)
    cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)
    with torch.no_grad():
        for name, p in model.named_parameters():
            init_values_(name, p, seed)
    return model


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


# what one rank of a dp x tp x pp layout holds (the memory estimator and the build watchdog)
def stage_layers(n_layers: int, pp: int, pp_rank: int) -> int:
    """Layers on pipeline stage ``pp_rank`` (``topology.layer_range``)."""
    return len(layer_range(n_layers, pp, pp_rank))


def stage_params(model_cfg, tp: int, pp: int, pp_rank: int) -> int:
    """Parameters held by one rank of stage ``pp_rank`` (its tensor-parallel shard)."""
    m = model_config(model_cfg)
    d, f, v, kv = m.d_model, m.ffn_hidden, m.vocab_size, m.n_kv_heads * m.head_dim
    # q + k + v + out, gate + up + down, split over tp; two norms, replicated
    per_layer = (2 * d * d + 2 * d * kv + 3 * d * f) // tp + 2 * d
    n = stage_layers(m.n_layers, pp, pp_rank) * per_layer
    if pp_rank == 0:
        n += v * d // tp            # embedding, vocabulary-parallel
    if pp_rank == pp - 1:
        n += v * d // tp + d        # LM head (untied) and final norm
    return n
