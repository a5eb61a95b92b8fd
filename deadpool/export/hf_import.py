"""Start from a Hugging Face Llama checkpoint: ``model.init_from=DIR``.

``DIR`` is what ``LlamaForCausalLM.save_pretrained`` (or ``python -m deadpool.export``) writes:
``config.json`` and ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files with
``model.safetensors.index.json``; tensors in bf16, fp16 or fp32. The mapping is the inverse of
``llama.to_hf``: q/k/v rejoin into the fused ``attn.qkv``, and the rows of each q and k head go
back from Hugging Face's rotate-half order to DeadPool's interleaved pairs
(``llama.rotary_to_half``, inverted).

Each rank reads only the slices its (pp, tp) stage holds (safetensors' ``get_slice``: the file is
memory-mapped and only the requested rows or columns are copied), so a rank's memory is bounded by
its stage, not by the model. ``check`` compares ``config.json`` and every tensor's shape with the
model config before any process starts (``job.validate``) and names the field that disagrees.

Slicing rule. ``rank_slice`` restates, per Hugging Face tensor, what ``tensor.layers.shard`` keeps
(row chunks for embed/head/gate/up and per q/k/v head group, column chunks for o_proj/down,
norms whole); tests check it against ``shard`` for every parameter, layout and head count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from deadpool.export.llama import heads, to_hf
from deadpool.model import GPT, model_config

INDEX = "model.safetensors.index.json"
# config.json field -> (conf/model field, value in the model config)
FIELDS = {"vocab_size": ("vocab_size", lambda m: m.vocab_size),
          "hidden_size": ("d_model", lambda m: m.d_model),
          "num_hidden_layers": ("n_layers", lambda m: m.n_layers),
          "num_attention_heads": ("n_heads", lambda m: m.n_heads),
          "num_key_value_heads": ("n_kv_heads", lambda m: m.n_kv_heads),
          "intermediate_size": ("ffn_mult/ffn_multiple_of (SwiGLU hidden)", lambda m: m.ffn_hidden),
          "rope_theta": ("rope_theta", lambda m: m.rope_theta),
          "rms_norm_eps": ("norm_eps", lambda m: m.norm_eps)}


class InitFromError(ValueError):
    """The Hugging Face directory cannot start this model: the message names the field."""


def hf_fields(conf: dict) -> dict:
    """The fields of ``FIELDS`` from a ``config.json`` (``rope_theta`` top level or, from
    transformers 5, in ``rope_parameters``; ``num_key_value_heads`` defaults to the heads)."""
    out = {k: conf.get(k) for k in FIELDS}
    rope = conf.get("rope_parameters") or {}
    if out["rope_theta"] is None:
        out["rope_theta"] = rope.get("rope_theta", 10000.0)
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


class HFWeights:
    """The tensors of a Hugging Face directory, opened lazily (one ``safe_open`` per file)."""

    def __init__(self, path):
        self.dir = Path(path)
        if not (self.dir / "config.json").is_file():
            raise InitFromError(f"model.init_from={self.dir}: no config.json (a Hugging Face model "
                               "directory, as save_pretrained writes it)")
        self.config = json.loads((self.dir / "config.json").read_text())
        self._handles: dict[str, object] = {}
        if (self.dir / INDEX).is_file():
            self.weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            self.weight_map = {n: "model.safetensors" for n in self._file("model.safetensors").keys()}
        else:
            raise InitFromError(f"model.init_from={self.dir}: no model.safetensors nor {INDEX}")

    def _file(self, fname: str):
        from safetensors import safe_open

        if fname not in self._handles:
            f = self.dir / fname
            if not f.is_file():
                raise InitFromError(f"model.init_from={self.dir}: {fname} (named by {INDEX}) is missing")
            self._handles[fname] = safe_open(str(f), framework="pt")
        return self._handles[fname]

    def slice(self, name: str):
        """safetensors' lazy slice of tensor ``name`` (index it to read)."""
        if name not in self.weight_map:
            raise InitFromError(f"model.init_from={self.dir}: no tensor {name!r}")
        return self._file(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())


