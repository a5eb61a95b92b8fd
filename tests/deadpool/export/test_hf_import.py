"""model.init_from: a Hugging Face Llama directory read into any tp x pp stage, slice by slice,
bitwise the tensors that were exported; config and shape mismatches refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.export import export
from deadpool.export.hf_import import InitFromError, check, rank_slice, stage_loader, HFWeights
from deadpool.model import GPT, model_config
from deadpool.parallel.stage import build_stage
from deadpool.parallel.tensor.layers import shard
from deadpool.topology import ParallelDims
from tests.deadpool.export.test_export import MODEL, TOKENS, quiet, trained_like, write_run

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

GQA = dict(MODEL, n_kv_heads=2, rope_theta=500000.0, norm_eps=1e-5)


def stages_of(init_from, mcfg, dims: ParallelDims) -> dict[tuple[int, int], torch.nn.Module]:
    loader = stage_loader(init_from, mcfg)
    return {(pp, tp): build_stage(mcfg, 0, pp_rank=pp, pp=dims.pp, tp_rank=tp, tp=dims.tp,
                                  weights=loader)
            for pp in range(dims.pp) for tp in range(dims.tp)}


@pytest.mark.parametrize("mcfg", [pytest.param(MODEL, id="mha"), pytest.param(GQA, id="gqa")])
@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 2, 2)])
def test_export_then_import_gives_back_every_slice_bitwise(tmp_path, mcfg, dp, tp, pp):
    """A run (dp2 x tp2 x pp2 shards) exported, then imported into the layout: each stage's
    parameter is exactly ``shard`` of the trained full parameter."""
    model = trained_like(21, mcfg)
    write_run(tmp_path / "run", model, ParallelDims(2, 2, 2, ranks_per_node=2), mcfg=mcfg)
    export(tmp_path / "run", tmp_path / "hf", log=quiet)
    full = {n: p.detach() for n, p in model.named_parameters()}
    seen = set()
    for (_, tp_rank), stage in stages_of(tmp_path / "hf", mcfg, ParallelDims(dp, tp, pp, ranks_per_node=tp)).items():
        for name, p in stage.named_parameters():
            assert torch.equal(p, shard(name, full[name], tp_rank, tp, model_config(mcfg))), name
            seen.add(name)
    assert seen == set(full)


def test_import_without_the_inverse_rotary_reordering_differs(tmp_path, monkeypatch):
    """The comparison above sees the q/k row order: importing HF rows as they are fails it."""
    import deadpool.export.hf_import as hf_import

    model = trained_like(22)
    write_run(tmp_path / "run", model, ParallelDims(1, 1, 1))
    export(tmp_path / "run", tmp_path / "hf", log=quiet)
    monkeypatch.setattr(hf_import, "from_half", lambda w, n, hd: w)
    w = HFWeights(tmp_path / "hf")
    got = rank_slice(w, "blocks.0.attn.qkv.weight", MODEL, 0, 1)
    assert not torch.equal(got, model.blocks[0].attn.qkv.weight.detach())


def tiny_hf(tmp_path, dtype, mcfg=GQA, shard_size=None):
    """A random ``LlamaForCausalLM`` of ``mcfg``'s shapes saved by transformers itself."""
    m = model_config(mcfg)
    conf = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_hidden,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads,
        max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        tie_word_embeddings=False)
    if getattr(conf, "rope_parameters", None) is not None:  # transformers 5
        conf.rope_parameters = {"rope_type": "default", "rope_theta": m.rope_theta}
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(conf)
    with torch.no_grad():  # far from init: norms not ones, scores of order one
        for name, p in hf.named_parameters():
            p.add_(torch.randn(p.shape) * (0.5 if "norm" in name else 0.3))
    hf = hf.to(dtype)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    hf.save_pretrained(str(tmp_path), safe_serialization=True, **kw)
    return hf


