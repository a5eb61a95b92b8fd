"""python -m deadpool.export: tp/pp shards consolidated through the sharding code, loaded by
transformers.LlamaForCausalLM with logits equal to DeadPool's single-process model."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from deadpool.export import ExportError, export
from deadpool.export.consolidate import stage_params
from deadpool.export.llama import to_hf
from deadpool.model import ModelConfig, build_model, model_config
from deadpool.parallel.tensor.layers import shard
from deadpool.topology import ParallelDims

transformers = pytest.importorskip("transformers")

MODEL = {"vocab_size": 96, "d_model": 64, "n_layers": 3, "n_heads": 4, "ffn_mult": 4,
         "max_seq_len": 32}
quiet = lambda *a, **k: None  # noqa: E731


# grouped-query attention, where the model has it (two query heads per key/value head)
GQA = pytest.param(dict(MODEL, n_kv_heads=2), id="gqa", marks=pytest.mark.skipif(
    "n_kv_heads" not in ModelConfig.__dataclass_fields__, reason="model without n_kv_heads"))
# shard() of a model with grouped-query attention takes the config (the q/k/v row split)
SHARD_KW = "model_cfg" in inspect.signature(shard).parameters


def trained_like(seed: int, mcfg=MODEL) -> torch.nn.Module:
    """The single-process model with weights far from init (attention scores of order one, norms
    not all ones), so a wrong layout cannot hide in near-uniform softmaxes."""
    model = build_model(mcfg, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("norm.weight") else 0.3
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def rank_states(model, dims: ParallelDims, mcfg=MODEL, pad: int = 3) -> dict[int, dict]:
    """What each rank of ``dims`` would write to final/: its stage's slices (``shard``), flat, in
    the stage's parameter order, zero-padded as ZeRO-1 pads; AdamW state beside it."""
    full = dict(model.named_parameters())
    kw = {"model_cfg": model_config(mcfg)} if SHARD_KW else {}
    states = {}
    for r in range(dims.world_size):
        c = dims.coords(r)
        parts = [shard(n, full[n].detach(), c["tp"], dims.tp, **kw).reshape(-1)
                 for n, _ in stage_params(model_config(mcfg), c["pp"], dims.pp, c["tp"], dims.tp)]
        flat = torch.cat(parts + [torch.zeros(pad)])
        states[r] = {"params": flat, "exp_avg": torch.zeros(5), "step": torch.tensor(3.0)}
    return states


def write_run(tmp_path, model, dims, seed=5, data=None, mcfg=MODEL) -> None:
    (tmp_path / "final").mkdir(parents=True)
    for r, st in rank_states(model, dims, mcfg).items():
        torch.save(st, tmp_path / "final" / f"rank{r}.pt")
    job = {"model": mcfg, "seed": seed, "parallel": {"dp": dims.dp, "tp": dims.tp, "pp": dims.pp},
           "data": data or {"name": "synthetic"}}
    (tmp_path / "job.json").write_text(json.dumps(job))


def hf_logits(out_dir, tokens):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        return hf(tokens).logits


TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mcfg", [pytest.param(MODEL, id="mha"), GQA])
@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 2, 2), (1, 4, 3)])
def test_exported_logits_equal_the_single_process_model(tmp_path, dp, tp, pp, mcfg):
    if tp > int(mcfg.get("n_kv_heads") or mcfg["n_heads"]):
        pytest.skip("a rank holds whole key/value heads")
    model = trained_like(11, mcfg)
    write_run(tmp_path / "run", model, ParallelDims(dp, tp, pp, ranks_per_node=tp), mcfg=mcfg)
    export(tmp_path / "run", tmp_path / "hf", log=quiet)
    with torch.no_grad():
        ref = model(TOKENS)
    got = hf_logits(tmp_path / "hf", TOKENS)
    assert ref.abs().max() > 1.0  # far from uniform
    assert (got - ref).abs().max().item() < 1e-4


def test_without_the_rotary_reordering_the_logits_differ(tmp_path, monkeypatch):
    """The comparison above is sensitive to the q/k layout: skipping the reordering breaks it."""
    import deadpool.export.llama as llama

    model = trained_like(12)
    write_run(tmp_path / "run", model, ParallelDims(1, 2, 1, ranks_per_node=2))
    monkeypatch.setattr(llama, "rotary_to_half", lambda w, n, hd: w.contiguous())
    export(tmp_path / "run", tmp_path / "hf", log=quiet)
    with torch.no_grad():
        ref = model(TOKENS)
    assert (hf_logits(tmp_path / "hf", TOKENS) - ref).abs().max().item() > 1e-2