def expected_shapes(mcfg) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> full shape of the model ``mcfg`` (``to_hf`` on the meta device)."""
    with torch.device("meta"):
        full = dict(GPT(mcfg).named_parameters())
    return {n: tuple(t.shape) for n, t in to_hf({n: p.detach() for n, p in full.items()}, mcfg).items()}


def head_name(weights: HFWeights) -> str:
    """``lm_head.weight``, or the embedding where the checkpoint ties them and stores none."""
    if "lm_head.weight" not in weights.weight_map and weights.config.get("tie_word_embeddings"):
        return "model.embed_tokens.weight"
    return "lm_head.weight"


def check(path, model_cfg) -> HFWeights:
    """Raise ``InitFromError`` naming the first field or tensor of ``path`` that disagrees with
    ``model_cfg`` (conf/model); reads headers only."""
    mcfg = model_config(model_cfg)
    w = HFWeights(path)
    where = f"model.init_from={w.dir}"
    if w.config.get("model_type", "llama") != "llama":
        raise InitFromError(f"{where}: model_type={w.config.get('model_type')!r}, not a Llama")
    for flag in ("attention_bias", "mlp_bias"):
        if w.config.get(flag):
            raise InitFromError(f"{where}: {flag}=true, DeadPool's decoder has no biases")
    scaling = w.config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or (w.config.get("rope_parameters") or {}
                                                              ).get("rope_type", "default")
    if kind not in ("default", None):
        raise InitFromError(f"{where}: rope_scaling {kind!r} is not implemented (plain rotary only)")
    got = hf_fields(w.config)
    for key, (ours, value) in FIELDS.items():
        want = value(mcfg)
        if got[key] is None or float(got[key]) != float(want):
            raise InitFromError(f"{where}: config.json {key}={got[key]} but the model config has "
                               f"{ours}={want} (set model.* to the checkpoint's)")
    hd = w.config.get("head_dim")
    if hd is not None and int(hd) != mcfg.head_dim:
        raise InitFromError(f"{where}: config.json head_dim={hd} but d_model/n_heads={mcfg.head_dim}")
    for name, shape in expected_shapes(mcfg).items():
        src = head_name(w) if name == "lm_head.weight" else name
        if src not in w.weight_map:
            raise InitFromError(f"{where}: tensor {src} is missing")
        if w.shape(src) != shape:
            raise InitFromError(f"{where}: tensor {src} has shape {list(w.shape(src))}, the model "
                               f"config needs {list(shape)}")
    return w


def from_half(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of q or k heads from rotate-half back to interleaved pairs (``rotary_to_half``'s
    inverse: DeadPool row 2i is HF row i, row 2i+1 is HF row head_dim/2 + i)."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    inverse = torch.argsort(order)
    return w.view(n_heads, head_dim, -1)[:, inverse].reshape(n_heads * head_dim, -1)


def _chunk(sl, size: int, tp_rank: int, tp: int, dim: int) -> torch.Tensor:
    """Chunk ``tp_rank`` of ``tp`` along ``dim`` (0 or 1) of a lazy slice, read alone."""
    n = size // tp
    a, b = tp_rank * n, (tp_rank + 1) * n
    return sl[a:b] if dim == 0 else sl[:, a:b]


def rank_slice(weights: HFWeights, name: str, mcfg, tp_rank: int, tp: int) -> torch.Tensor:
    """The slice of DeadPool parameter ``name`` that tp rank ``tp_rank`` of ``tp`` holds (what
    ``shard(name, full, tp_rank, tp)`` keeps), read from the Hugging Face tensors."""
    mcfg = model_config(mcfg)
    top = {"embed.weight": ("model.embed_tokens.weight", 0), "head.weight": (head_name(weights), 0),
           "norm.weight": ("model.norm.weight", None)}
    if name in top:
        hf, dim = top[name]
        sl = weights.slice(hf)
        return sl[:] if dim is None or tp == 1 else _chunk(sl, sl.get_shape()[0], tp_rank, tp, 0)
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None:
        raise InitFromError(f"no Hugging Face LLaMA tensor for parameter {name!r}")
    layer, leaf = f"model.layers.{m.group(1)}.", m.group(2)
    n_heads, n_kv, hd = heads(mcfg)
    if leaf == "attn.qkv.weight":
        parts = []
        for proj, count, rotary in (("q", n_heads, True), ("k", n_kv, True), ("v", n_kv, False)):
            rows = _chunk(weights.slice(f"{layer}self_attn.{proj}_proj.weight"), count * hd,
                          tp_rank, tp, 0)
            parts.append(from_half(rows, count // tp, hd) if rotary else rows)
        return torch.cat(parts)
    simple = {"attn_norm.weight": ("input_layernorm.weight", None),
              "ffn_norm.weight": ("post_attention_layernorm.weight", None),
              "attn.out.weight": ("self_attn.o_proj.weight", 1), "ffn.gate.weight": ("mlp.gate_proj.weight", 0),
              "ffn.up.weight": ("mlp.up_proj.weight", 0), "ffn.down.weight": ("mlp.down_proj.weight", 1)}
    if leaf not in simple:
        raise InitFromError(f"no Hugging Face LLaMA tensor for parameter {name!r}")
    hf, dim = simple[leaf]
    sl = weights.slice(layer + hf)
    if dim is None or tp == 1:
        return sl[:]
    return _chunk(sl, sl.get_shape()[dim], tp_rank, tp, dim)


def stage_loader(path, model_cfg):
    """``(name, tp_rank, tp) -> slice`` for ``parallel.stage.build_stage(weights=...)``."""
    mcfg = model_config(model_cfg)
    weights = HFWeights(path)
    return lambda name, tp_rank, tp: rank_slice(weights, name, mcfg, tp_rank, tp)


def check_config(cfg: dict) -> None:
    """``job.validate``'s check of ``model.init_from`` (a no-op when unset)."""
    path = (cfg.get("model") or {}).get("init_from")
    if path:
        check(path, cfg["model"])


def initial_weights(model_cfg):
    """``stage_loader`` of ``model.init_from``, or None (the seed's draw) when unset."""
    path = model_cfg.get("init_from") if hasattr(model_cfg, "get") else None
    return stage_loader(path, model_cfg) if path else None
