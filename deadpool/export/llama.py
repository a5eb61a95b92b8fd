"""DeadPool's decoder as Hugging Face's ``LlamaForCausalLM``: names, q/k layout, config.json.

The architectures are the same (RMSNorm, rotary attention without biases, SwiGLU, an untied
head). Two layouts differ:

* Attention projections: DeadPool fuses q, k and v into ``attn.qkv`` (rows: all query heads,
  then the key heads, then the value heads); Hugging Face keeps ``q_proj``, ``k_proj``,
  ``v_proj``.
* Rotary pairs: DeadPool rotates interleaved pairs ``(x[2i], x[2i+1])`` by frequency ``i``
  (``model.apply_rotary``); Hugging Face's ``rotate_half`` pairs ``(x[i], x[i + d/2])``. So
  within each query and key head the output rows are reordered evens-then-odds: HF row ``i`` is
  DeadPool row ``2i``, HF row ``d/2 + i`` is row ``2i + 1``. Both q and k get the same
  reordering, so attention scores are unchanged; v and the output projection are untouched.

Names:  embed -> model.embed_tokens   blocks.L.attn_norm -> model.layers.L.input_layernorm
        blocks.L.attn.out -> self_attn.o_proj   blocks.L.ffn_norm -> post_attention_layernorm
        blocks.L.ffn.{gate,up,down} -> mlp.{gate,up,down}_proj   norm -> model.norm
        head -> lm_head
"""

from __future__ import annotations

import re

import torch

from deadpool.export.consolidate import ExportError
from deadpool.model import GPT, model_config

SIMPLE = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn.out.weight": "self_attn.o_proj.weight", "ffn.gate.weight": "mlp.gate_proj.weight",
          "ffn.up.weight": "mlp.up_proj.weight", "ffn.down.weight": "mlp.down_proj.weight",
          "attn.q.weight": "self_attn.q_proj.weight", "attn.k.weight": "self_attn.k_proj.weight",
          "attn.v.weight": "self_attn.v_proj.weight"}
TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "head.weight": "lm_head.weight"}


def heads(mcfg) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim); ``n_kv_heads`` defaults to ``n_heads``."""
    n_heads = int(mcfg.n_heads)
    n_kv = int(getattr(mcfg, "n_kv_heads", None) or n_heads)
    return n_heads, n_kv, int(mcfg.d_model) // n_heads


def rotary_to_half(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection from interleaved rotary pairs to rotate-half order."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return w.view(n_heads, head_dim, -1)[:, order].reshape(n_heads * head_dim, -1).contiguous()


def to_hf(full: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` state dict from the full DeadPool parameters."""
    mcfg = model_config(model_cfg)
    n_heads, n_kv, hd = heads(mcfg)
    out = {}
    for name, t in full.items():
        if name in TOP:
            out[TOP[name]] = t.contiguous()
            continue
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if m is None:
            raise ExportError(f"no Hugging Face LLaMA name for parameter {name!r}")
        layer, leaf = f"model.layers.{m.group(1)}.", m.group(2)
        if leaf == "attn.qkv.weight":
            q, k, v = t.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=0)
            out[layer + "self_attn.q_proj.weight"] = rotary_to_half(q, n_heads, hd)
            out[layer + "self_attn.k_proj.weight"] = rotary_to_half(k, n_kv, hd)
            out[layer + "self_attn.v_proj.weight"] = v.contiguous()
        elif leaf == "attn.kv.weight":
            k, v = t.split([n_kv * hd, n_kv * hd], dim=0)
            out[layer + "self_attn.k_proj.weight"] = rotary_to_half(k, n_kv, hd)
            out[layer + "self_attn.v_proj.weight"] = v.contiguous()
        elif leaf in ("attn.q.weight", "attn.k.weight"):
            out[layer + SIMPLE[leaf]] = rotary_to_half(t, n_heads if leaf == "attn.q.weight" else n_kv, hd)
        elif leaf in SIMPLE:
            out[layer + SIMPLE[leaf]] = t.contiguous()
        else:
            raise ExportError(f"no Hugging Face LLaMA name for parameter {name!r}")
    return out


def hf_config(model_cfg, dtype: torch.dtype, eos_id: int | None = None,
              bos_id: int | None = None) -> dict:
    """``config.json`` of the exported model (read by ``LlamaConfig``; ``rope_theta`` and
    ``rope_parameters`` both given, for transformers before and after 5.0). ``bos_id``: the
    tokenizer's own BOS (default: the EOS, as prepare's byte-level BPE has one special token)."""
    mcfg = model_config(model_cfg)
    n_heads, n_kv, hd = heads(mcfg)
    with torch.device("meta"):
        eps = GPT(mcfg).norm.eps  # the model's own RMSNorm epsilon
    theta = float(getattr(mcfg, "rope_theta", None) or 10000.0)
    name = str(dtype).removeprefix("torch.")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": mcfg.vocab_size, "hidden_size": mcfg.d_model,
            "intermediate_size": mcfg.ffn_hidden, "num_hidden_layers": mcfg.n_layers,
            "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "head_dim": hd,
            "hidden_act": "silu", "max_position_embeddings": mcfg.max_seq_len,
            "rms_norm_eps": eps, "rope_theta": theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
            "bos_token_id": eos_id if bos_id is None else bos_id, "eos_token_id": eos_id, "torch_dtype": name, "dtype": name}