def test_sharded_safetensors_with_an_index_load_the_same(tmp_path):
    model = trained_like(13)
    write_run(tmp_path / "run", model, ParallelDims(2, 1, 2))
    export(tmp_path / "run", tmp_path / "one", log=quiet)
    export(tmp_path / "run", tmp_path / "many", max_shard_size="60KB", log=quiet)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all((tmp_path / "many" / f).exists() for f in files)
    assert set(index["weight_map"]) == set(to_hf(dict(model.named_parameters()), MODEL))
    assert torch.equal(hf_logits(tmp_path / "one", TOKENS), hf_logits(tmp_path / "many", TOKENS))


def test_dtype_kept_or_converted(tmp_path):
    model = trained_like(14)
    write_run(tmp_path / "run", model, ParallelDims(1, 2, 2, ranks_per_node=2))
    from safetensors.torch import load_file

    export(tmp_path / "run", tmp_path / "a", log=quiet)
    assert load_file(str(tmp_path / "a" / "model.safetensors"))["lm_head.weight"].dtype == torch.float32
    export(tmp_path / "run", tmp_path / "b", dtype="bfloat16", log=quiet)
    t = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert t["lm_head.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bad_sources_are_refused(tmp_path):
    model = trained_like(15)
    dims = ParallelDims(1, 2, 2, ranks_per_node=2)
    write_run(tmp_path / "run", model, dims)
    with pytest.raises(ExportError, match="no such directory"):
        export(tmp_path / "nothing", tmp_path / "o", log=quiet)
    (tmp_path / "run" / "final" / "rank3.pt").unlink()
    with pytest.raises(ExportError, match="rank3.pt is missing"):
        export(tmp_path / "run", tmp_path / "o", log=quiet)
    # a config that does not match the state
    write_run(tmp_path / "run2", model, dims)
    job = json.loads((tmp_path / "run2" / "job.json").read_text())
    job["model"] = dict(MODEL, d_model=128)
    (tmp_path / "run2" / "job.json").write_text(json.dumps(job))
    with pytest.raises(ExportError, match="does not match"):
        export(tmp_path / "run2", tmp_path / "o", log=quiet)


def test_a_mixed_precision_run_exports_bf16_or_its_fp32_master_weights(tmp_path):
    """bf16 ``params`` on every replica and fp32 ``master`` shards, one per data-parallel rank
    (ZeRO-1): as stored, bf16; ``--dtype float32``, the masters exactly (not bf16 upcast)."""
    model = trained_like(16)
    dims = ParallelDims(2, 2, 1, ranks_per_node=2)
    write_run(tmp_path / "run", model, dims)
    for r in range(dims.world_size):
        f = tmp_path / "run" / "final" / f"rank{r}.pt"
        st = torch.load(f)
        full32, dp = st["params"], dims.coords(r)["dp"]
        n = -(-full32.numel() // dims.dp)
        padded = torch.cat([full32, torch.zeros(n * dims.dp - full32.numel())])
        st["params"], st["master"] = full32.to(torch.bfloat16), padded[dp * n:(dp + 1) * n].clone()
        torch.save(st, f)
    from safetensors.torch import load_file

    export(tmp_path / "run", tmp_path / "bf16", log=quiet)
    export(tmp_path / "run", tmp_path / "fp32", dtype="float32", log=quiet)
    a = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    b = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    ref = to_hf({n: p.detach() for n, p in model.named_parameters()}, MODEL)
    assert all(a[k].dtype == torch.bfloat16 and torch.equal(a[k], ref[k].to(torch.bfloat16)) for k in ref)
    assert all(b[k].dtype == torch.float32 and torch.equal(b[k], ref[k]) for k in ref)


def test_a_rank_without_parameters_takes_them_from_a_data_parallel_peer(tmp_path):
    """A checkpoint rank written from its buddy's replica holds only its optimizer shard; the
    parameters come from a data-parallel peer of the same stage, and without one it is refused."""
    model = trained_like(17)
    dims = ParallelDims(2, 2, 1, ranks_per_node=2)
    write_run(tmp_path / "run", model, dims)
    f0 = tmp_path / "run" / "final" / "rank0.pt"  # (pp 0, dp 0, tp 0); its peer is rank 2
    st = torch.load(f0)
    del st["params"]
    torch.save(st, f0)
    export(tmp_path / "run", tmp_path / "hf", log=quiet)
    with torch.no_grad():
        assert (hf_logits(tmp_path / "hf", TOKENS) - model(TOKENS)).abs().max().item() < 1e-4
    f2 = tmp_path / "run" / "final" / "rank2.pt"
    st = torch.load(f2)
    del st["params"]
    torch.save(st, f2)
    with pytest.raises(ExportError, match=r"no rank of stage \(pp 0, tp 0\)"):
        export(tmp_path / "run", tmp_path / "hf2", log=quiet)
