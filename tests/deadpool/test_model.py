"""The decoder: grouped-query attention against a plain reference, rope_theta, config checks,
activation checkpointing (same gradients, fewer saved activations)."""

import math

import pytest
import torch

from deadpool.model import (apply_rotary, build_model, init_param, model_config, rotary_tables)

GQA = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_mult=2,
           max_seq_len=16)
MHA = {k: v for k, v in GQA.items() if k != "n_kv_heads"}


def tokens(b=2, t=16, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def reference_attention(x, w_qkv, w_out, n_heads, n_kv_heads, theta):
    """Grouped-query causal attention written out: split q/k/v rows, rotate adjacent pairs as
    complex numbers (Meta's formulation), copy each KV head to its group of query heads
    (repeat_interleave), softmax over masked scores."""
    b, t, d = x.shape
    hd = d // n_heads
    q, k, v = (x @ w_qkv.T).split([n_heads * hd, n_kv_heads * hd, n_kv_heads * hd], dim=-1)
    q = q.view(b, t, n_heads, hd)
    k, v = k.view(b, t, n_kv_heads, hd), v.view(b, t, n_kv_heads, hd)
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2).double() / hd)
    rot = torch.polar(torch.ones(t, hd // 2, dtype=torch.float64),
                      torch.outer(torch.arange(t).double(), freqs))[None, :, None, :]

    def rotate(z):
        zc = torch.view_as_complex(z.double().reshape(*z.shape[:-1], hd // 2, 2))
        return torch.view_as_real(zc * rot).flatten(-2).float()

    q, k = rotate(q), rotate(k)
    group = n_heads // n_kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, t, d)
    return y @ w_out.T


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_attention_matches_a_written_out_reference(n_kv_heads, theta):
    torch.set_num_threads(1)
    model = build_model(dict(GQA, n_kv_heads=n_kv_heads, rope_theta=theta), 3)
    attn = model.blocks[0].attn
    hd = 32 // 4
    assert attn.qkv.weight.shape == ((4 + 2 * n_kv_heads) * hd, 32)  # HF q/k/v rows stacked
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1))
    got = attn(x, model.rope_cos, model.rope_sin)
    want = reference_attention(x, attn.qkv.weight, attn.out.weight, 4, n_kv_heads, theta)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_repeated_kv_heads_give_what_native_gqa_gives(monkeypatch):
    """The path for kernels without grouped-query support (CUDA fp32): KV heads copied to their
    groups, the same attention."""
    import deadpool.model as model_mod

    torch.set_num_threads(1)
    x, y = tokens()
    native = build_model(GQA, 2)(x, y)
    monkeypatch.setattr(model_mod, "native_gqa", lambda q: False)
    torch.testing.assert_close(build_model(GQA, 2)(x, y), native, rtol=1e-6, atol=0)


def test_multi_head_default_is_the_three_block_layout_bit_for_bit():
    """No n_kv_heads: as many KV heads as query heads, and attention computes exactly what it did
    before grouped-query attention (q, k, v = thirds of the fused projection)."""
    torch.set_num_threads(1)
    cfg = model_config(MHA)
    assert cfg.n_kv_heads == cfg.n_heads == 4 and cfg.rope_theta == 10000.0
    model = build_model(MHA, 5)
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    q, k, v = attn.qkv(x).split(32, dim=-1)
    q, k, v = (z.view(2, 16, 4, 8).transpose(1, 2) for z in (q, k, v))
    cos, sin = rotary_tables(8, 16)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    old = attn.out(y.transpose(1, 2).reshape(2, 16, 32))
    assert torch.equal(attn(x, model.rope_cos, model.rope_sin), old)


def test_rope_theta_default_is_ten_thousand_and_changes_the_output():
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, _ = rotary_tables(8, 16)
    assert torch.equal(cos, torch.outer(torch.arange(16).float(), inv).cos())
    x, y = tokens()
    base = build_model(GQA, 0)(x, y)
    assert torch.equal(build_model(dict(GQA, rope_theta=10000), 0)(x, y), base)
    assert not torch.equal(build_model(dict(GQA, rope_theta=500000.0), 0)(x, y), base)


def test_config_fields_keep_their_types():
    cfg = model_config(dict(GQA, rope_theta="5e5", n_layers=2.0))
    assert cfg.rope_theta == 500000.0 and isinstance(cfg.rope_theta, float)
    assert cfg.n_layers == 2 and isinstance(cfg.n_layers, int)
    assert model_config(dict(MHA, n_kv_heads=None)).n_kv_heads == 4


@pytest.mark.parametrize("change,msg", [
    (dict(n_kv_heads=3), r"n_kv_heads=3 must divide model.n_heads=4"),
    (dict(n_kv_heads=0), r"n_kv_heads=0 must be positive"),
    (dict(n_layers=2.5), r"n_layers must be an integer, got 2.5"),
    (dict(rope_theta="abc"), r"rope_theta must be a number"),
    (dict(rope_theta=-1.0), r"rope_theta=-1.0 must be positive"),
    (dict(d_model=36), r"d_model=36 must be n_heads=4 heads of an even size"),
])
def test_bad_model_configs_are_refused_naming_the_field(change, msg):
    with pytest.raises(ValueError, match=msg):
        model_config(dict(GQA, **change))


def saved_activation_bytes(model, x, y):
    """Bytes of distinct storages autograd keeps for backward during ``model(x, y)``, parameters
    excluded (what activation checkpointing is meant to cut)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        # detached: a saved output returned as itself would hold its own graph node (a cycle
        # that keeps the whole graph, and what it references, alive)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    return loss, sum(seen.values())


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradients_and_keeps_less(mode):
    torch.set_num_threads(1)
    x, y = tokens()
    runs = {}
    for m in ("none", mode):
        model = build_model(GQA, 4, activation_checkpointing=m)
        loss, kept = saved_activation_bytes(model, x, y)
        loss.backward()
        runs[m] = loss, kept, {n: p.grad for n, p in model.named_parameters()}
    (l0, kept0, g0), (l1, kept1, g1) = runs["none"], runs[mode]
    assert torch.equal(l0, l1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)  # bitwise, every parameter
    assert kept1 < kept0
    if mode == "selective":  # one T x f tensor (silu(gate), fp32) per layer fewer
        t, f = 2 * 16, model_config(GQA).ffn_hidden
        assert kept0 - kept1 == 2 * t * f * 4


def test_activation_checkpointing_is_off_without_grad_and_refuses_unknown_modes():
    x, y = tokens()
    with torch.no_grad():
        assert torch.equal(build_model(GQA, 0, activation_checkpointing="full")(x, y),
                           build_model(GQA, 0)(x, y))
    with pytest.raises(ValueError, match="activation_checkpointing must be one of"):
        build_model(GQA, 0, activation_checkpointing="some")


def test_the_threaded_init_draws_the_bits_of_a_serial_one(monkeypatch):
    import deadpool.init_rng as init_rng

    cfg = {"vocab_size": 96, "d_model": 32, "n_layers": 3, "n_heads": 4, "ffn_mult": 4, "max_seq_len": 16}
    monkeypatch.setattr(init_rng, "init_threads", lambda device: 4)
    monkeypatch.setitem(init_rng._CHUNK, "cpu", 256)  # several chunks per parameter, 4 at once
    threaded = build_model(cfg, seed=7)
    monkeypatch.undo()
    serial = {n: init_param(n, p.shape, 7) for n, p in threaded.named_parameters()}
    for n, p in threaded.named_parameters():
        assert torch.equal(p, serial[n]), n
    # each parameter its own draw: a wrong pairing of key and tensor would show here
    assert not torch.equal(serial["blocks.0.attn.qkv.weight"][:8], serial["blocks.1.attn.qkv.weight"][:8])
    assert all((p == 1).all() == n.endswith("norm.weight") for n, p in serial.items())
    assert abs(serial["embed.weight"].std() - 0.02) < 1e-3


def test_norm_eps_comes_from_the_model_config_everywhere():
    """``model.norm_eps`` reaches every RMSNorm of the model and of a pipeline/tensor-parallel
    stage, and the export's ``rms_norm_eps``; Llama 2/3 configs say 1e-5, the default (LLaMA 1,
    every existing config's bits) stays 1e-6."""
    import yaml
    from pathlib import Path

    from deadpool.export.llama import hf_config
    from deadpool.model import RMSNorm
    from deadpool.parallel.stage import build_stage

    conf = Path(__file__).resolve().parents[2] / "conf" / "model"
    for name, want in (("llama3_8b", 1e-5), ("llama3_70b", 1e-5), ("llama2_70b", 1e-5),
                       ("llama_7b", 1e-6), ("tiny", 1e-6)):
        m = yaml.safe_load((conf / f"{name}.yaml").read_text())
        assert model_config(m).norm_eps == want, name
        assert hf_config(m, torch.bfloat16)["rms_norm_eps"] == want, name
    cfg = dict(GQA, norm_eps=1e-5)
    for module in (build_model(cfg, 0), build_stage(cfg, 0, pp_rank=1, pp=2, tp_rank=0, tp=2)):
        norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
        assert norms and all(n.eps == 1e-5 for n in norms)
    x, y = tokens()
    assert not torch.equal(build_model(cfg, 0)(x, y), build_model(GQA, 0)(x, y))


def test_llama3_70b_has_its_published_shape():
    import yaml
    from pathlib import Path

    m = model_config(yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "model"
                                     / "llama3_70b.yaml").read_text()))
    assert (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size,
            m.rope_theta) == (80, 8192, 64, 8, 28672, 128256, 500000.0)