@pytest.mark.parametrize("dtype,shards", [(torch.float32, None), (torch.bfloat16, "40KB")])
def test_a_transformers_checkpoint_gives_transformers_logits(tmp_path, dtype, shards):
    """GQA, rope_theta 500000, fp32 or bf16, one file or sharded with an index: DeadPool's model
    imported from it computes transformers' own logits."""
    tiny_hf(tmp_path / "hf", dtype, shard_size=shards)
    # loaded afresh in fp32: a bf16 model cast back would keep bf16-rounded rotary frequencies
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == bool(shards)
    check(tmp_path / "hf", GQA)
    loader = stage_loader(tmp_path / "hf", GQA)
    model = GPT(model_config(GQA))
    model.load_state_dict({n: loader(n, 0, 1).float() for n, _ in model.named_parameters()})
    with torch.no_grad():
        ref = hf(TOKENS).logits
        got = model(TOKENS)
    assert ref.abs().max() > 1.0
    assert (got - ref).abs().max().item() < 1e-4


def test_import_then_export_then_import_is_bitwise(tmp_path):
    """transformers' files -> stages (dp2 x tp2 x pp2) -> a run's final/ -> export: the same
    tensors, bit for bit (bf16 in, fp32 stages, exported back as bf16)."""
    from safetensors.torch import load_file

    tiny_hf(tmp_path / "a", torch.bfloat16)
    dims = ParallelDims(2, 2, 2, ranks_per_node=2)
    stages = stages_of(tmp_path / "a", GQA, dims)
    (tmp_path / "run" / "final").mkdir(parents=True)
    for r in range(dims.world_size):
        c = dims.coords(r)
        flat = torch.cat([p.detach().reshape(-1) for p in stages[(c["pp"], c["tp"])].parameters()])
        torch.save({"params": flat}, tmp_path / "run" / "final" / f"rank{r}.pt")
    (tmp_path / "run" / "job.json").write_text(json.dumps(
        {"model": GQA, "seed": 0, "parallel": {"dp": 2, "tp": 2, "pp": 2}, "data": {"name": "synthetic"}}))
    export(tmp_path / "run", tmp_path / "b", dtype="bfloat16", log=quiet)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("field,value,msg", [
    ("hidden_size", 128, "hidden_size=128 but the model config has d_model=64"),
    ("intermediate_size", 100, "intermediate_size=100"),
    ("num_key_value_heads", 4, "num_key_value_heads=4 but the model config has n_kv_heads=2"),
    ("rope_theta", 10000.0, "rope_theta=10000.0 but the model config has rope_theta=500000.0"),
    ("rms_norm_eps", 1e-6, "rms_norm_eps=1e-06"),
    ("vocab_size", 100, "vocab_size=100"),
    ("num_hidden_layers", 2, "num_hidden_layers=2 but the model config has n_layers=3"),
])
def test_config_mismatches_are_refused_naming_the_field(tmp_path, field, value, msg):
    tiny_hf(tmp_path, torch.float32)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf[field] = value
    if field == "rope_theta" and "rope_parameters" in conf:
        conf["rope_parameters"]["rope_theta"] = value
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(InitFromError, match=msg.replace("(", r"\(")):
        check(tmp_path, GQA)


def test_a_tensor_of_the_wrong_shape_or_a_missing_one_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_hf(tmp_path, torch.float32)
    f = tmp_path / "model.safetensors"
    t = load_file(str(f))
    good = t["model.layers.1.mlp.down_proj.weight"]
    t["model.layers.1.mlp.down_proj.weight"] = good[:, :-32].contiguous()
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(InitFromError, match=r"tensor model.layers.1.mlp.down_proj.weight has shape \[64, 160\]"):
        check(tmp_path, GQA)
    t["model.layers.1.mlp.down_proj.weight"] = good
    del t["model.norm.weight"]
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(InitFromError, match="tensor model.norm.weight is missing"):
        check(tmp_path, GQA)
    with pytest.raises(InitFromError, match="no config.json"):
        check(tmp_path / "nowhere", GQA)
